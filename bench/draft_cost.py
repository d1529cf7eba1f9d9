"""What a drafted token's pass costs self-speculative decoding: the lean draft step against the
decoding pass, in the same process.

    python bench/draft_cost.py RUN [RUN ...]   # writes bench/results/draft_cost.json

A drafted token of a coarse solve (Euler x 1: one field evaluation) costs a whole decoding
pass through the library, most of it outside the field; decoding/lean_draft.py's step writes
the solve out op by op. For each run, batch 1, eager, Euler x 1 drafts, k drafts per
verification: greedy (the tokens must equal plain decoding's) and sampled (temperature 0.8,
top-k 40, one seed per prompt) speculative decoding with the drafts by the decoding pass
(``Draft(lean=False)``) and by the lean step, each against plain cached decoding timed beside
it (the model's own solve, plain and verifying, by the lean step too: Decoder's default),
medians over repeats; and the passes timed alone (the fastest of interleaved repeats):
either draft's one token, plain decoding's, a verification of k + 1 tokens. From those, what
the target would give at either draft cost, and with drafts that cost nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from common import machine, markdown_table, write_json
from speculative import TARGET, decode, lean_ms, trained

from continuumlm import Draft
from continuumlm.decoding import Decoder
from continuumlm.decoding.lean_draft import LeanDraft, own_solve, refusal
from continuumlm.decoding.speculative import _Solves

K = 8  # drafts per verification: bench/speculative.py's fastest eager greedy row


def timed(decoder, prompts, n, draft=None, sampled=False):
    """(outputs, tokens/s, verifications) over every prompt (bench/speculative.py's decode,
    sampled with one seed per prompt), refusing a row whose drafts were not made as labelled."""
    outs, tps, stats = decode(decoder, prompts, n, draft, seed=0 if sampled else None)
    if draft is not None:
        want = "lean step" if draft.lean else "decoding pass (Draft(lean=False))"
        if stats["drafted_by"] != want:  # never a row timed under the wrong label
            raise SystemExit(f"drafts by {stats['drafted_by']!r}, not {want!r}.")
    return outs, tps, stats["rounds"]


def best_ms(fn, inner: int, reps: int = 7) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return 1e3 * best


@torch.inference_mode()
def pass_costs(model, prompt: torch.Tensor) -> dict:
    """Milliseconds of one pass at batch 1 after ``prompt``: a drafted token by the lean step
    and by the decoding pass (Euler x 1), a plain token (the own solve) and a verification of
    k + 1 tokens (the own solve as decoding runs it: by the lean step where it covers the
    model), each the fastest of interleaved repeats."""
    solves = _Solves(model, "euler", 1)
    draft_state = model.init_state(1)
    ids = prompt[0].tolist()
    with solves.drafting():
        model.hidden_states(prompt, draft_state)
    if refusal(model, own_solve(model)) is not None:
        raise SystemExit(f"the lean step does not cover this model's own solve "
                         f"({refusal(model, own_solve(model))}); decoding would not run it so.")
    own_step = LeanDraft(model, own_solve(model))
    own_step.logits(ids)
    at = len(ids)

    def by_pass():
        with solves.drafting():
            model.lm_head(model.hidden_states(torch.tensor([[5]], device=prompt.device),
                                              draft_state)[:, -1])
        draft_state.crop(at)

    def own(T):
        own_step.logits([5] * T, every=True)
        own_step.crop(at)

    times: dict[str, list[float]] = {"lean_draft_ms": [], "pass_draft_ms": [], "plain_ms": [],
                                     "verify_ms": []}
    for _ in range(3):  # interleaved: a slow stretch of the machine hits each alike
        times["lean_draft_ms"].append(lean_ms(model, prompt, solves, reps=7, inner=50))
        times["pass_draft_ms"].append(best_ms(by_pass, 50))
        times["plain_ms"].append(best_ms(lambda: own(1), 10))
        times["verify_ms"].append(best_ms(lambda: own(K + 1), 10))
    return {k: round(min(v), 4) for k, v in times.items()}


def measure(run: str, n_prompts: int, prompt_len: int, repeats: int) -> dict:
    model, prompts = trained(run, n_prompts, prompt_len)
    n = model.config.max_seq_len - prompt_len + 1
    decoder = Decoder(model)
    timed(decoder, prompts[:1], 8)  # warm-up
    speed: dict[str, list[float]] = {}
    per_round: dict[str, float] = {}
    for _ in range(repeats):
        for sampled in (False, True):
            how = "sampled" if sampled else "greedy"
            plain, plain_tps, _ = timed(decoder, prompts, n, sampled=sampled)
            for by, lean in (("pass", False), ("lean", True)):
                out, tps, rounds = timed(decoder, prompts, n, Draft("euler", 1, K, lean=lean),
                                         sampled)
                if not sampled and out != plain:
                    raise SystemExit(f"{run}: greedy tokens with drafts by the {by} differ "
                                     f"from plain decoding's.")
                speed.setdefault(f"{how}_{by}", []).append(tps / plain_tps)
                per_round[f"{how}_{by}"] = round(sum(map(len, out)) / rounds, 2)
    costs = pass_costs(model, prompts[0])
    plain_ms, verify = costs["plain_ms"], costs["verify_ms"]
    tpr = per_round["greedy_lean"]

    def bound(draft_ms: float) -> float:
        """Greedy's tokens per verification over a round's passes alone (k drafts and one
        verification), against plain decoding's pass per token."""
        return round(tpr * plain_ms / (K * draft_ms + verify), 2)

    return {"name": Path(run).name, "run": run, "new_tokens": n,
            "speedup": {k: round(statistics.median(v), 2) for k, v in speed.items()},
            "speedup_range": {k: [round(min(v), 2), round(max(v), 2)] for k, v in speed.items()},
            "tokens_per_verification": per_round, **costs,
            "bound_pass": bound(costs["pass_draft_ms"]),
            "bound_lean": bound(costs["lean_draft_ms"]), "bound_free": bound(0.0),
            "plain_by": decoder.decoded_by}


COLUMNS = [("name", "model"), ("greedy_pass", "greedy, decoding-pass drafts"),
           ("greedy_lean", "greedy, lean drafts"), ("sampled_pass", "sampled, decoding-pass"),
           ("sampled_lean", "sampled, lean"),
           ("tokens_per_verification", "tokens per verification (greedy)"),
           ("pass_draft_ms", "draft ms: decoding pass"), ("lean_draft_ms", "... lean step"),
           ("plain_ms", "plain token ms"), ("verify_ms", f"verification of {K + 1} ms"),
           ("bound_free", "bound: free drafts")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    models = [measure(r, args.prompts, args.prompt_len, args.repeats) for r in args.runs]
    rows = [{**m, **m["speedup"],
             "tokens_per_verification": m["tokens_per_verification"]["greedy_lean"]}
            for m in models]
    command = "python bench/draft_cost.py " + " ".join(args.runs)
    for flag, value, default in (("--prompts", args.prompts, 8),
                                 ("--prompt-len", args.prompt_len, 8),
                                 ("--repeats", args.repeats, 3)):
        if value != default:
            command += f" {flag} {value}"
    write_json("draft_cost", {
        "command": command,
        "setup": (f"batch 1, eager, Euler x 1 drafts, k = {K}; greedy, and sampled at "
                  f"temperature 0.8, top-k 40; {args.prompts} prompts of {args.prompt_len} "
                  f"tokens from each run's validation split, as many new tokens as its "
                  f"positions leave; speed-ups against plain cached decoding timed beside "
                  f"each, medians of {args.repeats} repeats; {machine()}"),
        "k": K, "target_speedup": TARGET, "models": models,
        "table": markdown_table(rows, COLUMNS),
        "load_average": [round(x, 2) for x in os.getloadavg()[:2]]})
    print(markdown_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
