"""Greedy cached generation through transformers' ``generate`` vs ContinuumLM's own.

    python bench/hf_generate.py        # writes bench/results/hf_generate.json

The same untrained model (one ODE block, sequential field, RK4 x 4: NFE 16 per token; d=128,
4 heads, RoPE, vocabulary 65), batch 1, a 32-token prompt, 256 new tokens, greedy:
``model.generate(prompt, 256, greedy=True)`` (eager cached decoding, what `continuumlm
generate --greedy` runs) against ``ContinuumLMForCausalLM.generate(prompt, max_new_tokens=256,
do_sample=False)``, which decodes through ``ContinuumLMCache`` (the same per-stage caches).
Interleaved rounds, median; the outputs are checked to be equal token for token. Target: HF
at least 0.8x our tokens/s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_json  # noqa: E402

import continuumlm.hf  # noqa: E402,F401
from continuumlm import LanguageModel, ModelConfig  # noqa: E402
from continuumlm.hf import ContinuumLMForCausalLM  # noqa: E402

NEW, PROMPT, ROUNDS = 256, 32, 5


def main() -> None:
    rows = []
    for mixer in ("softmax", "deltanet"):
        torch.manual_seed(0)
        lm = LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4,
                                       num_layers=1, depth="ode", ode_solver="rk4",
                                       ode_steps=4, mixer=mixer, max_seq_len=512)).eval()
        with tempfile.TemporaryDirectory() as d:
            lm.save_pretrained(d)
            hf = ContinuumLMForCausalLM.from_pretrained(d)
        prompt = torch.randint(0, 65, (1, PROMPT), generator=torch.Generator().manual_seed(1))
        runs = {"ours": lambda: lm.generate(prompt, NEW, greedy=True),
                "hf": lambda: hf.generate(prompt, max_new_tokens=NEW, do_sample=False,
                                          pad_token_id=0)}
        outs = {k: f() for k, f in runs.items()}  # warm-up, and the outputs compared
        same = outs["ours"].tolist() == outs["hf"].tolist()
        times = {k: [] for k in runs}
        for _ in range(ROUNDS):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        tps = {k: NEW / statistics.median(v) for k, v in times.items()}
        rows.append({"mixer": mixer, "ours": round(tps["ours"], 1), "hf": round(tps["hf"], 1),
                     "ratio": round(tps["hf"] / tps["ours"], 3), "same_tokens": same})
        print(rows[-1], flush=True)
    table = markdown_table(rows, [("mixer", "mixer"), ("ours", "ours tok/s"),
                                  ("hf", "HF generate tok/s"), ("ratio", "HF / ours"),
                                  ("same_tokens", "same tokens")])
    write_json("hf_generate", {
        "command": "python bench/hf_generate.py",
        "setup": (f"one ODE block, RK4 x 4 (NFE 16 per token), d=128, 4 heads, batch 1, prompt "
                  f"{PROMPT}, {NEW} new tokens, greedy, eager; median of {ROUNDS} interleaved "
                  f"rounds; target HF >= 0.8x ours"),
        "rows": rows, "table": table})
    print(table)


if __name__ == "__main__":
    main()
