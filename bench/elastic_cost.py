"""Training cost of elastic depth: seconds per optimizer step of ode_elastic,
ode_elastic_consistency, ode_elastic_narrow, ode_elastic_upto16 and the ode_elastic_dial
configs against ode_rk4 (fixed RK4 x 4), at equal steps.

    python bench/elastic_cost.py      # writes bench/results/elastic_cost.json

The configs' trainers run in one process, their first 120 steps timed in rounds of 20
steps that alternate between them, so that whatever else the machine does slows them all
alike (the ratios are what is read; the absolute times are understated when other work ran, as
`other_cores` records). Elastic steps draw their solver and step count from (seed, step): the
120 steps are the runs' own first 120 draws.
"""

from __future__ import annotations

import time

from common import OtherLoad, markdown_table, write_json

from continuumlm.config import load_config
from continuumlm.train import Trainer

CONFIGS = ["ode_rk4", "ode_elastic", "ode_elastic_consistency", "ode_elastic_narrow",
           "ode_elastic_upto16", "ode_elastic_dial", "ode_elastic_dial4",
           "ode_elastic_dial_consistency"]
ROUNDS, STEPS = 6, 20


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in CONFIGS:
            cfg = load_config(f"configs/shakespeare_char/{name}.toml",
                              ["train.eval_interval=100000", "train.checkpoint_interval=100000"])
            trainers[name] = Trainer(cfg, f"{tmp}/{name}", quiet=True)
        for t in trainers.values():  # warm-up: one step each (allocator, first-call costs)
            t.train_step()
        seconds = dict.fromkeys(CONFIGS, 0.0)
        nfe = dict.fromkeys(CONFIGS, 0)
        with OtherLoad() as others:
            for _ in range(ROUNDS):
                for name, t in trainers.items():
                    t0 = time.perf_counter()
                    for _ in range(STEPS):
                        t.train_step()
                        nfe[name] += t.model.last_nfe
                    seconds[name] += time.perf_counter() - t0
    n = ROUNDS * STEPS
    base = seconds["ode_rk4"] / n
    rows = [{"config": name, "steps": n, "s_per_step": seconds[name] / n,
             "mean_nfe": nfe[name] / n, "ratio": seconds[name] / n / base} for name in CONFIGS]
    table = markdown_table(rows, [("config", "config"), ("steps", "steps timed"),
                                  ("mean_nfe", "mean NFE of the drawn solves"),
                                  ("s_per_step", "s / step"), ("ratio", "vs ode_rk4")])
    print(table)
    write_json("elastic_cost", {
        "command": "python bench/elastic_cost.py",
        "setup": f"steps 2-{n + 1} of each config's own run, timed in {ROUNDS} alternating "
                 f"rounds of {STEPS} in one process; other cores busy meanwhile: "
                 f"{others.cores}",
        "rows": rows, "table": table, "other_cores": others.cores})


if __name__ == "__main__":
    main()
