"""Self-speculative decoding through depth: a coarser solve of the same weights drafts, the
model's own solve verifies a block of drafts in one pass.

    python bench/speculative.py                  # writes bench/results/speculative.json
    python bench/speculative.py --runs DIR ...   # ... trained runs instead
    python bench/speculative.py --mode compiled  # bench/results/speculative_compiled.json
    python bench/speculative.py --mode pipelined --threads 1  # ... speculative_pipelined.json

Batch 1, eager, or compiled (``--mode compiled``: ``generate(compile=True)``, the drafts
and the verifying pass through compiled frozen steps, against plain compiled decoding, in a
record of its own), or pipelined (``--mode pipelined``: ``Draft(pipeline=True)``, eager, the
drafts made ahead by a forked drafting process on the second core while the verifier runs on
one thread; against plain eager decoding at the run's thread count, and in the re-timed rows
at the other count too). Greedy rows check that the tokens equal plain cached decoding's; sampled rows
(temperature 0.8, top-k 40, the demo's) draw from the same distribution as plain sampling
(speculative sampling; tests/test_speculative.py holds it to that), and are timed against
plain sampling. Each row decodes from every prompt in turn (with a learned-position model,
as many new tokens as its positions leave) and sums the time; plain decoding is timed beside
every row in the same process. The model: by default the decoding benchmark's
(bench/decode_speed.py: 4 ODE blocks of RK4 x 4 steps, d 128, softmax, RoPE) with its random
initial weights, recorded as such; ``--runs`` trained ones (each its best checkpoint,
prompts cut from its validation split). The speed-up target is 2.5x plain cached decoding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from common import machine, markdown_table, write_json

from continuumlm import Draft, LanguageModel, ModelConfig
from continuumlm.decoding import Decoder
from continuumlm.decoding.kernels import CHOICES, decoding_kernels
from continuumlm.decoding.lean_draft import LeanDraft, refusal
from continuumlm.decoding.lean_stack import LeanStack
from continuumlm.decoding.speculative import _Solves

DRAFTS = [("euler", 1), ("euler", 2), ("euler", 4), ("midpoint", 1), ("rk4", 1)]
TOKENS = [2, 4, 8, "auto"]
SAMPLING = dict(temperature=0.8, top_k=40)
TARGET = 2.5


def benchmark_model() -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=4,
                                     max_seq_len=1024, mixer="softmax", depth="ode",
                                     field="sequential", ode_solver="rk4", ode_steps=4)).eval()


def trained(run: str, n_prompts: int, prompt_len: int) -> tuple[LanguageModel, list]:
    from continuumlm.data import prepare_data
    from continuumlm.runs import load_model_and_tokenizer
    from continuumlm.runs.checkpoint import load_run_config

    model, tok, ckpt = load_model_and_tokenizer(run, "best")
    split = prepare_data(load_run_config(ckpt).data, tok).splits["val"]
    step = (len(split) - prompt_len) // n_prompts
    prompts = [torch.from_numpy(split[i * step:i * step + prompt_len].astype("int64"))[None]
               for i in range(n_prompts)]
    return model.eval(), prompts


class FieldClock:
    """Wall time spent inside the ODE blocks' vector-field evaluations, or a discrete stack's
    layers (eager decoding), to tell what share of a token's time is outside them: embedding,
    head, sampling, the solver's combinations, cache bookkeeping, Python. The field's (or
    layer's) class ``forward`` is wrapped while the clock runs, and so are the lean steps'
    field evaluation and layer (decoding/lean_draft.py, lean_stack.py, which do not call
    those modules): not hooks or an instance's replaced forward, which the lean steps refuse
    (they would skip them)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        units = ([b.field for b in model.depth.blocks] if hasattr(model.depth, "blocks")
                 else list(model.depth.layers))
        self.patched = [(cls, "forward", cls.forward) for cls in dict.fromkeys(map(type, units))]
        self.patched += [(LeanDraft, "_field", LeanDraft._field),
                         (LeanStack, "_layer", LeanStack._layer)]
        for cls, name, fn in self.patched:
            setattr(cls, name, self._timed(fn))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def remove(self) -> None:
        for cls, name, fn in self.patched:
            setattr(cls, name, fn)


def decode(decoder, prompts, n, draft=None, seed=None, clock=None):
    """(outputs, tokens/s over every prompt, the summed DraftStats fields); with ``clock``
    (a FieldClock), the stats also hold ``outside_field``: the share of the time spent
    outside the field evaluations."""
    outs, total, made = [], 0.0, 0
    inside = clock.seconds if clock is not None else 0.0
    stats = {"rounds": 0, "drafted": 0, "accepted": 0, "tokens": 0, "nfe": 0}
    for i, prompt in enumerate(prompts):
        kw = (dict(greedy=True) if seed is None else
              dict(generator=torch.Generator().manual_seed(seed + i), **SAMPLING))
        t0 = time.perf_counter()
        stream = decoder.stream(prompt, n, draft=draft, **kw)
        out = [int(t) for t in stream]
        total += time.perf_counter() - t0
        outs.append(out)
        made += len(out)
        for key in ("rounds", "drafted", "accepted", "tokens", "nfe"):
            stats[key] += getattr(getattr(stream, "stats", None), key, 0)
        stats["drafted_by"] = getattr(getattr(stream, "stats", None), "drafted_by", None)
        stats["verified_by"] = getattr(getattr(stream, "stats", None), "verified_by", None)
    if clock is not None:
        stats["outside_field"] = round(1 - (clock.seconds - inside) / total, 3)
    return outs, made / total, stats


def measure(model, prompts, n, drafts, modes, confirm: int = 0, tokens=TOKENS,
            confidences=(None,)) -> tuple[list[dict], int, dict]:
    """Every (decoding, draft solve, k, confidence) row for one model, eager and/or compiled, the
    distinct tokens of its plain greedy output, and (``confirm`` > 0) each mode and
    decoding's fastest row timed again ``confirm`` times against plain decoding beside it
    (:func:`confirmed`)."""
    cfg = model.config
    full_nfe = (cfg.num_layers * cfg.ode_steps * model.depth.blocks[0].solver.evals_per_step
                if cfg.depth == "ode" else cfg.num_layers)
    eager = Decoder(model)
    decode(eager, prompts[:1], 8)  # warm-up
    plain, _, _ = decode(eager, prompts, n)
    # an untrained model's greedy text is degenerate (a few tokens repeated), which any draft
    # predicts: recorded, so that its rows read as the mechanism's ceiling, not a model's
    distinct = len({t for out in plain for t in out})
    rows, checks = [], {}
    for mode in modes:
        # one decoder per mode, kept: compiled graphs are made once (warm-up below), not
        # timed in the rows; a pipelined draft's process is forked once per draft and kept
        # by the decoder (warm-up below)
        decoder = Decoder(model, compile=True) if mode == "compiled" else eager
        piped = mode == "pipelined"
        if piped:  # a fixed k, every draft made ahead: no auto, no confidence
            tokens = [k for k in tokens if k != "auto"]
            confidences = (None,)
            for s_, n_ in drafts:
                for k in tokens:
                    for seed in (None, 0):
                        decode(decoder, prompts[:1], min(n, 24), _draft(s_, n_, k, None, True),
                               seed)
        if mode == "compiled":
            for draft in [None] + [_draft(s, n_, k, c) for s, n_ in drafts for k in tokens
                                   for c in confidences]:
                for seed in (None, 0):
                    decode(decoder, prompts[:1], min(n, 24), draft, seed)
        # the field's share of the time, eager only (hooks would break a compiled graph);
        # timing each evaluation costs about a microsecond against tens to hundreds
        clock = FieldClock(model) if mode == "eager" else None  # (the drafter's process
        # is not seen from here: pipelined rows report no share)
        try:
            for sampled in (False, True):
                seed = 0 if sampled else None
                for solver, steps, k, c in ((s_, n_, k, c) for s_, n_ in drafts
                                            for k in tokens for c in confidences):
                    plain, plain_tps, p = decode(decoder, prompts, n, seed=seed,
                                                 clock=clock)
                    out, tps, s = decode(decoder, prompts, n,
                                         _draft(solver, steps, k, c, piped),
                                         seed=seed, clock=clock)
                    rows.append(_row(mode, sampled, solver, steps, k, s, full_nfe, tps,
                                     plain_tps, out, plain))
                    if c is not None:
                        rows[-1]["confidence"] = c
                    rows[-1]["drafted_by"] = s["drafted_by"]
                    rows[-1]["verified_by"] = s["verified_by"]
                    rows[-1]["plain_by"] = decoder.decoded_by
                    if clock is not None:
                        rows[-1]["outside_field"] = s["outside_field"]
                        rows[-1]["plain_outside_field"] = p["outside_field"]
                    print(rows[-1], flush=True)
        finally:
            if clock is not None:
                clock.remove()
        if mode == "compiled" and decoder.compile_refused:
            raise SystemExit(f"torch.compile refused: {decoder.compile_refused}")
        for sampled in (False, True) if confirm else ():
            picked = max((r for r in rows if r["mode"] == mode
                          and r["decoding"] == ("sampled" if sampled else "greedy")),
                         key=lambda r: r["tok_s"])
            checks[f"{mode} {picked['decoding']}"] = confirmed(decoder, prompts, n, picked,
                                                               sampled, confirm)
    return rows, distinct, checks


def confirmed(decoder, prompts, n, row: dict, sampled: bool, times: int) -> dict:
    """The draft solve and k of ``row`` (a fastest row, picked among many timed once, whose
    speed-up the pick itself inflates) timed ``times`` more: each time plain decoding and
    speculative decoding one after the other, the ratio of their rates; the median."""
    if row["draft"].startswith("first "):  # "first N layers"
        solver, steps = "layers", int(row["draft"].split()[1])
    else:  # "SOLVER x STEPS"
        solver, steps = row["draft"].split(" x ")
        steps = int(steps)
    seed = 0 if sampled else None
    ratios, passes, others = [], [], []
    piped = row.get("mode", "eager") == "pipelined"  # (records without the field: eager)
    draft = _draft(solver, steps, row["k"], row.get("confidence"), piped)
    # plain decoding through the decoding pass too (Decoder(lean=False)): what plain
    # decoding ran at before the lean step ran the model's own solve, for comparison
    old = (Decoder(decoder.model, lean=False)
           if decoder.lean and not decoder.compile and not piped else None)
    # pipelined: plain decoding at the other thread count too (the drafter takes the second
    # core, the verifier runs on one thread), so the ratio is read against plain decoding's
    # faster count
    threads = torch.get_num_threads()
    other = (2 if threads == 1 else 1) if piped else None
    for _ in range(times):
        _, plain_tps, _ = decode(decoder, prompts, n, seed=seed)
        _, tps, _ = decode(decoder, prompts, n, draft, seed=seed)
        ratios.append(round(tps / plain_tps, 3))
        if old is not None:
            _, pass_tps, _ = decode(old, prompts, n, seed=seed)
            passes.append(round(tps / pass_tps, 3))
        if other is not None:
            torch.set_num_threads(other)
            try:
                _, other_tps, _ = decode(decoder, prompts, n, seed=seed)
            finally:
                torch.set_num_threads(threads)
            others.append(round(tps / other_tps, 3))
    return {"draft": row["draft"], "k": row["k"],
            **({"confidence": row["confidence"]} if row.get("confidence") else {}),
            "speedup": round(statistics.median(ratios), 2), "ratios": ratios,
            **({"plain_by": decoder.decoded_by,
                "against_pass": round(statistics.median(passes), 2),
                "against_pass_ratios": passes} if passes else {}),
            **({"plain_threads": threads, "other_threads": other,
                "against_other_threads": round(statistics.median(others), 2),
                "against_other_threads_ratios": others} if others else {})}


def pass_costs(model, prompt, drafts, ks=(2, 4, 8), reps=5, inner=20) -> dict:
    """Milliseconds of one cached eager forward pass (embedding to logits) at batch 1 after
    ``prompt``, the fastest of ``reps`` means over ``inner`` passes: one token through the
    model's own solve ("plain"), one token through each draft ("draft", by the rows' names;
    by the lean step where speculative decoding drafts with it: "draft_by"), and k + 1 tokens
    through the own solve, the verification of k drafts ("verify", by k); the own solve (plain
    and verify) by the lean step where decoding runs it so ("own_by"). What a round costs
    before its bookkeeping: k drafts and one verification. A discrete stack's verification is
    timed as a whole pass over the k + 1 tokens; with layer drafts reusing their caches,
    decoding resumes it from the drafts' first layers, which costs somewhat less."""
    from continuumlm.decoding.lean import own_step
    from continuumlm.decoding.speculative import FirstLayers

    lean = None  # the own solve's lean step, made in inference mode below where it applies

    def timed_own(ids: torch.Tensor) -> float:
        """The own solve over ``ids`` as decoding runs it: the lean step where it covers
        the model (Decoder(lean=True)), else the decoding pass."""
        if lean is None:
            return timed(ids)
        lean.crop(0)
        lean.logits(prompt[0].tolist())
        pos, best, tokens = lean.pos, float("inf"), ids[0].tolist()
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                lean.logits(tokens, every=True)
                lean.crop(pos)
            best = min(best, (time.perf_counter() - t0) / inner)
        return round(1e3 * best, 4)

    def timed(ids: torch.Tensor) -> float:
        state = model.init_state(1, rewind=max(ks) + 2)
        model.hidden_states(prompt, state)
        pos, best = state.pos, float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(inner):
                model.lm_head(model.hidden_states(ids, state))
                state.crop(pos)
            best = min(best, (time.perf_counter() - t0) / inner)
        return round(1e3 * best, 4)

    one = prompt[:, -1:]
    out = {"plain_ms": None, "draft_ms": {}, "verify_ms": {}}
    with torch.inference_mode():
        lean = own_step(model, prompt, True)[0]  # ODE blocks or a discrete stack
        out["own_by"] = "lean step" if lean is not None else "decoding pass"
        timed_own(one)  # warm-up
        out["plain_ms"] = timed_own(one)
        for k in ks:
            out["verify_ms"][str(k)] = timed_own(prompt[:, -1:].repeat(1, k + 1))
        cfg = model.config
        for solver, steps in drafts:
            name = f"first {steps} layers" if solver == "layers" else f"{solver} x {steps}"
            if solver == "layers" and isinstance(lean, LeanStack):
                # what speculative decoding drafts with here: the stack's lean step
                ms = layers_ms(LeanStack(model), prompt, steps, reps, inner)
                out.setdefault("draft_by", {})[name] = "lean step"
            elif solver == "layers":
                with FirstLayers(model, steps).drafting():
                    ms = timed(one)
            elif refusal(model, _Solves(model, solver, steps).draft[1]) is None:
                # what speculative decoding drafts with here: the lean step
                ms = lean_ms(model, prompt, _Solves(model, solver, steps), reps, inner)
                out.setdefault("draft_by", {})[name] = "lean step"
            else:
                own = (cfg.ode_solver, cfg.ode_steps)
                model.set_solver(solver, steps)
                try:
                    ms = timed(one)
                finally:
                    model.set_solver(*own)
            out["draft_ms"][name] = ms
    return out


def lean_ms(model, prompt, solves, reps: int, inner: int) -> float:
    """Milliseconds of one drafted token by the lean step (decoding/lean_draft.py) after
    ``prompt``, the fastest of ``reps`` means over ``inner``."""
    lean = LeanDraft(model, solves.draft[1])
    return _token_ms(lean, prompt, lambda t: lean.logits([t]), reps, inner)


def layers_ms(lean, prompt, layers: int, reps: int, inner: int) -> float:
    """The same for a token drafted through a discrete stack's first ``layers`` layers by its
    lean step (decoding/lean_stack.py)."""
    return _token_ms(lean, prompt, lambda t: lean.draft(t, layers), reps, inner)


def _token_ms(lean, prompt, step, reps: int, inner: int) -> float:
    """Milliseconds of ``step(token)`` on ``lean`` (a lean step) after ``prompt``, cut back
    after each: the fastest of ``reps`` means over ``inner``."""
    lean.logits(prompt[0].tolist())
    at, best = lean.pos, float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            step(int(prompt[0, -1]))
            lean.crop(at)
        best = min(best, (time.perf_counter() - t0) / inner)
    return round(1e3 * best, 4)


def _draft(solver: str, steps: int, k, confidence: float | None = None,
           pipeline: bool = False) -> Draft:
    """A coarse solve's draft, or ("layers", n): a discrete stack's first n layers; with
    ``confidence``, a round stops drafting below it (Draft.confidence); ``pipeline``: made
    ahead by a drafting process of its own (Draft.pipeline)."""
    return (Draft(tokens=k, layers=steps, confidence=confidence, pipeline=pipeline)
            if solver == "layers"
            else Draft(solver, steps, k, confidence=confidence, pipeline=pipeline))


def _row(mode, sampled, solver, steps, k, s, full_nfe, tps, plain_tps, out, plain) -> dict:
    return {"mode": mode, "decoding": "sampled" if sampled else "greedy",
                             "draft": (f"first {steps} layers" if solver == "layers"
                                       else f"{solver} x {steps}"), "k": k,
                             "acceptance": round(s["accepted"] / max(s["drafted"], 1), 3),
                             "tokens_per_verification": round(s["tokens"] / s["rounds"], 2),
                             "nfe_per_token": round(s["nfe"] / s["tokens"], 1),
                             "plain_nfe_per_token": full_nfe,
                             "tok_s": round(tps, 1), "plain_tok_s": round(plain_tps, 1),
                             "speedup": round(tps / plain_tps, 2),
                             "same_tokens": (out == plain) if not sampled else None}


COLUMNS = [("mode", "mode"), ("decoding", "decoding"), ("draft", "draft solve"), ("k", "k"),
           ("acceptance", "drafts kept"), ("tokens_per_verification", "tokens per verification"),
           ("nfe_per_token", "field evaluations per token"),
           ("plain_nfe_per_token", "... plain"), ("tok_s", "tokens/s"),
           ("plain_tok_s", "plain tokens/s"), ("speedup", "speed-up"),
           ("same_tokens", "same tokens (greedy)"),
           ("outside_field", "time outside the field"),
           ("plain_outside_field", "... plain")]


def columns(rows: list[dict]) -> list[tuple[str, str]]:
    """COLUMNS, with the confidence a round stops drafting below where a row has one."""
    if not any(r.get("confidence") for r in rows):
        return COLUMNS
    at = [c[0] for c in COLUMNS].index("k") + 1
    return COLUMNS[:at] + [("confidence", "stops below")] + COLUMNS[at:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="+", metavar="DIR",
                    help="trained run folders (each its best checkpoint); default: the "
                         "decoding benchmark's untrained model")
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--drafts", default=",".join(f"{s}x{n}" for s, n in DRAFTS),
                    help="draft solves, e.g. eulerx1,eulerx2; a discrete model's first-N-"
                         "layers drafts as layersxN (default for a discrete model: every "
                         "N below its depth)")
    ap.add_argument("--mode", default="eager", choices=("eager", "compiled", "pipelined"),
                    help="eager (writes speculative.json), compiled (generate(compile=True): "
                         "drafts and verification through compiled frozen steps; writes "
                         "speculative_compiled.json), against plain cached decoding of the "
                         "same mode, or pipelined (Draft(pipeline=True): eager, the drafts "
                         "made ahead by a drafting process on the second core; writes "
                         "speculative_pipelined.json), against plain eager decoding")
    ap.add_argument("--threads", type=int, metavar="N",
                    help="torch's intra-op threads for the run (default: torch's own, one "
                         "per core); the record's machine line says which")
    ap.add_argument("--onednn", default="on", choices=CHOICES,
                    help="torch's oneDNN CPU kernels for the run: on (torch's default), off, "
                         "or auto (as `continuumlm generate` sets it: off for a float32 model "
                         "on the CPU); plain and drafted decoding alike")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="drafted tokens per verification, the most per round (numbers, or "
                         "auto), e.g. 4,8,16")
    ap.add_argument("--confidence", default="none",
                    help="confidences below which a round stops drafting (Draft.confidence), "
                         "e.g. none,0.1: each k is timed with each")
    ap.add_argument("--confirm", type=int, default=0, metavar="N",
                    help="time each mode and decoding's fastest row N more times against "
                         "plain decoding beside it, and record the median ratio (picking the "
                         "fastest of many rows timed once inflates its speed-up)")
    ap.add_argument("--out", help="the record's name in bench/results/ (default: speculative, "
                                  "or speculative_compiled with --mode compiled)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [args.mode]
    drafts = [(d.split("x")[0], int(d.split("x")[1])) for d in args.drafts.split(",")]
    tokens = [k if k == "auto" else int(k) for k in args.tokens.split(",")]
    confidences = [None if c == "none" else float(c) for c in args.confidence.split(",")]
    models = []
    for run in args.runs or [None]:
        if run:
            model, prompts = trained(run, args.prompts, args.prompt_len)
            name, what = Path(run).name, f"the best checkpoint of {run}"
        else:
            model = benchmark_model()
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, 65, (1, args.prompt_len), generator=g)
                       for _ in range(args.prompts)]
            name = "untrained"
            what = ("the decoding benchmark's model (4 ODE blocks of RK4 x 4, d 128, softmax, "
                    "RoPE) with its random initial weights")
        cfg = model.config
        n = args.new_tokens
        if cfg.position == "learned":
            n = min(n, cfg.max_seq_len - args.prompt_len + 1)
        wanted = drafts
        if cfg.depth != "ode":
            wanted = ([d for d in drafts if d[0] == "layers"] if args.drafts != ap.get_default(
                "drafts") else [("layers", i) for i in range(1, cfg.num_layers)])
            if not wanted:
                raise SystemExit(f"{run}: a discrete model drafts with its first layers; "
                                 f"give --drafts layersxN")
        with decoding_kernels(model, args.onednn, compiled=args.mode == "compiled") as kernels:
            rows, distinct, checks = measure(model, prompts, n, wanted, modes, args.confirm,
                                             tokens, confidences)
            costs = (pass_costs(model, prompts[0], wanted,
                                ks=tuple(k for k in tokens if k != "auto") or (2, 4, 8))
                     if "eager" in modes else None)
        nfe = rows[0]["plain_nfe_per_token"]
        models.append({
            "name": name, "model": cfg.to_dict(), "distinct_new_tokens": distinct,
            "setup": (f"{what}, " + (f"{cfg.ode_solver} x {cfg.ode_steps}" if cfg.depth == "ode"
                                     else f"{cfg.num_layers} discrete layers")
                      + f" ({nfe} field evaluations per token); {len(prompts)} prompt(s) of {args.prompt_len} tokens, {n} "
                      f"new tokens each ({distinct} distinct in the plain greedy output); "
                      f"{kernels}"),
            "best": {f"{m} {d}": max((r for r in rows if r["decoding"] == d
                                      and r["mode"] == m), key=lambda r: r["speedup"])
                     for m in modes for d in ("greedy", "sampled")},
            "rows": rows, "table": markdown_table(rows, columns(rows)),
            **({"confirmed": checks} if checks else {}),
            **({"pass_costs": costs} if costs else {})})
    best = [{"model": m["name"], **row} for m in models for row in m["best"].values()]
    table = markdown_table(best, [("model", "model")] + columns(best))
    command = "python bench/speculative.py"
    if args.runs:
        command += " --runs " + " ".join(args.runs)
    for flag, value, default in (("--prompts", args.prompts, 1),
                                 ("--prompt-len", args.prompt_len, 64),
                                 ("--new-tokens", args.new_tokens, 512),
                                 ("--drafts", args.drafts, ap.get_default("drafts")),
                                 ("--tokens", args.tokens, ap.get_default("tokens")),
                                 ("--confidence", args.confidence, "none"),
                                 ("--mode", args.mode, "eager"),
                                 ("--threads", args.threads, None),
                                 ("--onednn", args.onednn, "on"),
                                 ("--confirm", args.confirm, 0),
                                 ("--out", args.out, None)):
        if value != default:
            command += f" {flag} {value}"
    out = args.out or ("speculative" if args.mode == "eager" else f"speculative_{args.mode}")
    write_json(out, {
        "command": command,
        "setup": (f"batch 1, {' and '.join(modes)}; greedy, and sampled at temperature 0.8, top-k 40; each "
                  "row's tokens/s over every prompt, plain cached decoding timed beside it; "
                  f"the best row per model and decoding (every row below); {machine()}"),
        "target_speedup": TARGET, "models": models, "best": best, "table": table,
        "load_average": [round(x, 2) for x in os.getloadavg()[:2]]})
    print(table)


if __name__ == "__main__":
    main()
