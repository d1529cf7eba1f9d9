"""Anytime depth: evaluate trained ODE models with other solvers and step counts, no retraining.

    python bench/depth_elasticity.py      # writes bench/results/depth_elasticity.json

Uses the checkpoints that bench/train_seeds.py left in runs/bench/ (seed 1337, and the seeds in
SEEDS): ode_euler and ode_rk4 (trained at one solver and step count; also seeds 1 and 2, the
references of the checks at those seeds), ode_elastic and ode_elastic_consistency
(trained with Euler or RK4 at 1-16 steps drawn per step), ode_elastic_narrow (2-8 steps),
ode_elastic_upto16 (2-16 steps), ode_elastic_dial (2-16 steps, the step size it reads clamped
to that range), ode_elastic_dial4 (the same, 4 steps drawn twice as often) and
ode_elastic_dial_consistency (the consistency term on every second step; also seed 1) and
ode_elastic_dial_capped (solves of at most 32 evaluations, the term on every step; also seeds 1
and 2) and the same with the term's weight 1.0 instead of 0.5 (the runs tagged cw1.0), and
evaluates each with euler at 1-32 steps and rk4 at 1-16 on 400 evenly spread validation
windows. A model with model.ode_dt_steps_range is also evaluated with the clamp lifted where it
matters (step counts outside its range), as "MODEL, unclamped". Rows already in the JSON are
kept, so a model whose run folder is gone keeps its recorded figures; a model with neither is
left out (and named). A discrete model has no such knob: its depth is its layer count.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from common import RESULTS, RUNS, finished_run, markdown_table, say_untrained, write_json

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")
MODELS = ["ode_euler", "ode_rk4", "ode_elastic", "ode_elastic_consistency", "ode_elastic_narrow",
          "ode_elastic_upto16", "ode_elastic_dial", "ode_elastic_dial4",
          "ode_elastic_dial_consistency", "ode_elastic_dial_capped",
          # a recipe run with --set (bench/train_seeds.py --tag cw1.0): consistency weight 1.0
          "ode_elastic_dial_capped-cw1.0",
          # the same recipe drawing only from step 1000 or 1500 on (train.elastic.start; seed 1)
          "ode_elastic_dial_capped-cw1.0-from1000", "ode_elastic_dial_capped-cw1.0-from1500",
          # at lr 2e-3, distilled from ode_euler trained at lr 3e-3 on the same seed (with and
          # without the consistency term), and the fixed references at lr 2e-3 they are
          # checked against (evaluated at their training solve only)
          "ode_elastic_dial_capped-cw1.0-kd1.0-lr2e-3", "ode_elastic_dial_capped-kd1.0-lr2e-3",
          # the same with ode_euler at lr 5e-3 (within 0.001 of its best rate) as the teacher
          "ode_elastic_dial_capped-cw1.0-kd1.0t5e-3-lr2e-3",
          "ode_euler-lr2e-3", "ode_rk4-lr2e-3"]
ONLY = {"ode_euler-lr2e-3": {"euler": (4,)}, "ode_rk4-lr2e-3": {"rk4": (4,)}}
GRID = {"euler": (1, 2, 4, 8, 16, 32), "rk4": (1, 2, 4, 8, 16)}
# the headline elastic models are also evaluated at other seeds, and so are the fixed-NFE
# references, so that every check compares models trained on the same seed (the checks table
# only; the main table and the figure are seed 1337's)
SEEDS = {"ode_euler": (1337, 1, 2), "ode_rk4": (1337, 1, 2),
         "ode_elastic_dial_consistency": (1337, 1), "ode_elastic_dial_capped": (1337, 1, 2),
         "ode_elastic_dial_capped-cw1.0": (1337, 1, 2),
         "ode_elastic_dial_capped-cw1.0-from1000": (1,),
         "ode_elastic_dial_capped-cw1.0-from1500": (1,),
         "ode_elastic_dial_capped-cw1.0-kd1.0-lr2e-3": (1337, 1, 2),
         "ode_elastic_dial_capped-kd1.0-lr2e-3": (1,),
         "ode_elastic_dial_capped-cw1.0-kd1.0t5e-3-lr2e-3": (1337, 1, 2),
         "ode_euler-lr2e-3": (1337, 1, 2), "ode_rk4-lr2e-3": (1337, 1, 2)}


def seed_of(row: dict) -> int:
    return row.get("seed", 1337)


def main() -> None:
    path = RESULTS / "depth_elasticity.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    have = {(r["model"], r["solver"], r["steps"], seed_of(r)): r for r in old}
    rows, missing = [], []
    for model, seed in [(m, s) for m in MODELS for s in SEEDS.get(m, (1337,))]:
        run = RUNS / f"shakespeare_char-{model}_seed{seed}"
        trained = finished_run(run)
        # cached rows belong to the model the run's JSON records: after a retrain (another
        # val loss) they are evaluated again (rows recorded before that figure was are kept)
        recorded = RESULTS / f"shakespeare_char-{model}_seed{seed}.json"
        source = (json.loads(recorded.read_text()).get("val_loss_full_split")
                  if recorded.is_file() else None)
        for key in [k for k in have if k[0] == model and k[3] == seed]:
            if have[key].get("source_val_loss") not in (None, source):
                del have[key]
        if not trained and not any(k[0] == model and k[3] == seed for k in have):
            missing.append(model if seed == 1337 else f"{model} (seed {seed})")
            continue
        for solver, grid in ONLY.get(model, GRID).items():
            for steps in grid:
                key = (model, solver, steps, seed)
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
                             "val_loss": r["results"][0]["loss"], "source_val_loss": source,
                             **({} if seed == 1337 else {"seed": seed})})
                print(rows[-1], flush=True)
    rows += unclamped_rows(have, {r["model"] for r in rows} - set(missing))
    say_untrained(missing)
    if not rows:
        sys.exit("no trained model in runs/bench/ and nothing recorded: run `continuumlm "
                 "experiment shakespeare` (or bench/train_seeds.py on the configs) first; "
                 "nothing was written.")
    nfes = sorted({r["nfe"] for r in rows})
    pivot = []
    for model in [m for m in MODELS for m in (m, f"{m}, unclamped")]:
        for solver in GRID:
            cells = {r["nfe"]: r["val_loss"] for r in rows
                     if r["model"] == model and r["solver"] == solver and seed_of(r) == 1337}
            if cells:
                pivot.append({"model": model, "solver": solver,
                              **{f"nfe{n}": f"{cells[n]:.3f}" if n in cells else "" for n in nfes}})
    table = markdown_table(pivot, [("model", "trained as"), ("solver", "evaluated with"),
                                   *[(f"nfe{n}", f"NFE {n}") for n in nfes]])
    print(table)
    checks = checks_table(rows)
    print(checks)
    write_json("depth_elasticity", {
        "command": "python bench/depth_elasticity.py",
        "setup": "trained ODE checkpoints re-integrated without retraining (the elastic ones "
                 "were trained across solvers and step counts); val loss on 400 validation "
                 "windows of 64 characters, by the NFE of the solve", "rows": rows,
        "table": table, "checks_table": checks, "seeds": SEEDS})


TARGET_NFE = (2, 4, 8, 16, 32)
RISE = 0.005  # a rise above this counts as an increase
GAP = 0.02  # the most an elastic model may trail a fixed-NFE one at that NFE


def checks_table(rows: list[dict]) -> str:
    """Per elastic model (and seed): the largest rise of val loss between successive NFE of
    TARGET_NFE under Euler and under RK4, and the gaps to the models trained at one fixed
    NFE (ode_euler: Euler x 4, NFE 4; ode_rk4: RK4 x 4, NFE 16), each trained on the same seed
    (seed 1337's where the reference has no run at that seed, marked "vs 1337"); a model with
    several seeds also gets a row of its mean gaps over the seeds."""
    loss = {(r["model"], r["solver"], r["nfe"], seed_of(r)): r["val_loss"] for r in rows}

    def rise(model: str, solver: str, seed: int) -> str:
        pts = [loss[(model, solver, n, seed)] for n in TARGET_NFE
               if (model, solver, n, seed) in loss]
        if len(pts) < 2:
            return ""
        worst = round(max(b - a for a, b in zip(pts, pts[1:])), 3) + 0.0  # no "-0.000"
        return f"{worst:+.3f} ({'yes' if worst <= RISE else 'no'})"

    def diff(model: str, solver: str, nfe: int, ref: str, seed: int):
        """(elastic minus reference, the reference's seed), or None. A model trained at another
        learning rate (a "-lrX" tag) is set against the reference trained at that rate, on
        the same seed only."""
        rate = re.search(r"-lr(\d+e-\d+)$", model)
        if rate:
            ref = f"{ref}-lr{rate.group(1)}"
            if (ref, solver, nfe, seed) not in loss:
                return None
        ref_seed = seed if (ref, solver, nfe, seed) in loss else 1337
        a, b = loss.get((model, solver, nfe, seed)), loss.get((ref, solver, nfe, ref_seed))
        return None if a is None or b is None else (a - b, ref_seed)

    def verdict(d: float, note: str = "", digits: int = 4) -> str:  # 4: the line is 0.02
        return f"{d:+.{digits}f} ({'yes' if d <= GAP else 'no'}{note})"

    def gap(model: str, solver: str, nfe: int, ref: str, seed: int) -> str:
        d = diff(model, solver, nfe, ref, seed)
        if d is None:
            return ""
        return verdict(d[0], "" if d[1] == seed else f", vs {d[1]}")

    def mean_gap(model: str, solver: str, nfe: int, ref: str, seeds: list[int]) -> str:
        ds = [diff(model, solver, nfe, ref, s) for s in seeds]
        if any(d is None or d[1] != s for d, s in zip(ds, seeds)):
            return ""  # only seed-matched gaps are averaged
        return verdict(sum(d[0] for d in ds) / len(ds), digits=4)  # near the line: 4 digits

    out, seeds_of = [], {}
    for model, seed in dict.fromkeys((r["model"], seed_of(r)) for r in rows):
        if "elastic" not in model or ", unclamped" in model:
            continue
        seeds_of.setdefault(model, []).append(seed)
        out.append({"model": model, "seed": seed, "euler": rise(model, "euler", seed),
                    "rk4": rise(model, "rk4", seed),
                    "nfe4": gap(model, "euler", 4, "ode_euler", seed),
                    "nfe16": gap(model, "rk4", 16, "ode_rk4", seed)})
    for model, seeds in seeds_of.items():
        if len(seeds) > 1:
            out.append({"model": model, "seed": "mean of " + ", ".join(map(str, seeds)),
                        "euler": "", "rk4": "",
                        "nfe4": mean_gap(model, "euler", 4, "ode_euler", seeds),
                        "nfe16": mean_gap(model, "rk4", 16, "ode_rk4", seeds)})
    return markdown_table(out, [
        ("model", "elastic model"), ("seed", "seed"),
        ("euler", f"largest rise, Euler, NFE {TARGET_NFE[0]}-{TARGET_NFE[-1]} (<= {RISE})"),
        ("rk4", f"largest rise, RK4, NFE 4-{TARGET_NFE[-1]} (<= {RISE})"),
        ("nfe4", f"Euler x 4 vs ode_euler (<= {GAP})"),
        ("nfe16", f"RK4 x 4 vs ode_rk4 (<= {GAP})")])


def unclamped_rows(have: dict, models: set[str]) -> list[dict]:
    """The step counts outside a model's model.ode_dt_steps_range, evaluated with the clamp
    lifted (every step size read as it is), as the CLI's eval does it otherwise."""
    import torch

    from continuumlm.data import prepare_data
    from continuumlm.eval.perplexity import evaluate_contexts
    from continuumlm.runs import load_model_and_tokenizer
    from continuumlm.runs.checkpoint import load_run_config

    rows = []
    for model in MODELS:
        if model not in models:
            continue
        run, name = RUNS / f"shakespeare_char-{model}_seed1337", f"{model}, unclamped"
        keys = [(name, solver, steps, 1337) for solver, grid in GRID.items() for steps in grid]
        if not finished_run(run):
            rows += [have[k] for k in keys if k in have]
            continue
        net, tok, ckpt = load_model_and_tokenizer(run, "last", map_location="cpu")
        lo_hi = net.config.ode_dt_steps_range
        if lo_hi is None:
            continue
        data = None
        for key in keys:
            _, solver, steps, _ = key
            if lo_hi[0] <= steps <= lo_hi[1]:
                continue  # the same model there
            if key in have:
                rows.append(have[key])
                continue
            if data is None:
                data = prepare_data(load_run_config(ckpt).data, tok)
                for block in net.depth.blocks:
                    block.field.dt_bounds = None
            net.set_solver(solver, steps, ode_grad="direct")
            r = evaluate_contexts(net, data.splits["val"], [64], True, torch.device("cpu"),
                                  max_windows=400)
            rows.append({"model": name, "solver": solver, "steps": steps, "nfe": net.last_nfe,
                         "val_loss": r[0]["loss"]})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
