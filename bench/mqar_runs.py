"""One MQAR config: train (resumable), score, and record the result.

    python bench/mqar_runs.py configs/mqar/deltanet_kv64.toml [--set SECTION.KEY=VALUE ...]
    python bench/mqar_runs.py --snapshot configs/mqar/deltanet_kv64.toml
    python bench/mqar_runs.py --by-distance configs/mqar/deltanet_kv64.toml
    python bench/mqar_runs.py --fresh configs/mqar/deltanet_kv64.toml
    python bench/mqar_runs.py configs/mqar/deltanet_kv64.toml --set train.lr=1e-2 --tag lr1e-2

Runs ``continuumlm mqar`` into runs/bench/mqar-<name> (it continues from its checkpoints when
interrupted) and writes bench/results/mqar-<name>.json once the run is complete; a config whose
complete JSON exists is skipped, and so is one whose JSON records an unfinished run (see
--snapshot) whose run folder is gone (delete the JSON to train it again from scratch).
``--snapshot`` (safe while the run is going) records how far an unfinished run has got,
marked ``"complete": false``, unless the JSON already holds a record from further along: a run
that cannot finish in one sitting still leaves a committed figure.
Each record carries the held-out recall split by the distance from query to key-value pair
(``recall_by_distance``); ``--by-distance`` adds it to a record made without it, from the run
folder's state at the record's step. A complete record also carries ``fresh_accuracy``: the
final model's recall on a second held-out set from another seed. The first one decides when a
run stops (``stop_accuracy``), so the accuracy at the stop is slightly optimistic; the fresh set
was never seen. ``--fresh`` adds it to a complete record made without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from common import RESULTS, ROOT, RUNS, cpu_model, replace_json
from experiment import run_child

from continuumlm.config import load_config
from continuumlm.train.mqar_results import fresh_recall, progress, recall_by_distance

# the package as a module of this interpreter: a machine with the source tree on PYTHONPATH
# and no install (bench/gpu_mqar_sweep.sh on a GPU machine) has no continuumlm script
CLI = [sys.executable, "-m", "continuumlm"]


def _device(config: Path, overrides: list[str]) -> str:
    """Where the run trains (its train.device, "auto" resolved as the trainer does) and in which
    autocast precision, in words: a sweep may mix CPU and GPU rates."""
    import torch

    from continuumlm.train.device import pick_device, resolve_dtype

    t = load_config(config, overrides).train
    device = pick_device(t.device)
    dtype = resolve_dtype(device, t.dtype)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {dtype}"
    return f"{cpu_model()}, {os.cpu_count()} cores, {device.type.upper()}, {dtype}"


def _record(result: dict, config: Path, overrides: list[str], cmd: list[str]) -> dict:
    result.update(config=str(config.relative_to(ROOT)), overrides=overrides,
                  command="continuumlm " + " ".join(cmd[len(CLI):]).replace(str(ROOT) + "/", ""),
                  machine=_device(config, overrides))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--tag", help="a variant of the config made by --set options (e.g. another "
                    "learning rate): recorded as mqar-<name>-<tag>.json, trained in "
                    "runs/bench/mqar-<name>-<tag>")
    ap.add_argument("--snapshot", action="store_true",
                    help="record an unfinished run's progress and exit")
    ap.add_argument("--by-distance", action="store_true",
                    help="add recall by query distance to the existing record and exit")
    ap.add_argument("--fresh", action="store_true",
                    help="add the final model's recall on a fresh held-out set (one the run's "
                    "stopping rule never saw) to an existing complete record and exit")
    args = ap.parse_args()
    config = Path(args.config)
    config = config if config.is_absolute() else (ROOT / config)
    name = f"mqar-{config.stem}" + (f"-{args.tag}" if args.tag else "")
    dest = RESULTS / f"{name}.json"

    def recorded() -> dict | None:
        return json.loads(dest.read_text()) if dest.exists() else None

    old = recorded()
    run = RUNS / name
    if args.fresh:
        if old is None or not old.get("complete", True):
            sys.exit(f"{dest} holds no complete run: the fresh set scores final models only")
        progress(run, load_config(config, old.get("overrides", [])))  # same settings, or refuse
        fresh = fresh_recall(run)
        if fresh["step"] != old["steps"]:
            sys.exit(f"{run} is at step {fresh['step']}, {dest} records step {old['steps']}")
        _write(dest, {**old, "fresh_accuracy": fresh["accuracy"]})
        return
    if args.by_distance:
        if old is None:
            sys.exit(f"{dest} does not exist: run or snapshot the config first")
        progress(run, load_config(config, old.get("overrides", [])))  # same settings, or refuse
        by_distance = recall_by_distance(run)
        if by_distance["step"] != old["steps"]:
            sys.exit(f"{run} is at step {by_distance['step']}, {dest} records step "
                     f"{old['steps']}: snapshot the run instead")
        _write(dest, {**old, "recall_by_distance": by_distance["buckets"]})
        return
    if old is not None and old.get("complete", True):
        if old.get("overrides", []) != args.set:
            sys.exit(f"{dest} records a complete run with --set options "
                     f"{old.get('overrides', [])}, not {args.set}; copy the config under a new "
                     f"name for a variant.")
        print(f"skip {dest} (complete)")
        return
    if old is not None and not args.snapshot and not run.exists():
        # a committed figure from a run stopped by hand: without its folder, "continuing" would
        # mean training again from step 0 (hours), which nobody asked for by re-running
        print(f"skip {dest}: it records an unfinished run (step {old['steps']} of "
              f"{old.get('max_steps', '?')}) whose run folder {run} is gone; delete {dest} to "
              f"train it again from scratch")
        return
    cmd = [*CLI, "mqar", "--config", str(config), "--out", str(run),
           *sum((["--set", s] for s in args.set), [])]
    if args.snapshot:
        # refuses a run folder whose settings differ from this config and these --set options
        for _ in range(3):  # the run may write a newer state between the two reads
            result = progress(run, load_config(config, args.set))
            if result is None:
                sys.exit(f"{run} has no evaluation to record yet")
            by_distance = recall_by_distance(run)
            if by_distance["step"] == result["steps"]:
                break
        else:
            sys.exit(f"{run} kept changing while being read; try again")
        old = recorded()  # again: the run itself may have just written its complete record
        if old is not None and (old.get("complete", True) or (
                not result["complete"] and old["steps"] >= result["steps"])):
            print(f"keep {dest}: it records step {old['steps']}, the run is at {result['steps']}")
            return
    else:
        r = run_child(cmd)
        if r.returncode:
            sys.exit(f"`{' '.join(cmd)}` ended with exit status {r.returncode} (its output is "
                     f"above); the same command continues the run from its last evaluation.")
        result = json.loads((run / "result.json").read_text())
        by_distance = recall_by_distance(run)
        result["fresh_accuracy"] = fresh_recall(run)["accuracy"]
    result = _record(result, config, args.set, cmd)
    if args.tag:
        result["tag"] = args.tag
    result["recall_by_distance"] = by_distance["buckets"]
    _write(dest, result)


def _write(dest: Path, result: dict) -> None:
    replace_json(dest, result)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: the same command continues the run from its last evaluation.")
