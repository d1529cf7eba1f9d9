"""Per-token exit through the learned halting gate (model.exit_gate, trained by
train.any_depth.gate_weight) against the state criterion, on trained runs: validation loss
and field evaluations per token at each threshold.

    python bench/gate_exit.py RUN [RUN ...] [--max-windows N]

writes bench/results/gate_exit.json (``continuumlm eval --exit-criterion C --exit-threshold
TAU`` for each row, on evenly spread validation windows), rows per run.
"""

from __future__ import annotations

import argparse

import torch
from common import exit_run, machine, markdown_table, write_json

from continuumlm.eval.perplexity import evaluate_contexts

GRID = [("gate", t) for t in (0.5, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05, 0.02)] + \
       [("state", t) for t in (0.5, 0.3, 0.2, 0.1, 0.05, 0.02)]


def measure(run: str, max_windows: int) -> list[dict]:
    model, cfg, split, full_nfe, name = exit_run(run)
    device = torch.device("cpu")

    def row(criterion, tau):
        model.set_exit(tau, criterion) if criterion != "full" else model.set_exit(None)
        [r] = evaluate_contexts(model, split, [cfg.train.seq_len], False, device,
                                max_windows=max_windows)
        return {"model": name, "criterion": criterion, "tau": tau,
                "val_loss": round(r["loss"], 4),
                "nfe_per_token": round(r.get("nfe_per_token", full_nfe), 2)}

    rows = [row("full", None)] + [row(c, t) for c, t in GRID]
    base = rows[0]["val_loss"]
    for r in rows:
        r["loss_change"] = f"{100 * (r['val_loss'] / base - 1):+.2f}%"
        r["fewer_evaluations"] = round(full_nfe / r["nfe_per_token"], 2)
        print(r, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--max-windows", type=int, default=400)
    args = ap.parse_args()
    rows = [r for run in args.runs for r in measure(run, args.max_windows)]
    table = markdown_table(rows, [("model", "model"), ("criterion", "criterion"), ("tau", "tau"),
                                  ("val_loss", "val loss"), ("loss_change", "vs full depth"),
                                  ("nfe_per_token", "field evaluations per token"),
                                  ("fewer_evaluations", "full / this")])
    print(table)
    write_json("gate_exit", {
        "command": f"python bench/gate_exit.py {' '.join(args.runs)}"
                   + (f" --max-windows {args.max_windows}" if args.max_windows != 400 else ""),
        "setup": f"each run's best checkpoint, {args.max_windows} evenly spread validation "
                 f"windows of its training context; {machine()}",
        "rows": rows, "table": table})


if __name__ == "__main__":
    main()
