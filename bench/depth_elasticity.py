"""Anytime depth: evaluate trained ODE models with other solvers and step counts, no retraining.

    python bench/depth_elasticity.py      # writes bench/results/depth_elasticity.json

Uses the checkpoints that bench/train_seeds.py left in runs/bench/ (seed 1337): ode_euler and
ode_rk4 (trained at one solver and step count), ode_elastic and ode_elastic_consistency
(trained with Euler or RK4 at 1-16 steps drawn per step), ode_elastic_narrow (2-8 steps),
ode_elastic_upto16 (2-16 steps), and evaluates each with euler at 1-32
steps and rk4 at 1-16 on 400 evenly spread validation windows. Rows already in the JSON are
kept, so a model whose run folder is gone keeps its recorded figures; a model with neither is
left out (and named). A discrete model has no such knob: its depth is its layer count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common import RESULTS, RUNS, finished_run, markdown_table, say_untrained, write_json

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")
MODELS = ["ode_euler", "ode_rk4", "ode_elastic", "ode_elastic_consistency", "ode_elastic_narrow",
          "ode_elastic_upto16"]
GRID = {"euler": (1, 2, 4, 8, 16, 32), "rk4": (1, 2, 4, 8, 16)}


def main() -> None:
    path = RESULTS / "depth_elasticity.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    have = {(r["model"], r["solver"], r["steps"]): r for r in old}
    rows, missing = [], []
    for model in MODELS:
        run = RUNS / f"shakespeare_char-{model}_seed1337"
        trained = finished_run(run)
        if not trained and not any(k[0] == model for k in have):
            missing.append(model)
            continue
        for solver, grid in GRID.items():
            for steps in grid:
                key = (model, solver, steps)
                if key in have or not trained:
                    if key in have:
                        rows.append(have[key])
                    continue
                out = subprocess.run([CLI, "eval", "--checkpoint", str(run), "--which", "last",
                                      "--ode-solver", solver, "--ode-steps", str(steps),
                                      "--max-windows", "400", "--json"],
                                     check=True, capture_output=True, text=True)
                r = json.loads(out.stdout)
                rows.append({"model": model, "solver": solver, "steps": steps, "nfe": r["nfe"],
                             "val_loss": r["results"][0]["loss"]})
                print(rows[-1], flush=True)
    say_untrained(missing)
    if not rows:
        sys.exit("no trained model in runs/bench/ and nothing recorded: run `continuumlm "
                 "experiment shakespeare` (or bench/train_seeds.py on the configs) first; "
                 "nothing was written.")
    nfes = sorted({r["nfe"] for r in rows})
    pivot = []
    for model in MODELS:
        for solver in GRID:
            cells = {r["nfe"]: r["val_loss"] for r in rows
                     if r["model"] == model and r["solver"] == solver}
            if cells:
                pivot.append({"model": model, "solver": solver,
                              **{f"nfe{n}": f"{cells[n]:.3f}" if n in cells else "" for n in nfes}})
    table = markdown_table(pivot, [("model", "trained as"), ("solver", "evaluated with"),
                                   *[(f"nfe{n}", f"NFE {n}") for n in nfes]])
    print(table)
    write_json("depth_elasticity", {
        "command": "python bench/depth_elasticity.py",
        "setup": "trained ODE checkpoints re-integrated without retraining (the elastic ones "
                 "were trained across solvers and step counts); val loss on 400 validation "
                 "windows of 64 characters, by the NFE of the solve", "rows": rows,
        "table": table})


if __name__ == "__main__":
    main()
