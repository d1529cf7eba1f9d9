"""Self-speculative decoding through depth: a coarser solve of the same weights drafts, the
model's own solve verifies a block of drafts in one pass.

    python bench/speculative.py                 # writes bench/results/speculative.json
    python bench/speculative.py --run DIR       # ... on a trained run folder's best checkpoint

Greedy, batch 1, eager, a 64-token prompt and 512 new tokens (fewer where learned positions
end sooner). The model: by default the decoding benchmark's (bench/decode_speed.py: 4 ODE
blocks of RK4 x 4 steps, d 128, softmax, RoPE) with its random initial weights, recorded as
such; ``--run`` a trained one. Plain cached decoding is timed beside every draft in the same
process; every drafted run's tokens are checked against it. Draft solves Euler x 1, 2, 4,
midpoint x 1 and RK4 x 1; k = 2, 4, 8 and auto.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import markdown_table, write_json

from continuumlm import Draft, LanguageModel, ModelConfig

DRAFTS = [("euler", 1), ("euler", 2), ("euler", 4), ("midpoint", 1), ("rk4", 1)]
TOKENS = [2, 4, 8, "auto"]


def benchmark_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=4,
                                     max_seq_len=1024, mixer="softmax", depth="ode",
                                     field="sequential", ode_solver="rk4", ode_steps=4)).eval()


def trained(run: str) -> tuple[LanguageModel, torch.Tensor]:
    from continuumlm.data import prepare_data
    from continuumlm.train import load_model_and_tokenizer
    from continuumlm.train.checkpoint import load_run_config

    model, tok, ckpt = load_model_and_tokenizer(run, "best")
    split = prepare_data(load_run_config(ckpt).data, tok).splits["val"]
    return model.eval(), split[:64][None].long()


def timed(model, prompt, n, draft=None):
    t0 = time.perf_counter()
    stream = model.generate_stream(prompt, n, greedy=True, draft=draft)
    out = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    return out, n / (time.perf_counter() - t0), getattr(stream, "stats", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", help="a trained run folder (its best checkpoint)")
    ap.add_argument("--new-tokens", type=int, default=512)
    args = ap.parse_args()
    if args.run:
        model, prompt = trained(args.run)
        what = f"the best checkpoint of {args.run}"
    else:
        model = benchmark_model()
        prompt = torch.randint(0, 65, (1, 64), generator=torch.Generator().manual_seed(1))
        what = ("the decoding benchmark's model (4 ODE blocks of RK4 x 4, d 128, softmax, "
                "RoPE) with its random initial weights")
    cfg = model.config
    n = args.new_tokens
    if cfg.position == "learned":
        n = min(n, cfg.max_seq_len - prompt.shape[1] + 1)
    full_nfe = cfg.num_layers * cfg.ode_steps * model.depth.blocks[0].solver.evals_per_step
    timed(model, prompt, 8)  # warm-up
    plain, _, _ = timed(model, prompt, n)
    # an untrained model's greedy text is degenerate (a few tokens repeated), which any draft
    # predicts: recorded, so that its rows read as the mechanism's ceiling, not a model's
    distinct = len(set(plain[0, prompt.shape[1]:].tolist()))
    rows = []
    for solver, steps in DRAFTS:
        for k in TOKENS:
            plain, plain_tps, _ = timed(model, prompt, n)
            out, tps, s = timed(model, prompt, n, Draft(solver, steps, k))
            rows.append({"draft": f"{solver} x {steps}", "k": k,
                         "acceptance": round(s.acceptance, 3),
                         "tokens_per_verification": round(s.tokens / s.rounds, 2),
                         "nfe_per_token": round(s.nfe / s.tokens, 1),
                         "plain_nfe_per_token": full_nfe,
                         "tok_s": round(tps, 1), "plain_tok_s": round(plain_tps, 1),
                         "speedup": round(tps / plain_tps, 2),
                         "same_tokens": out.tolist() == plain.tolist()})
            print(rows[-1], flush=True)
    table = markdown_table(rows, [
        ("draft", "draft solve"), ("k", "k"), ("acceptance", "drafts kept"),
        ("tokens_per_verification", "tokens per verification"),
        ("nfe_per_token", "field evaluations per token"),
        ("plain_nfe_per_token", "... plain"), ("tok_s", "tokens/s"),
        ("plain_tok_s", "plain tokens/s"), ("speedup", "speed-up"),
        ("same_tokens", "same tokens")])
    name = "speculative" if not args.run else f"speculative-{Path(args.run).name}"
    write_json(name, {"command": "python bench/speculative.py"
                      + (f" --run {args.run}" if args.run else ""),
                      "setup": (f"{what}; greedy, batch 1, eager, a {prompt.shape[1]}-token "
                                f"prompt, {n} new tokens ({distinct} distinct in the plain "
                                f"output); plain cached decoding timed beside each row"),
                      "model": cfg.to_dict(), "distinct_new_tokens": distinct,
                      "rows": rows, "table": table})
    print(table)


if __name__ == "__main__":
    main()
