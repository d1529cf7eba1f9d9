"""Peak memory and time of one training step vs solver steps, for each gradient mode.

    python bench/ode_memory.py          # writes bench/results/ode_memory.json

Each (mode, steps) point runs in a fresh process: the peak resident set size during one
forward+backward, minus the resident size just before it, is the step's peak memory (CPU has
no allocator statistics, and a fresh process keeps earlier points from hiding later peaks).
A warm-up step on a 2-token input first loads every module the mode imports, and glibc is told
to map large blocks directly (MALLOC_MMAP_THRESHOLD_), so resident size follows live tensors.
Model: one ODE block (sequential field) at d=128, 4 heads, batch 12, context 64. Each row
also records the field evaluations of the backward pass (the recomputation factor: backward
evaluations per forward evaluation) and the cores other work kept busy meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common import OtherLoad, markdown_table, training_step_peak, write_json

MODES = [("direct", "euler"), ("checkpoint", "euler"), ("binomial", "euler"),
         ("adjoint", "euler"), ("direct", "reversible_heun"), ("reversible", "reversible_heun")]
STEPS = [4, 16, 64, 256]
SKIP = {("direct", 256)}  # 1.6 GB and nothing new: direct grows linearly


def child(mode: str, solver: str, steps: int) -> None:
    import torch

    from continuumlm import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=1, max_seq_len=64,
                      position="learned", depth="ode", ode_solver=solver, ode_steps=steps,
                      ode_grad=mode)
    model = LanguageModel(cfg)
    x = torch.randint(0, 65, (12, 64))
    peak_mb, seconds = training_step_peak(model, x, timed=1)
    nfe, backward_nfe = model.last_nfe, model.last_backward_nfe
    print(json.dumps({"peak_mb": peak_mb, "seconds": seconds, "nfe": nfe,
                      "backward_nfe": backward_nfe, "recompute": backward_nfe / nfe}))


def main() -> None:
    rows = []
    for mode, solver in MODES:
        for steps in STEPS:
            if (mode, steps) in SKIP:
                continue
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            with OtherLoad() as others:
                out = subprocess.run([sys.executable, __file__, "--child", mode, solver,
                                      str(steps)], check=True, capture_output=True, text=True,
                                     env=env)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"grad": mode, "solver": solver, "steps": steps, **r,
                         "other_cores": others.cores})
            print(rows[-1], flush=True)
    for r in rows:
        ref4 = next(x for x in rows if x["grad"] == r["grad"] and x["solver"] == r["solver"]
                    and x["steps"] == 4)
        direct = next((x for x in rows if x["grad"] == "direct" and x["solver"] == r["solver"]
                       and x["steps"] == r["steps"]), None)
        r["peak_vs_4_steps"] = r["peak_mb"] / ref4["peak_mb"]
        r["time_vs_direct"] = r["seconds"] / direct["seconds"] if direct else None
    table = markdown_table(rows, [("grad", "ode_grad"), ("solver", "solver"), ("steps", "steps"),
                                  ("peak_mb", "peak MB"), ("peak_vs_4_steps", "peak / peak at 4"),
                                  ("recompute", "backward evals / forward evals"),
                                  ("seconds", "s / step"), ("time_vs_direct", "time / direct"),
                                  ("other_cores", "other cores busy")])
    print(table)
    write_json("ode_memory", {"command": "python bench/ode_memory.py",
                              "setup": "one ODE block, d=128, 4 heads, batch 12, context 64; "
                                       "peak RSS growth during one training step; binomial "
                                       "keeps about log2(steps) states (model.ode_checkpoints "
                                       "= 0); times measured while other work kept the cores "
                                       "busy are understated (last column)",
                              "rows": rows, "table": table})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
