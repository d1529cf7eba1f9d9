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
from common import RESULTS, ROOT, markdown_table, write_json

from continuumlm import LanguageModel, load_config


def matmul_peak_gflops(n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def flops_per_token(cfg, nfe: int, seq_len: int) -> float:
    model = LanguageModel(cfg.model)
    m = cfg.model
    depth_params = sum(p.numel() for p in model.depth.parameters())
    per_eval = depth_params / m.num_layers
    head = m.vocab_size * m.hidden_size
    return 6 * (per_eval * nfe + head) + 12 * nfe * seq_len * m.hidden_size


def main() -> None:
    peak = matmul_peak_gflops()
    rows = []
    for path in sorted(RESULTS.glob("shakespeare_char-*.json")):
        r = json.loads(path.read_text())
        cfg = load_config(ROOT / r["config"], r.get("overrides", []) +
                          ["model.vocab_size=65"])
        nfe = r.get("nfe") or cfg.model.num_layers
        fpt = flops_per_token(cfg, nfe, cfg.train.seq_len)
        achieved = fpt * r["tokens_per_s_median"] / 1e9
        rows.append({"run": path.stem, "nfe": nfe, "mflop_per_token": fpt / 1e6,
                     "tokens_per_s": r["tokens_per_s_median"], "gflops": achieved,
                     "mfu": achieved / peak})
    table = markdown_table(rows, [("run", "run"), ("nfe", "NFE"),
                                  ("mflop_per_token", "MFLOP / token"),
                                  ("tokens_per_s", "tokens/s"), ("gflops", "GFLOP/s"),
                                  ("mfu", "MFU")])
    print(f"fp32 matmul peak {peak:.1f} GFLOP/s\n{table}")
    write_json("mfu", {"command": "python bench/mfu.py", "peak_gflops": peak,
                       "setup": f"measured fp32 matmul peak {peak:.1f} GFLOP/s (2048x2048, "
                                f"{torch.get_num_threads()} threads); training runs of "
                                f"bench/results/shakespeare_char-*.json",
                       "rows": rows, "table": table})


if __name__ == "__main__":
    main()
