"""Size an MQAR sweep to the machine it runs on (bench/gpu_mqar_sweep.sh): every rate of every
row is first run side by side for a short probe, and each row's step limit, warm-up and
evaluation interval are then set so that its runs finish their schedule inside the budget.

    python bench/mqar_calibrate.py prepare CONFIG...      # build each row's shared example set
    python bench/mqar_calibrate.py calibrate --probe-runs DIR --probe-seconds P --budget B \\
        [--out calibration.json] CONFIG...                # one line per row: NAME SET...

``prepare`` builds the training set of each config into $CONTINUUMLM_MQAR_CACHE (the runs then
memory-map it), so neither the probe nor the runs pay for drawing it. ``calibrate`` reads the
probe runs' metrics (DIR/mqar-<name>-probe-lr<rate>/metrics.jsonl): a row's seconds per step is
the slowest of its rates (the median of each rate's logged windows after the first, all rates
running side by side as the sweep will), its evaluation time the longest logged (``eval_s``:
the probe evaluates every 50 steps), its start-up the longest of what its rates spent neither
stepping nor evaluating. The step limit is what fits the budget after that start-up with the
config's number of evaluations (fewer, if they would take over a fifth of the time) and a 10%
margin, and never more than the config's own; the warm-up keeps the config's proportion to it,
so a calibrated run is the config's schedule compressed, not cut short."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from continuumlm.config import load_config

MARGIN = 0.9  # of the time left after start-up: process exits, checkpoints, the last evaluation
MIN_STEPS = 50  # below this (or the config's own limit) a row is reported as not fitting
EVAL_SHARE = 0.2  # evaluations take at most this share of a run's time (fewer, further apart)


def seconds_per_step(metrics: list[dict], tokens_per_step: int) -> float | None:
    """The median of the logged windows' seconds per step, the first window (start-up, first
    kernels) left out when there are others; None without a logged window. The trainer's
    windows count training only (evaluations and saves are left out of them)."""
    tps = [m["tokens_per_s"] for m in metrics if m.get("tokens_per_s")]
    tps = tps[1:] or tps
    return tokens_per_step / statistics.median(tps) if tps else None


def plan(cfg, s_step: float, startup_s: float, budget_s: float, eval_s: float) -> dict:
    """The --set values that make ``cfg``'s run finish inside ``budget_s``: start-up, then
    steps of ``s_step`` seconds and evaluations (with their checkpoint) of ``eval_s``."""
    t = cfg.train
    usable = (budget_s - startup_s) * MARGIN
    # the config's number of evaluations, fewer when they would take over EVAL_SHARE
    evals = math.ceil(t.max_steps / t.eval_interval)
    evals = max(1, min(evals, math.floor(EVAL_SHARE * usable / max(eval_s, 1e-9))))
    steps = max(0, min(t.max_steps, math.floor((usable - evals * eval_s) / s_step)))
    scale = steps / t.max_steps
    return {"train.max_steps": steps,
            "train.warmup_steps": max(1, round(t.warmup_steps * scale)),
            "train.eval_interval": max(1, min(steps, math.ceil(steps / evals) if steps else 1)),
            "train.log_interval": max(1, min(t.log_interval, steps // 20 or 1))}


def _probe(run: Path, tokens_per_step: int, probe_s: float) -> dict:
    path = run / "metrics.jsonl"
    metrics = ([json.loads(x) for x in path.read_text().splitlines() if x.strip()]
               if path.is_file() else [])
    s = seconds_per_step(metrics, tokens_per_step)
    evals = [m["eval_s"] for m in metrics if m.get("eval_s") is not None]
    steps = max((m.get("step", 0) for m in metrics), default=0)
    # what the probe spent neither stepping nor evaluating: start-up (and its saves)
    startup = None if s is None else max(0.0, probe_s - steps * s - sum(evals))
    return {"seconds_per_step": s, "steps": steps, "evaluations": len(evals),
            "eval_s": max(evals) if evals else None, "startup_s": startup}


def calibrate(configs: list[Path], probe_runs: Path, probe_s: float, budget_s: float,
              probe_results: Path | None = None) -> dict:
    """Each row's step time, start-up and evaluation time from its probe runs, and the --set
    values that fit it to the budget. A rate whose probe logged no step (it crashed, or was
    slower than the probe) is left out of the measurement and named; a row none of whose rates
    logged a step does not fit."""
    rows = {}
    for config in configs:
        cfg = load_config(config)
        tokens_per_step = cfg.train.batch_size * cfg.mqar.seq_len * cfg.train.grad_accum
        runs = sorted(probe_runs.glob(f"mqar-{config.stem}-probe-lr*"))
        if not runs:  # every rate stopped before its run folder existed (or never started)
            rows[config.stem] = {"rates": {}, "no_step_in_probe": [], "fits": False,
                                 "config_max_steps": cfg.train.max_steps,
                                 "why": f"no probe run folder of it in {probe_runs}: its rates "
                                        f"did not get as far as starting to train within the "
                                        f"{probe_s:g} s probe (give it more time: PROBE=...)"}
            continue
        measured = {run.name: _probe(run, tokens_per_step, probe_s) for run in runs}
        for name, v in measured.items():  # reached the config's recall: it ended early
            v["ended_early"] = bool(probe_results and (probe_results / f"{name}.json").is_file())
        ok = [v for v in measured.values() if v["seconds_per_step"] is not None]
        silent = [k for k, v in measured.items() if v["seconds_per_step"] is None]
        row = {"rates": measured, "no_step_in_probe": silent,
               "config_max_steps": cfg.train.max_steps}
        if not ok:
            rows[config.stem] = {**row, "fits": False,
                                 "why": f"no rate logged a training step within the "
                                        f"{probe_s:g} s probe (give it more time: PROBE=...)"}
            continue
        s_step = max(v["seconds_per_step"] for v in ok)
        # a rate that ended early spent less than the probe: its remainder is no start-up
        startup = max(v["startup_s"] for v in [v for v in ok if not v["ended_early"]] or ok)
        evals = [v["eval_s"] for v in ok if v["eval_s"] is not None]
        # an evaluation not seen in the probe: its forward passes, about a third of a step each
        eval_s = max(evals) if evals else (
            cfg.mqar.test_examples / (3 * cfg.train.batch_size) * s_step)
        sets = plan(cfg, s_step, startup, budget_s, eval_s)
        fits = sets["train.max_steps"] >= min(MIN_STEPS, cfg.train.max_steps)
        rows[config.stem] = {**row, "seconds_per_step": s_step, "startup_s": startup,
                             "eval_s": eval_s, "eval_measured": bool(evals), "sets": sets,
                             "fits": fits, "why": None if fits else
                             f"{s_step:.3f} s per step leaves {sets['train.max_steps']} steps "
                             f"in the budget"}
    return {"probe_s": probe_s, "budget_s": budget_s, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("configs", nargs="+", type=Path)
    c = sub.add_parser("calibrate")
    c.add_argument("--probe-runs", type=Path, required=True)
    c.add_argument("--probe-seconds", type=float, required=True)
    c.add_argument("--budget", type=float, required=True)
    c.add_argument("--probe-results", type=Path,
                   help="where the probe runs' records go: a rate recorded there ended early "
                        "(it reached the config's recall), so its start-up is not measured")
    c.add_argument("--out", type=Path)
    c.add_argument("configs", nargs="+", type=Path)
    args = ap.parse_args()
    if args.cmd == "prepare":
        from continuumlm.train.mqar import EXAMPLE_CACHE, train_set

        if not os.environ.get(EXAMPLE_CACHE):
            raise SystemExit(f"prepare builds into ${EXAMPLE_CACHE}; set it to a folder")
        for config in args.configs:
            train_set(load_config(config))
        return
    result = calibrate(args.configs, args.probe_runs, args.probe_seconds, args.budget,
                       args.probe_results)
    import torch

    # what the record was measured on, and by which command (bench/gpu_mqar_sweep.sh's
    # settings are environment variables): copied to bench/results/gpu/mqar_calibration.json,
    # it says on the page how long the config's whole schedule takes there
    result.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  date=time.strftime("%Y-%m-%d"),
                  command=" ".join([*(f"{k}={os.environ[k]}" for k in ("BUDGET", "PROBE", "ROWS")
                                      if os.environ.get(k)), "bash bench/gpu_mqar_sweep.sh"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in result["rows"].items():
        if row["no_step_in_probe"]:
            print(f"{name}: no training step logged in the probe by "
                  f"{', '.join(row['no_step_in_probe'])}", file=sys.stderr)
        if not row["fits"]:
            print(f"{name}: {row['why']}; it is not run", file=sys.stderr)
            continue
        print(name, *(f"{k}={v}" for k, v in row["sets"].items()))


if __name__ == "__main__":
    main()
