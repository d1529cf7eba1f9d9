"""DeltaNet kernels vs causal softmax attention, forward + backward on CPU (fp32).

    python bench/deltanet_kernels.py     # writes bench/results/deltanet_kernels.json

B=4, H=4, D=64; T in {256, 1024, 4096}. The recurrent (token-loop) kernel is the reference;
the chunkwise kernel is what training uses; SDPA is torch's causal scaled_dot_product_attention
on tensors of the same shape.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import markdown_table, time_ms, write_json

from continuumlm.mixers import delta_rule_chunkwise, delta_rule_recurrent

B, H, D = 4, 4, 64


def inputs(T: int):
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1).requires_grad_()
    k = F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1).requires_grad_()
    v = torch.randn(B, H, T, D, generator=g).requires_grad_()
    beta = torch.rand(B, H, T, generator=g).requires_grad_()
    return q, k, v, beta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--recurrent-max", type=int, default=1024,
                    help="longest T for the (slow) token loop")
    args = ap.parse_args()
    rows = []
    for T in args.lengths:
        q, k, v, beta = inputs(T)
        reps = 10 if T <= 1024 else 5
        row = {"T": T}
        row["chunkwise_ms"] = time_ms(
            lambda: delta_rule_chunkwise(q, k, v, beta, args.chunk)[0].sum().backward(), reps)
        row["sdpa_ms"] = time_ms(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), reps)
        if T <= args.recurrent_max:
            row["recurrent_ms"] = time_ms(
                lambda: delta_rule_recurrent(q, k, v, beta)[0].sum().backward(), 3, warmup=1)
            row["speedup_vs_recurrent"] = row["recurrent_ms"] / row["chunkwise_ms"]
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["chunkwise_ms"]
        rows.append(row)
        print(row, flush=True)
    table = markdown_table(rows, [("T", "T"), ("recurrent_ms", "recurrent ms"),
                                  ("chunkwise_ms", "chunkwise ms"), ("sdpa_ms", "SDPA ms"),
                                  ("speedup_vs_recurrent", "chunkwise speedup over recurrent (x)"),
                                  ("speedup_vs_sdpa", "chunkwise speedup over SDPA (x)")])
    print(table)
    write_json("deltanet_kernels", {
        "command": "python bench/deltanet_kernels.py",
        "setup": f"forward+backward, B={B}, H={H}, D={D}, fp32, chunk {args.chunk}; median ms",
        "rows": rows, "table": table})


if __name__ == "__main__":
    main()
