"""Model FLOPs utilization of the Tiny Shakespeare training runs against this machine's
measured fp32 matmul peak.

    python bench/mfu.py          # writes bench/results/mfu.json (needs the shakespeare JSONs)

Peak: the best of several 2048x2048 fp32 matrix products with torch's default threads.
Model FLOPs per training token (PaLM's accounting, fwd+bwd = 3x fwd): 6 x (parameters of one
depth evaluation x NFE + the output layer's V x d) + 12 x NFE x T x d for the attention scores
and mixing (non-causal count; used for every mixer as an approximation). Throughput is the
median tokens/s logged by the run.
"""

from __future__ import annotations

import json
import time

import torch
from common import RESULTS, forward_nfe, load_mark, markdown_table, run_config, write_json

from continuumlm import LanguageModel


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def matmul_params(model: LanguageModel, nfe: int) -> float:
    """Weights applied per token in one forward: a discrete layer's once; an ODE block's field
    once per evaluation (NFE split evenly over the blocks) and whatever sits outside the field
    (the attention field's discrete MLP) once."""
    depth = model.depth
    if hasattr(depth, "layers"):
        return sum(p.numel() for p in depth.parameters())
    per_block = nfe / len(depth.blocks)
    total = 0.0
    for block in depth.blocks:
        field = sum(p.numel() for p in block.field.parameters())
        rest = sum(p.numel() for p in block.parameters()) - field
        total += field * per_block + rest
    return total


def flops_per_token(cfg, nfe: int, seq_len: int) -> float:
    model = LanguageModel(cfg.model)
    m = cfg.model
    mixing = nfe if cfg.model.depth == "ode" else m.num_layers  # attention-like evaluations
    return (6 * (matmul_params(model, nfe) + m.vocab_size * m.hidden_size)
            + 12 * mixing * seq_len * m.hidden_size)


def main() -> None:
    peak = matmul_peak_gflops()
    rows, skipped = [], []
    for path in sorted(RESULTS.glob("shakespeare_char-*.json")):
        r = json.loads(path.read_text())
        cfg = run_config(r, "model.vocab_size=65")
        nfe, varies = forward_nfe(r, cfg)  # an elastic or adaptive run's mean, not its last draw
        if nfe is None:
            skipped.append(path.stem.replace("shakespeare_char-", ""))
            continue  # a varying run recorded before its mean NFE was
        fpt = flops_per_token(cfg, nfe, cfg.train.seq_len)
        achieved = fpt * r["tokens_per_s_median"] / 1e9
        rows.append({"run": path.stem.replace("shakespeare_char-", ""),
                     "nfe": f"~{nfe:.1f}" if varies else nfe,
                     "mflop_per_token": round(fpt / 1e6, 2),
                     "tokens_per_s": f"{r['tokens_per_s_median']:.0f}" + load_mark([r]),
                     "gflops": round(achieved, 1), "mfu": f"{100 * achieved / peak:.0f}%"})
    table = markdown_table(rows, [("run", "run"), ("nfe", "NFE"),
                                  ("mflop_per_token", "MFLOP / token"),
                                  ("tokens_per_s", "tokens/s"), ("gflops", "GFLOP/s"),
                                  ("mfu", "MFU")])
    print(f"fp32 matmul peak {peak:.1f} GFLOP/s\n{table}")
    write_json("mfu", {"command": "python bench/mfu.py", "peak_gflops": peak,
                       "setup": f"measured fp32 matmul peak {peak:.1f} GFLOP/s (2048x2048, "
                                f"{torch.get_num_threads()} threads); training runs of "
                                f"bench/results/shakespeare_char-*.json (* = measured while "
                                f"the machine was shared: understated; ° = no load "
                                f"recorded; ~ = a mean NFE: an elastic run's draw set's "
                                f"expectation, an adaptive run's last tenth of training)"
                                + (f"; left out, their mean NFE not recorded: "
                                   f"{', '.join(skipped)}" if skipped else ""),
                       "rows": rows, "table": table})


if __name__ == "__main__":
    main()
