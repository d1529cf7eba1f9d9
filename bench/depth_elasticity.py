"""Anytime depth: evaluate trained ODE models with other solvers and step counts, no retraining.

    python bench/depth_elasticity.py      # writes bench/results/depth_elasticity.json

Uses the checkpoints that bench/train_seeds.py left in runs/bench/ (ode_euler and ode_rk4,
seed 1337) and evaluates each with euler and rk4 at 1, 2, 4, 8 and 16 steps on 400 evenly spread
validation windows. A discrete model has no such knob: its depth is its layer count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common import RUNS, markdown_table, write_json

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")
MODELS = ["shakespeare_char-ode_euler_seed1337", "shakespeare_char-ode_rk4_seed1337"]


def main() -> None:
    rows = []
    for name in MODELS:
        run = RUNS / name
        if not (run / "checkpoints" / "last").exists():
            # a partial table would be recorded, and then skipped, as if complete
            sys.exit(f"{run} holds no trained model: run `continuumlm experiment shakespeare` "
                     f"(or bench/train_seeds.py on its config) first; nothing was written.")
        for solver in ("euler", "rk4"):
            for steps in (1, 2, 4, 8, 16):
                out = subprocess.run([CLI, "eval", "--checkpoint", str(run), "--which", "last",
                                      "--ode-solver", solver, "--ode-steps", str(steps),
                                      "--max-windows", "400", "--json"],
                                     check=True, capture_output=True, text=True)
                r = json.loads(out.stdout)
                rows.append({"model": name.split("-")[1].replace("_seed1337", ""), "solver": solver,
                             "steps": steps, "nfe": r["nfe"], "val_loss": r["results"][0]["loss"]})
                print(rows[-1], flush=True)
    table = markdown_table(rows, [("model", "trained as"), ("solver", "evaluated with"),
                                  ("steps", "steps"), ("nfe", "NFE"), ("val_loss", "val loss")])
    print(table)
    write_json("depth_elasticity", {
        "command": "python bench/depth_elasticity.py",
        "setup": "trained ODE checkpoints re-integrated without retraining; 400 validation "
                 "windows of 64 characters", "rows": rows, "table": table})


if __name__ == "__main__":
    main()
