"""Run transformers' own model test suite (``ModelTesterMixin``, ``ConfigTester``) against the
continuumlm.hf adapter: ``make test-hf-suite``, or ``python tests/hf_conformance/run.py
[--mask ones,padded] [-- PYTEST_ARGS...]``.

The suite's files (tests/test_modeling_common.py, tests/test_configuration_common.py) are taken
from the source distribution of the *installed* transformers release, downloaded once into
.cache/hf-suite/ (ignored by git) and never committed; later runs work offline. The installed
version is read rather than pinned in the dev extra because the mixin reaches into
transformers' internals (loading, conversion mapping, integrations) that change between
releases: a suite from another release than the library under test fails for reasons of its
own, and pinning would make every ``make install-dev`` replace the user's transformers.

The sdist leaves out a few modules the suite imports; small stand-ins are generated next to
the extracted files (never written over an upstream file). One pytest process runs per mask
("ones": all-ones attention masks; "padded": right-padded masks, as transformers' causal-LM
testers build them), and a summary per configuration follows from its JUnit report.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = REPO / ".cache" / "hf-suite"
TESTER = HERE / "test_upstream_suite.py"
MASKS = ("ones", "padded", "random")
MARK = "# continuumlm stand-in:"

# modules the suite imports that the sdist does not ship: path -> text
SHIMS = {
    "tests/__init__.py": f"{MARK} the sdist lacks tests/__init__.py (the suite uses relative imports)\n",
    "tests/exporters/__init__.py": f"{MARK} package of the stand-in below\n",
    "tests/exporters/test_export.py": (
        f"{MARK} the sdist lacks tests/exporters/test_export.py\n"
        "class ExportTesterMixin:\n    pass\n"),
    "tests/generation/__init__.py": f"{MARK} package of the stand-in below\n",
    "tests/generation/test_utils.py": (
        f"{MARK} the sdist lacks tests/generation/test_utils.py\n"
        "class GenerationTesterMixin:\n    pass\n"),
    "tests/utils/__init__.py": f"{MARK} package of the stand-in below\n",
    # ConfigTester.check_config_arguments_init reads config_common_kwargs: non-default values of
    # PretrainedConfig's common attributes (our own choice of values)
    "tests/utils/test_configuration_utils.py": (
        f"{MARK} the sdist lacks tests/utils/test_configuration_utils.py; non-default values of "
        "PretrainedConfig's common attributes\n"
        "config_common_kwargs = {\n"
        '    "architectures": ["ContinuumLMForCausalLM"],\n'
        '    "output_hidden_states": True,\n'
        '    "return_dict": False,\n'
        '    "dtype": "float16",\n'
        '    "chunk_size_feed_forward": 5,\n'
        '    "id2label": {0: "first"},\n'
        '    "label2id": {"first": 0},\n'
        '    "problem_type": "regression",\n'
        "}\n"),
}


def fetch_suite(version: str) -> Path:
    """The extracted suite of transformers ``version`` (its root holds tests/), downloaded and
    extracted on first use."""
    root = CACHE / f"transformers-{version}"
    if not (root / "tests" / "test_modeling_common.py").is_file():
        sdist = CACHE / f"transformers-{version}.tar.gz"
        if not sdist.is_file():
            print(f"downloading the transformers {version} source distribution into {CACHE}",
                  flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--no-binary", ":all:", f"transformers=={version}", "-d", str(CACHE)],
                           check=True)
        prefix = f"transformers-{version}/tests/"
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(CACHE, members=members, **safe)
    for rel, text in SHIMS.items():
        path = root / rel
        if path.exists() and not path.read_text().startswith(MARK):
            continue  # a later sdist ships it: use the real one
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return root


def summarize(report: Path, mask: str) -> tuple[int, list[str]]:
    """Print per-configuration counts and each failure's first message line; return the number
    of failures and errors, and the summary lines."""
    counts: dict[str, dict[str, int]] = {}
    failures: dict[str, list[str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        config = case.get("classname", "?").rsplit(".", 1)[-1]
        c = counts.setdefault(config, {"passed": 0, "failed": 0, "skipped": 0})
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            c["failed"] += 1
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.setdefault(config, []).append(
                f"{case.get('name')}: {first[0][:160] if first else '?'}")
        elif case.find("skipped") is not None:
            c["skipped"] += 1
        else:
            c["passed"] += 1
    lines, total = [], 0
    for config, c in counts.items():
        total += c["failed"]
        lines.append(f"[mask={mask}] {config}: {c['passed']} passed, {c['failed']} failed, "
                     f"{c['skipped']} skipped")
        lines.extend(f"    FAILED {f}" for f in failures.get(config, []))
    return total, lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mask", default="ones,padded",
                    help=f"comma-separated attention masks to run with, of {', '.join(MASKS)}")
    ap.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = ap.parse_args(argv)
    masks = [m for m in args.mask.split(",") if m]
    for m in masks:
        if m not in MASKS:
            ap.error(f"unknown mask {m!r}; choose from {', '.join(MASKS)}")
    version = importlib.metadata.version("transformers")
    suite = fetch_suite(version)
    env = dict(os.environ, CONTINUUMLM_HF_SUITE=str(suite), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny models; leave the other cores alone
    failed, summary = 0, []
    start = time.monotonic()
    for mask in masks:
        report = CACHE / f"report-{mask}.xml"
        report.unlink(missing_ok=True)
        print(f"== transformers {version} model suite, mask={mask}", flush=True)
        subprocess.run([sys.executable, "-m", "pytest", str(TESTER), "-p", "no:cacheprovider",
                        "--disable-warnings", "-rN", "--tb=line",
                        f"--junitxml={report}", *args.pytest_args],
                       env={**env, "CONTINUUMLM_HF_SUITE_MASK": mask}, cwd=REPO)
        if not report.is_file():
            print(f"no report for mask={mask}: pytest did not run", file=sys.stderr)
            return 2
        n, lines = summarize(report, mask)
        failed += n
        summary.extend(lines)
    print(f"\n== summary (transformers {version}, {time.monotonic() - start:.0f} s)")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
