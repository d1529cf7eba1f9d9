"""Training cost of elastic depth: seconds per optimizer step of ode_elastic,
ode_elastic_consistency, ode_elastic_narrow, ode_elastic_upto16 and the ode_elastic_dial
configs against ode_rk4 (fixed RK4 x 4), at equal steps; also the capped recipe with consistency
weight 1.0, with and without a teacher (train.distill.teacher: its forward pass, no gradients, is
part of each step's cost), and ode_euler, the teacher's config (its training is the distilled
recipe's other cost).

    python bench/elastic_cost.py      # writes bench/results/elastic_cost.json
    python bench/elastic_cost.py --only ode_elastic_dial_capped-cw1.0   # re-times some rows

`--only NAME ...` times ode_rk4 and the named configs or recipes in one process and replaces
their rows in the JSON, keeping the others: each row's ratio is against the ode_rk4 timed in
the same process as it, and rows timed apart say so (their seconds come from other runs).

The configs' trainers run in one process. A run's steps are grouped by what a step costs:
the solver and step count drawn for it (from (seed, step), so they are the run's own) and
whether the consistency term adds its finer solve on it. Every kind of step is timed, in
rounds that alternate between the configs so that whatever else the machine does slows them
all alike (the ratios are what is read; the absolute times are understated when other work
ran, as `other_cores` records), and the whole run's time per step is the mean over its steps,
each at its kind's time. Timing a run's first steps instead mismeasures it: their draws are
not the run's mix (the first 120 of ode_elastic_dial average 16.3 NFE, the run 19.1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import RESULTS, RUNS, OtherLoad, finished_run, markdown_table, write_json

from continuumlm.config import load_config
from continuumlm.train import Trainer

CONFIGS = ["ode_rk4", "ode_elastic", "ode_elastic_consistency", "ode_elastic_narrow",
           "ode_elastic_upto16", "ode_elastic_dial", "ode_elastic_dial4",
           "ode_elastic_dial_consistency", "ode_elastic_dial_capped"]
# recipes run with --set: label -> (config, overrides); the teacher of the distilled one is
# ode_euler at lr 3e-3 (seed 1337), trained by `continuumlm experiment elasticity`
TEACHER = RUNS / "shakespeare_char-ode_euler-lr3e-3_seed1337"
VARIANTS = {"ode_elastic_dial_capped-cw1.0": ("ode_elastic_dial_capped",
                                              ["train.elastic.consistency_weight=1.0"]),
            "ode_elastic_dial_capped-cw1.0-kd1.0": (
                "ode_elastic_dial_capped", ["train.elastic.consistency_weight=1.0",
                                            f'train.distill.teacher="{TEACHER}"',
                                            "train.distill.weight=1.0"]),
            # the teacher's own training (the distilled recipe's other cost)
            "ode_euler": ("ode_euler", [])}
ROUNDS, PER_ROUND = 6, 16


def kinds(trainer, total: int) -> dict[tuple, list[int]]:
    """The steps 0..total-1 of a run grouped by what a step costs: its drawn (solver, steps)
    and whether it has the consistency term's finer solve."""
    e = trainer.objective.elastic
    out: dict[tuple, list[int]] = {}
    for k in range(total):
        draw = e.draw(k) if e.enabled else None
        finer = draw is not None and e.finer_at(k, *draw) is not None
        out.setdefault((draw, finer), []).append(k)
    return out


def cost_table(rows: list[dict]) -> str:
    """The rows as markdown; rows timed by a `--only` run name it and the ode_rk4 they were
    set against."""
    shown = [{**row, "apart": "" if "timed_with" not in row else
              f"`{row['timed_with']}` (ode_rk4 {row['rk4_s_per_step']:.3f} s there; "
              f"other cores busy {row['other_cores']})"} for row in rows]
    columns = [("config", "config"), ("steps", "steps timed"), ("kinds", "kinds of step"),
               ("mean_nfe", "mean NFE of the drawn solves (whole run)"),
               ("s_per_step", "s / step"), ("ratio", "vs ode_rk4")]
    if any(r["apart"] for r in shown):
        columns.append(("apart", "timed apart, with its own ode_rk4"))
    return markdown_table(shown, columns)


def main() -> None:
    import tempfile

    entries = {**{name: (name, []) for name in CONFIGS}, **VARIANTS}
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help=f"time ode_rk4 and these alone, replacing their rows: {list(entries)}")
    args = ap.parse_args()
    path = RESULTS / "elastic_cost.json"
    if args.only:
        unknown = [n for n in args.only if n not in entries]
        if unknown:
            sys.exit(f"--only {' '.join(unknown)}: no such config or recipe here; the names are "
                     f"{', '.join(entries)}. Nothing was timed.")
        if not path.is_file():
            sys.exit(f"--only replaces rows of {path}, which does not exist: run "
                     f"`python bench/elastic_cost.py` once first. Nothing was timed.")
        entries = {n: v for n, v in entries.items() if n == CONFIGS[0] or n in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        if not finished_run(TEACHER):
            print(f"{TEACHER} is not trained (`continuumlm experiment elasticity`): the "
                  f"distilled recipe is left out")
            entries = {k: v for k, v in entries.items() if "distill.teacher" not in " ".join(v[1])}
        for i, (name, (config, sets)) in enumerate(entries.items()):
            cfg = load_config(f"configs/shakespeare_char/{config}.toml",
                              ["train.eval_interval=100000", "train.checkpoint_interval=100000",
                               *sets])
            trainers[name] = Trainer(cfg, f"{tmp}/{i}", quiet=True)
        for t in trainers.values():  # warm-up: one step each (allocator, first-call costs)
            t.train_step()
        total = {name: t.cfg.train.max_steps for name, t in trainers.items()}
        groups = {name: kinds(t, total[name]) for name, t in trainers.items()}
        seconds = {name: dict.fromkeys(g, 0.0) for name, g in groups.items()}
        timed = {name: dict.fromkeys(g, 0) for name, g in groups.items()}
        nfe = {name: dict.fromkeys(g, 0) for name, g in groups.items()}
        with OtherLoad() as others:
            for r in range(ROUNDS):
                for name, t in trainers.items():
                    reps = max(1, PER_ROUND // len(groups[name]))
                    for kind, steps in groups[name].items():
                        for i in range(reps):
                            t.step = steps[(r * reps + i) % len(steps)]  # a step of this kind
                            t0 = time.perf_counter()
                            t.train_step()
                            seconds[name][kind] += time.perf_counter() - t0
                            timed[name][kind] += 1
                            nfe[name][kind] = t.model.last_nfe

    def whole_run(name: str, per_kind: dict) -> float:
        """The run's mean per step: each kind's value weighted by how many steps it has."""
        return sum(len(groups[name][k]) * v for k, v in per_kind.items()) / total[name]

    rows = []
    for name in trainers:
        per_step = {k: seconds[name][k] / timed[name][k] for k in groups[name]}
        rows.append({"config": name, "steps": sum(timed[name].values()),
                     "kinds": len(groups[name]), "s_per_step": whole_run(name, per_step),
                     "mean_nfe": whole_run(name, nfe[name])})
    base = rows[0]["s_per_step"]
    for row in rows:
        row["ratio"] = row["s_per_step"] / base
    command, other_cores = "python bench/elastic_cost.py", others.cores
    if args.only:  # these rows replace theirs; the rest keep the run that timed them
        old = json.loads(path.read_text())
        label = f"{command} --only {' '.join(args.only)}"
        for row in rows[1:]:
            row.update(timed_with=label, other_cores=others.cores,
                       rk4_s_per_step=base)
        rows = [r for r in old["rows"] if r["config"] not in args.only] + rows[1:]
        command, other_cores = old["command"], old["other_cores"]
    table = cost_table(rows)
    print(table)
    write_json("elastic_cost", {
        "command": command,
        "setup": "each config's steps grouped by what a step costs (the drawn solver and step "
                 "count, and whether the consistency term's finer solve is added), every kind "
                 f"timed in {ROUNDS} rounds that alternate between the configs in one process, "
                 "and the whole run's seconds per step the mean over its steps, each at its "
                 f"kind's time; other cores busy meanwhile: {other_cores}",
        "rows": rows, "table": table, "other_cores": other_cores})


if __name__ == "__main__":
    main()
