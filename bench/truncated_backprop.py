"""Truncated backpropagation through depth (train.any_depth.backprop_steps): peak memory and
time of one training step, against backpropagating through every step, and the loss of a run
trained with it.

    python bench/truncated_backprop.py [--run RUN --reference RUN ...]

Each point runs in a fresh process, measured as bench/ode_memory.py measures (the peak
resident set growth during one forward+backward, glibc mapping large blocks directly): the
ode_rk4.toml model (one block, d 128, batch 12, context 64) at RK4 x 4, x 8 and x 16,
backpropagating through the last 1, 2 (4 at x 16) or all steps. Each ``--run`` (trained with
backprop_steps) and the ``--reference`` given after it (the same config without it),
repeatable in pairs, add their best validation losses from ``continuumlm eval``.
Writes bench/results/truncated_backprop.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import OtherLoad, markdown_table, training_step_peak, write_json

POINTS = [(4, None), (4, 2), (4, 1), (8, None), (8, 2), (8, 1), (16, None), (16, 4), (16, 1)]


def child(steps: int, tail: int | None) -> None:
    import torch

    from continuumlm import LanguageModel, ModelConfig
    from continuumlm.model.extras import SolveExtras

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=1, max_seq_len=64,
                      position="learned", depth="ode", ode_solver="rk4", ode_steps=steps)
    model = LanguageModel(cfg).train()
    model.depth.extras = SolveExtras(backprop_steps=tail)
    x = torch.randint(0, 65, (12, 64))
    peak_mb, seconds = training_step_peak(model, x, timed=2)
    print(json.dumps({"peak_mb": peak_mb, "seconds": seconds}))


def best_val(run: str) -> float:
    cli = os.path.join(os.path.dirname(sys.executable), "continuumlm")
    out = subprocess.run([cli, "eval", "--checkpoint", run, "--json"], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)["results"][0]["loss"]


def solve_of(run: str) -> dict:
    """The run's RK4 steps, the steps it backpropagated through (None: all) and whether their
    gradient went on to the block's input (backprop_skip), from the config it saved."""
    from continuumlm.runs.checkpoint import load_run_config, resolve_checkpoint

    cfg = load_run_config(resolve_checkpoint(run, "best"))
    t = cfg.train.any_depth
    return {"steps": cfg.model.ode_steps, "backprop_steps": t.backprop_steps,
            "backprop_skip": t.backprop_skip}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", default=[],
                    help="a run trained with train.any_depth.backprop_steps (repeatable)")
    ap.add_argument("--reference", action="append", default=[],
                    help="the same config trained without it (one per --run, in order)")
    args = ap.parse_args()
    if len(args.run) != len(args.reference):
        ap.error(f"give one --reference for each --run (got {len(args.run)} --run and "
                 f"{len(args.reference)} --reference), the reference after its run")
    rows = []
    for steps, tail in POINTS:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        with OtherLoad() as others:
            out = subprocess.run([sys.executable, __file__, "--child", str(steps),
                                  str(tail or 0)], check=True, capture_output=True, text=True,
                                 env=env)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"steps": steps, "backprop_steps": tail or "all", **r,
                     "other_cores": others.cores})
        print(rows[-1], flush=True)
    for r in rows:
        full = next(x for x in rows if x["steps"] == r["steps"] and x["backprop_steps"] == "all")
        r["peak_vs_all"] = round(r["peak_mb"] / full["peak_mb"], 3)
        r["time_vs_all"] = round(r["seconds"] / full["seconds"], 3)
        r["peak_mb"], r["seconds"] = round(r["peak_mb"], 1), round(r["seconds"], 4)
    table = markdown_table(rows, [("steps", "RK4 steps"), ("backprop_steps", "backprop through"),
                                  ("peak_mb", "peak MB"), ("peak_vs_all", "peak / all steps"),
                                  ("seconds", "s / step"), ("time_vs_all", "time / all steps"),
                                  ("other_cores", "other cores busy")])
    losses = []
    command = "python bench/truncated_backprop.py"
    for run, reference in zip(args.run, args.reference):
        losses.append({"run": run, "reference": reference, **solve_of(run),
                       "val_loss": best_val(run), "reference_val_loss": best_val(reference)})
        command += f" --run {run} --reference {reference}"
        print(losses[-1])
    print(table)
    write_json("truncated_backprop", {
        "command": command,
        "setup": "one ODE block (ode_rk4.toml's model), d 128, batch 12, context 64; peak RSS "
                 "growth during one training step and the fastest of three steps' time",
        "rows": rows, "table": table, "losses": losses})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]) or None)
    else:
        main()
