"""Learning-rate sweep of the anytime-depth references and the elastic recipe.

    python bench/lr_sweep.py      # writes bench/results/lr_sweep.json

The targets of depth as a dial compare an elastic model with models trained at one fixed NFE
for the same number of steps. At one learning rate that comparison can mislead: the fixed
models may be under-trained at it while the elastic one is not, or the other way round. This
sweeps rates (lr 1e-3, 2e-3, 3e-3, then 5e-3 and 8e-3 while a model's best was the highest
tried; min_lr a tenth of each) at three seeds for ode_euler (trained Euler x 4, NFE 4), ode_rk4 (trained RK4 x 4, NFE 16),
the elastic recipe (ode_elastic_dial_capped.toml with consistency weight 1.0, the runs tagged
cw1.0) and the discrete 4-layer baseline (transformer_baby, NFE 4 in layer evaluations), so the
ODE rows can be read against it with every model at its own best rate; all from
bench/train_seeds.py (`continuumlm experiment elasticity` trains them), and reports whole-split
validation loss:
- a fixed model at its training solve: its result JSON's val_loss_full_split;
- the elastic model at RK4 x 4 (its configured solve): its result JSON's val_loss_full_split;
- the elastic model at Euler x 4: `continuumlm eval --ode-solver euler --ode-steps 4` on its
  last checkpoint in runs/bench/ (recorded here once computed, so a gone run folder keeps it).
Gaps are seed-matched means at each rate, and each model at its own best rate (lowest mean
over the seeds every model has) against the others at theirs.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import RESULTS, RUNS, finished_run, markdown_table, say_untrained, write_json

CLI = str(Path(sys.executable).parent / "continuumlm")
SEEDS = (1337, 1, 2)
RATES = ("1e-3", "2e-3", "3e-3", "5e-3", "8e-3")
# model -> (config, tag at lr 1e-3, tag prefix at the other rates, the rates swept)
MODELS = {"ode_euler": ("ode_euler", None, "", RATES),
          "ode_rk4": ("ode_rk4", None, "", RATES[:3]),
          "elastic (cw1.0)": ("ode_elastic_dial_capped", "cw1.0", "cw1.0-", RATES[:3]),
          "transformer_baby": ("transformer_baby", None, "", RATES[:4])}
REFERENCE = {"euler": "ode_euler", "rk4": "ode_rk4"}  # the fixed model trained at that solve
ELASTIC = "elastic (cw1.0)"
# the recipe with a teacher (train.distill.teacher: ode_euler at lr 3e-3, or at 5e-3, same
# seed), at the elastic recipe's best rate (the teacher-only variant at seed 1), and the
# second at the teacher's rate (seed 1337). Not in the best-rate rows.
DISTILLED = {"elastic (cw1.0 + teacher)": ("ode_elastic_dial_capped", None, "cw1.0-kd1.0-",
                                           ("2e-3",)),
             "elastic (cw1.0 + teacher at 5e-3)": ("ode_elastic_dial_capped", None,
                                                   "cw1.0-kd1.0t5e-3-", ("2e-3", "5e-3")),
             "elastic (teacher only)": ("ode_elastic_dial_capped", None, "kd1.0-", ("2e-3",))}
MODELS.update(DISTILLED)
ELASTICS = [ELASTIC, *DISTILLED]
# screening runs at one seed: not listed as missing at the others
ONE_SEED = {("elastic (teacher only)", "2e-3"): (1,),
            ("elastic (cw1.0 + teacher at 5e-3)", "5e-3"): (1337,)}
DISCRETE = "transformer_baby"
SOLVE = {"ode_euler": "euler", DISCRETE: "discrete"}  # the others are read at RK4 x 4


def name_of(model: str, lr: str) -> str:
    config, tag1, prefix, _ = MODELS[model]
    tag = tag1 if lr == "1e-3" else f"{prefix}lr{lr}"
    return f"shakespeare_char-{config}" + (f"-{tag}" if tag else "")


def lr_of(result: dict) -> str:
    """The learning rate a result JSON's run used, as written in RATES."""
    sets = dict(o.split("=", 1) for o in result.get("overrides") or ())
    return f"{float(sets.get('train.lr', '1e-3')):.0e}".replace("e-0", "e-")


def euler4(run: Path) -> float:
    out = subprocess.run([CLI, "eval", "--checkpoint", str(run), "--which", "last",
                          "--ode-solver", "euler", "--ode-steps", "4", "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["results"][0]["loss"]


def main() -> None:
    path = RESULTS / "lr_sweep.json"
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    have = {(r["model"], r["lr"], r["seed"], r["solve"]): r for r in old}
    rows, missing = [], []
    for model in MODELS:
        for lr in MODELS[model][3]:
            for seed in ONE_SEED.get((model, lr), SEEDS):
                name = f"{name_of(model, lr)}_seed{seed}"
                result = RESULTS / f"{name}.json"
                if not result.is_file():
                    missing.append(name)
                    continue
                r = json.loads(result.read_text())
                if lr_of(r) != lr:
                    sys.exit(f"{result} ran at lr {lr_of(r)}, not {lr}: the sweep reads runs by "
                             f"their tag; retrain that run or remove the mismatched JSON.")
                solve = SOLVE.get(model, "rk4")
                rows.append({"model": model, "lr": lr, "seed": seed, "solve": solve,
                             "val_loss": r["val_loss_full_split"]})
                if model not in ELASTICS:
                    continue
                key = (model, lr, seed, "euler")
                # a cached figure belongs to the model its run JSON records: a run retrained
                # since (another val loss) is evaluated again (rows recorded before the
                # source figure was are kept as they are)
                source = have.get(key, {}).get("source_val_loss")
                if source is not None and source != r["val_loss_full_split"]:
                    del have[key]
                if key not in have and finished_run(RUNS / name):
                    have[key] = {"val_loss": euler4(RUNS / name),
                                 "source_val_loss": r["val_loss_full_split"]}
                    print(f"{name}: Euler x 4 {have[key]['val_loss']:.4f}", flush=True)
                if key in have:
                    rows.append({"model": model, "lr": lr, "seed": seed, "solve": "euler",
                                 "val_loss": have[key]["val_loss"],
                                 **({"source_val_loss": have[key]["source_val_loss"]}
                                    if "source_val_loss" in have[key] else {})})
                else:
                    missing.append(f"{name} (Euler x 4: no run folder)")
    say_untrained(missing)
    if not rows:
        sys.exit("no run of the sweep is recorded: run `continuumlm experiment elasticity` "
                 "(or bench/train_seeds.py with the tags above) first; nothing was written.")
    table, gaps, best = sweep_table(rows), gaps_table(rows), best_table(rows)
    print(table, gaps, best, sep="\n\n")
    write_json("lr_sweep", {
        "command": "python bench/lr_sweep.py",
        "setup": "Tiny Shakespeare, baby budget (2000 steps of 12 x 64 characters); whole "
                 "validation split; min_lr = lr / 10; Euler x 4 = NFE 4, RK4 x 4 = NFE 16; "
                 "the discrete baseline has 4 layers (4 block evaluations)",
        "rows": rows, "table": table, "gaps_table": gaps, "best_table": best})


def _loss(rows: list[dict]) -> dict:
    return {(r["model"], r["lr"], r["seed"], r["solve"]): r["val_loss"] for r in rows}


def _cell(values: list[float]) -> str:
    return " / ".join(f"{v:.4f}" for v in values)


def sweep_table(rows: list[dict]) -> str:
    loss = _loss(rows)
    out = []
    for model in MODELS:
        for lr in RATES:
            row = {"model": model, "lr": lr}
            for solve in ("euler", "rk4", "discrete"):
                vals = [loss[(model, lr, s, solve)] for s in SEEDS if (model, lr, s, solve) in loss]
                row[solve] = "" if not vals else (
                    _cell(vals) + (f" (mean **{statistics.mean(vals):.4f}**)"
                                   if len(vals) > 1 else ""))
            if row["euler"] or row["rk4"] or row["discrete"]:
                out.append(row)
    return markdown_table(out, [("model", "trained as"), ("lr", "lr"),
                                ("euler", "Euler x 4 (NFE 4), seeds 1337 / 1 / 2"),
                                ("rk4", "RK4 x 4 (NFE 16), seeds 1337 / 1 / 2"),
                                ("discrete", "4 layers, seeds 1337 / 1 / 2")])


def _gap(loss: dict, lr_e: str, lr_f: str, solve: str,
         elastic: str = ELASTIC) -> tuple[float, int] | None:
    """Mean over the seeds both have of (elastic at lr_e) - (fixed reference at lr_f)."""
    ref = REFERENCE[solve]
    d = [loss[(elastic, lr_e, s, solve)] - loss[(ref, lr_f, s, solve)] for s in SEEDS
         if (elastic, lr_e, s, solve) in loss and (ref, lr_f, s, solve) in loss]
    return (statistics.mean(d), len(d)) if d else None


def _best(loss: dict, model: str, solve: str) -> str | None:
    """The rate with the lowest mean over the seeds recorded at every rate tried."""
    tried = [lr for lr in RATES if any((model, lr, s, solve) in loss for s in SEEDS)]
    common = [s for s in SEEDS if all((model, lr, s, solve) in loss for lr in tried)]
    if not tried or not common:
        return None
    return min(tried, key=lambda lr: statistics.mean(loss[(model, lr, s, solve)]
                                                     for s in common))


def gaps_table(rows: list[dict]) -> str:
    loss = _loss(rows)
    out = []

    def add(label: str, lr_e: str | None, lrs_f: dict, elastic: str = ELASTIC) -> None:
        row = {"rate": label}
        for solve in ("euler", "rk4"):
            g = None if lr_e is None or lrs_f.get(solve) is None else _gap(
                loss, lr_e, lrs_f[solve], solve, elastic)
            row[solve] = "" if g is None else (
                f"{g[0]:+.4f} ({'yes' if g[0] <= 0.02 else 'no'}; {g[1]} seed"
                f"{'s' if g[1] > 1 else ''}"
                + ("" if lrs_f[solve] == lr_e else f"; reference at lr {lrs_f[solve]}") + ")")
        if row["euler"] or row["rk4"]:
            out.append(row)

    for lr in RATES:
        add(f"lr {lr}, all models", lr, {"euler": lr, "rk4": lr})
    best = {solve: _best(loss, REFERENCE[solve], solve) for solve in ("euler", "rk4")}
    for solve in ("euler", "rk4"):
        e = _best(loss, ELASTIC, solve)
        if e is not None and best[solve] is not None:
            add(f"each at its best rate for {solve.upper() if solve == 'rk4' else 'Euler'} x 4"
                f" (elastic {e})", e, {solve: best[solve]})
    for elastic in DISTILLED:  # the recipe with a teacher, at its rate: both references
        for lr in MODELS[elastic][3]:
            add(f"{elastic}, lr {lr}", lr, {"euler": lr, "rk4": lr}, elastic)
            if best["euler"] not in (None, lr) or best["rk4"] not in (None, lr):
                add(f"{elastic}, lr {lr}, references at their best rates", lr, best, elastic)
    return markdown_table(out, [("rate", "learning rates"),
                                ("euler", "elastic - ode_euler at Euler x 4 (target <= 0.02)"),
                                ("rk4", "elastic - ode_rk4 at RK4 x 4 (target <= 0.02)")])


def best_table(rows: list[dict]) -> str:
    """Each fixed model (and the elastic one at each solve) at its best rate: the mean over the
    seeds, what the best rate gains over lr 1e-3, and the seed-matched difference from the
    discrete baseline at its own best rate. A best rate at the top of the swept ones is marked
    with what it gained over the rate below (a higher one might be better still)."""
    loss = _loss(rows)
    base = _best(loss, DISCRETE, "discrete")
    out = []
    for model, solve in [(DISCRETE, "discrete"), ("ode_euler", "euler"), ("ode_rk4", "rk4"),
                         (ELASTIC, "euler"), (ELASTIC, "rk4")]:
        lr = _best(loss, model, solve)
        if lr is None:
            continue
        seeds = [s for s in SEEDS if (model, lr, s, solve) in loss]
        mean = statistics.mean(loss[(model, lr, s, solve)] for s in seeds)
        swept = [r for r in MODELS[model][3] if any((model, r, s, solve) in loss for s in SEEDS)]
        top = ""
        if lr == swept[-1] and len(swept) > 1:  # how much the last step of the sweep gained
            below = [loss[(model, swept[-2], s, solve)] for s in seeds
                     if (model, swept[-2], s, solve) in loss]
            top = " (top of the sweep" + (
                f"; {statistics.mean(below) - mean:.4f} below {swept[-2]})"
                if len(below) == len(seeds) else ")")
        row = {"model": model, "solve": {"euler": "Euler x 4 (NFE 4)", "rk4": "RK4 x 4 (NFE 16)",
                                         "discrete": "4 layers"}[solve],
               "lr": lr + top,
               "mean": f"{mean:.4f} ({len(seeds)} seed{'s' if len(seeds) > 1 else ''})"}
        at1 = [loss[(model, "1e-3", s, solve)] for s in seeds if (model, "1e-3", s, solve) in loss]
        if lr != "1e-3" and len(at1) == len(seeds):
            row["gain"] = f"{mean - statistics.mean(at1):+.4f}"
        if base is not None and model != DISCRETE:
            d = [loss[(model, lr, s, solve)] - loss[(DISCRETE, base, s, "discrete")]
                 for s in seeds if (DISCRETE, base, s, "discrete") in loss]
            if d:
                row["vs"] = f"{statistics.mean(d):+.4f} ({len(d)} seed{'s' if len(d) > 1 else ''})"
        out.append(row)
    return markdown_table(out, [("model", "trained as"), ("solve", "evaluated at"),
                                ("lr", "best lr"), ("mean", "val loss at it, mean"),
                                ("gain", "change from lr 1e-3"),
                                ("vs", f"minus the discrete baseline at its best rate"
                                       f"{f' ({base})' if base else ''}")])


if __name__ == "__main__":
    main()
