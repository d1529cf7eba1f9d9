"""The seminorm adjoint in training: the ode_rk4 model (one shared block) trained with dopri5
and the backsolve adjoint, torchdiffeq's default error norm against the seminorm, same seed.

    python bench/seminorm_run.py        # writes bench/results/seminorm_run.json

Each run trains 150 steps of configs/shakespeare_char/ode_rk4.toml with model.ode_solver =
dopri5, ode_grad = adjoint, rtol 1e-3 / atol 1e-4, into runs/bench/seminorm/NORM (resumed if
interrupted), and the forward and backward field evaluations logged at every step
(`nfe`, `nfe_backward` in metrics.jsonl) are averaged, with the loss curve beside them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import ROOT, RUNS, markdown_table, write_json

CLI = str(Path(sys.executable).parent / "continuumlm")
STEPS = 150
SETS = ["model.ode_solver=dopri5", "model.ode_grad=adjoint", "model.ode_rtol=1e-3",
        "model.ode_atol=1e-4", f"train.max_steps={STEPS}", f"train.lr_decay_steps={STEPS}",
        "train.log_interval=1", "train.eval_interval=50", "train.checkpoint_interval=50",
        "train.seed=1337"]


def main() -> None:
    rows, curves = [], {}
    for norm in ("default", "seminorm"):
        out = RUNS / "seminorm" / norm
        sets = sum((["--set", s] for s in SETS + [f"model.ode_adjoint_norm={norm}"]), [])
        subprocess.run([CLI, "train", "--config", "configs/shakespeare_char/ode_rk4.toml",
                        "--out", str(out), "--resume", "auto", "--quiet", *sets], cwd=ROOT,
                       check=True)
        events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [e for e in events if "nfe_backward" in e]
        vals = [e for e in events if "val_loss" in e]
        rows.append({"norm": norm, "steps": len(steps),
                     "forward_nfe": statistics.mean(e["nfe"] for e in steps),
                     "backward_nfe": statistics.mean(e["nfe_backward"] for e in steps),
                     "final_loss": statistics.mean(e["loss"] for e in steps[-20:]),
                     "val_loss": vals[-1]["val_loss"] if vals else None})
        curves[norm] = [[e["step"], e["loss"], e["nfe"], e["nfe_backward"]] for e in steps]
        print(rows[-1], flush=True)
    base = rows[0]["backward_nfe"]
    for r in rows:
        r["backward_vs_default"] = r["backward_nfe"] / base
    table = markdown_table(rows, [("norm", "adjoint norm"), ("steps", "steps"),
                                  ("forward_nfe", "mean forward NFE"),
                                  ("backward_nfe", "mean backward NFE"),
                                  ("backward_vs_default", "backward vs default"),
                                  ("final_loss", "train loss, last 20 steps"),
                                  ("val_loss", f"val loss at {STEPS}")])
    print(table)
    write_json("seminorm_run", {
        "command": "python bench/seminorm_run.py",
        "setup": f"configs/shakespeare_char/ode_rk4.toml with dopri5 and the backsolve adjoint "
                 f"(rtol 1e-3, atol 1e-4), {STEPS} steps, seed 1337; field evaluations per "
                 f"step from metrics.jsonl",
        "rows": rows, "curves": curves, "table": table})


if __name__ == "__main__":
    main()
