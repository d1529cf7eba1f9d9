"""experiment: the commands behind docs/results.md. The experiments are the repository's
(``bench/experiment.py``, beside the benchmark scripts they run), not the installed library's:
this command finds that file in the checkout it is run from and runs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .common import UsageError

# ---------------------------------------------------------------------------- experiment


def find_repo(start: Path | None = None) -> Path:
    """The ContinuumLM checkout at or above ``start`` (default: the working folder)."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "bench" / "experiment.py").is_file() and (d / "configs").is_dir():
            return d
    raise UsageError(
        f"`continuumlm experiment` runs the experiments of a ContinuumLM checkout "
        f"(bench/experiment.py, its benchmark scripts and configs), and none was found at or "
        f"above {here}; cd into the repository first.")


def cmd_experiment(args) -> int:
    repo = find_repo()
    spec = importlib.util.spec_from_file_location("continuumlm_bench_experiment",
                                                  repo / "bench" / "experiment.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(repo / "bench"))  # its own imports (common, ...)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(module)
        argv = ([args.name] if args.name else []) + (["--quick"] if args.quick else []) \
            + (["--redo"] if args.redo else []) + (["--list"] if args.list else []) \
            + (["--quick-dir", args.quick_dir] if args.quick_dir else [])
        return module.main(argv)
    finally:
        sys.path.remove(str(repo / "bench"))
        sys.modules.pop(spec.name, None)
