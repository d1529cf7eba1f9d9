"""experiment: the commands behind docs/results.md."""

from __future__ import annotations

from pathlib import Path

from .common import UsageError

# ---------------------------------------------------------------------------- experiment

def cmd_experiment(args) -> int:
    from ..experiments import EXPERIMENTS, ORDER, commands, run_experiment

    if args.list or not args.name:
        for n in ORDER:
            print(f"{n}: {EXPERIMENTS[n][0]}")
            for c in commands(n, args.quick):
                print("    python bench/" + " ".join(c))
        return 0
    if args.quick_dir and not args.quick:
        raise UsageError("--quick-dir goes with --quick; full-size results always go to "
                         "bench/results and docs/.")
    page = run_experiment(args.name, quick=args.quick, redo=args.redo,
                          quick_dir=Path(args.quick_dir).resolve() if args.quick_dir else None)
    print(f"results page: {page}")
    return 0
