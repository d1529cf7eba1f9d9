"""Training-step time of each mixer at equal depth and NFE.

    python bench/mixer_step.py           # writes bench/results/mixer_step.json

Forward+backward+AdamW step of a language model (vocab 65) for softmax, deltanet (without and
with its kernel-4 short convolution on q, k, v) and continuous mixers, in a 4-layer discrete stack and in one ODE block with 4 Euler steps
(both NFE 4), at the baby-GPT size (d=128, 4 heads, batch 12, context 64) and at CAT's
default size (d=128, 8 heads, batch 32, context 256).
"""

from __future__ import annotations

import torch
from common import markdown_table, time_ms, write_json

from continuumlm import LanguageModel, ModelConfig

SIZES = {"baby": dict(num_heads=4, batch=12, ctx=64), "cat": dict(num_heads=8, batch=32, ctx=256)}
DEPTHS = {"discrete x4": dict(depth="discrete", num_layers=4),
          "ode euler x4": dict(depth="ode", num_layers=1, ode_solver="euler", ode_steps=4)}
MIXERS = {"softmax": dict(mixer="softmax"), "deltanet": dict(mixer="deltanet"),
          "deltanet + short conv": dict(mixer="deltanet",
                                           components={"deltanet": {"short_conv": 4}}),
          "continuous": dict(mixer="continuous")}


def main() -> None:
    rows = []
    for size, sz in SIZES.items():
        for depth, dkw in DEPTHS.items():
            base_ms = None
            for mixer, mkw in MIXERS.items():
                torch.manual_seed(0)
                m = LanguageModel(ModelConfig(vocab_size=65, hidden_size=128,
                                              num_heads=sz["num_heads"], max_seq_len=sz["ctx"],
                                              **mkw, **dkw))
                opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
                x = torch.randint(0, 65, (sz["batch"], sz["ctx"]))

                def step(m=m, opt=opt, x=x):
                    _, loss = m(x, x)
                    (loss + m.penalty()).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                ms = time_ms(step, repeats=10, warmup=2)
                base_ms = base_ms or ms
                rows.append({"size": size, "depth": depth, "mixer": mixer, "nfe": m.last_nfe,
                             "ms": ms, "vs_softmax": ms / base_ms})
                print(rows[-1], flush=True)
    table = markdown_table(rows, [("size", "size"), ("depth", "depth"), ("mixer", "mixer"),
                                  ("nfe", "NFE"), ("ms", "ms / training step"),
                                  ("vs_softmax", "time / softmax time (x)")])
    print(table)
    write_json("mixer_step", {"command": "python bench/mixer_step.py",
                              "setup": "d=128; baby: 4 heads, batch 12, context 64; cat: 8 heads, "
                                       "batch 32, context 256; median of 10 steps",
                              "rows": rows, "table": table})


if __name__ == "__main__":
    main()
