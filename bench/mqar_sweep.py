"""Zoology's protocol for one MQAR config: train it at several learning rates and report the
best, with every rate's record.

    python bench/mqar_sweep.py configs/mqar/softmax_kv64.toml [--lrs 1e-4,4.6e-4,2.2e-3,1e-2]
    python bench/mqar_sweep.py --snapshot configs/mqar/softmax_kv64.toml

Each rate is one ``bench/mqar_runs.py`` run (resumable, recorded as
bench/results/mqar-<name>-lr<rate>.json); the config's own rate is its plain record
(mqar-<name>.json), so a run already made is not made again, and it is always one of the
rates compared (added to --lrs when not in it). Rates run one after another.
Once every rate's record exists (complete, or with ``--snapshot`` as far as it got), the plain
record gains ``lr_sweep`` (every rate: accuracy, fresh-set accuracy, steps, whether complete,
its record, whether it is ranked) and ``lr_best`` (the rate with the highest held-out recall at
its last evaluation, complete runs before unfinished ones, among the rates trained to the
config's own step limit: a rate run to another limit, a schedule compressed to fit a machine,
is listed but not ranked); the results page reports that rate's run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import RESULTS, ROOT, replace_json

from continuumlm.config import load_config

# Zoology's MQAR sweep: np.logspace(-4, -2, 4)
ZOOLOGY_LRS = "1e-4,4.6e-4,2.2e-3,1e-2"
RUNS_SCRIPT = str(Path(__file__).parent / "mqar_runs.py")


def tag(lr: float) -> str:
    return f"lr{lr:g}"


def rates(base_lr: float, lrs: list[float]) -> list[float]:
    """The rates compared: ``lrs`` and the config's own."""
    return sorted(set(lrs) | {base_lr})


def summarize(name: str, base_lr: float, lrs: list[float],
              snapshot: bool = False) -> dict | None:
    """The plain record with ``lr_sweep`` and ``lr_best`` filled in from the record of every
    rate (``lrs`` and the config's own); None while a rate has no record yet. With
    ``snapshot``, a rate stopped before its first evaluation (so without a record) is listed
    as such (no recall, no record) and the others are summarized; None when no rate has one."""
    base_path = RESULTS / f"{name}.json"
    rows = []
    for lr in rates(base_lr, lrs):
        path = base_path if lr == base_lr else RESULTS / f"{name}-{tag(lr)}.json"
        if not path.exists():
            if not snapshot:
                return None
            rows.append({"lr": lr, "accuracy": None, "fresh_accuracy": None, "steps": 0,
                         "max_steps": None, "complete": False, "record": None})
            continue
        r = json.loads(path.read_text())
        rows.append({"lr": lr, "accuracy": r["accuracy"],
                     "fresh_accuracy": r.get("fresh_accuracy"), "steps": r["steps"],
                     "max_steps": r["max_steps"], "complete": r.get("complete", True),
                     "record": path.name})
    if not base_path.exists():
        return None
    # rates are compared only at the step limit of the config's own rate: a run whose
    # schedule was compressed to fit a machine's time (bench/gpu_mqar_sweep.sh) ends
    # "complete" after a fraction of the steps, and says nothing about which rate is best
    # over the config's schedule. Such rates are listed, marked not ranked.
    base = json.loads(base_path.read_text())
    for r in rows:
        r["ranked"] = r["record"] is not None and r["max_steps"] == base["max_steps"]
    best = max((r for r in rows if r["ranked"]), key=lambda r: (r["complete"], r["accuracy"]))
    return {**base, "lr_sweep": rows, "lr_best": best["lr"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--lrs", default=ZOOLOGY_LRS, help=f"comma-separated (default {ZOOLOGY_LRS})")
    ap.add_argument("--extra-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="more --set options of the swept rates' runs, after train.lr (a "
                         "sweep sized to a machine, bench/gpu_mqar_sweep.sh); the config's own "
                         "rate is its plain record and takes none")
    ap.add_argument("--snapshot", action="store_true",
                    help="record every rate's run as far as it got (bench/mqar_runs.py "
                    "--snapshot) and summarize")
    args = ap.parse_args()
    config = Path(args.config)
    config = config if config.is_absolute() else ROOT / config
    try:
        lrs = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"--lrs {args.lrs!r}: give comma-separated numbers, e.g. {ZOOLOGY_LRS}")
    if len(set(lrs)) != len(lrs) or not lrs or min(lrs) <= 0:
        sys.exit(f"--lrs {args.lrs!r}: give distinct positive rates")
    base_lr = load_config(config).train.lr
    name = f"mqar-{config.stem}"
    for lr in rates(base_lr, lrs):
        cmd = [sys.executable, RUNS_SCRIPT, str(config)]
        if lr != base_lr:
            cmd += ["--set", f"train.lr={lr:g}",
                    *sum((["--set", x] for x in args.extra_set), []), "--tag", tag(lr)]
        if args.snapshot:
            cmd.append("--snapshot")
        print(f"learning rate {lr:g}: {' '.join(cmd[1:]).replace(str(ROOT) + '/', '')}",
              flush=True)
        r = subprocess.run(cmd)
        if r.returncode and not args.snapshot:
            sys.exit(f"the run at learning rate {lr:g} ended with exit status {r.returncode}; "
                     f"the same command continues the sweep")
    summary = summarize(name, base_lr, lrs, snapshot=args.snapshot)
    if summary is None:
        sys.exit(f"not every rate of {name} has a record yet; nothing summarized")
    replace_json(RESULTS / f"{name}.json", summary)
    print(json.dumps({"lr_sweep": summary["lr_sweep"], "lr_best": summary["lr_best"]}))


if __name__ == "__main__":
    main()
