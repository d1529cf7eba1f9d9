"""Cost per function evaluation: an ODE block vs one discrete layer of the same width.

    python bench/ode_cost.py            # writes bench/results/ode_cost.json

For each fixed-grid solver (direct gradients) it times forward+backward of one ODE block
(sequential field, 4 steps) and divides by the block's NFE, then divides by the time of one
discrete pre-norm layer (attention + MLP), so 1.0x means the solver adds nothing per NFE.
"""

from __future__ import annotations

import argparse

import torch
from common import markdown_table, time_ms, write_json

from continuumlm import ModelConfig
from continuumlm.model.depth import ODEBlock, TransformerBlock

SOLVERS = ["euler", "midpoint", "heun", "rk4", "rk4_38", "rk2_gated", "reversible_heun"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for width in (128, 384):
        torch.manual_seed(0)
        base = dict(vocab_size=65, hidden_size=width, num_heads=4 if width == 128 else 6,
                    num_layers=1, max_seq_len=64, position="none")
        x = torch.randn(12, 64, width, requires_grad=True)
        layer = TransformerBlock(ModelConfig(**base))

        t_layer = time_ms(lambda m=layer, x=x: m(x).sum().backward(), args.repeats)
        for solver in SOLVERS:
            block = ODEBlock(ModelConfig(**base, depth="ode", field="sequential", ode_solver=solver,
                                         ode_steps=args.steps), 0)

            t_block = time_ms(lambda m=block, x=x: m(x).sum().backward(), args.repeats)
            nfe = block.last_nfe
            rows.append({"width": width, "solver": solver, "nfe": nfe, "block_ms": t_block,
                         "ms_per_nfe": t_block / nfe, "layer_ms": t_layer,
                         "ratio": t_block / nfe / t_layer})
            print(rows[-1], flush=True)
    table = markdown_table(rows, [("width", "d"), ("solver", "solver"), ("nfe", "NFE"),
                                  ("ms_per_nfe", "ms / NFE"), ("layer_ms", "ms / discrete layer"),
                                  ("ratio", "ratio")])
    print(table)
    write_json("ode_cost", {
        "command": "python bench/ode_cost.py",
        "setup": "forward+backward, batch 12, context 64, sequential field, direct gradients, "
                 f"{args.steps} steps; median of {args.repeats}",
        "rows": rows, "table": table})


if __name__ == "__main__":
    main()
