"""Self-speculative decoding with the drafts made ahead, in a process of their own
(``Draft(pipeline=True)``): drafting runs on one core while the model's own solve verifies on
another (LoopSpec's pipelining of drafting with verification).

In the serial loop (speculative.py) a round drafts k tokens, then verifies them: the verifier
waits for the drafts and the drafter for the verdict. Here a second process (forked, so it
holds the model's weights as they were then) runs the draft's lean step without stopping:
from the latest token the verifier gave it, it drafts token after token, each after its own
last, publishing each into shared memory, up to ``2k + 3`` ahead of what the verifier has
taken. A round takes the drafts it needs, checks them in one pass of the model's own solve
and, when it keeps them all, checks the drafter's next draft too, at the pass's last row (the
position a serial round fills with a token of its own choosing): with the same rule as any
draft (greedy: it is the model's token; sampled: kept with probability min(1, p / q), else the
token is drawn from the residual). Then either

- that draft was kept: what the drafter made after it was drafted from the tokens decoded, so
  its run goes on and the next round takes up to k drafts from there at once; or
- a draft was refused (or none was left to check): the drafter starts again from the token the
  verifier chose, at the position after the kept ones (a new *epoch*: what it made for the old
  one is dropped), and the next round takes ``max(1, k // 4)`` drafts, the first it makes, so
  the verifier waits for a few drafts rather than k (see below for greedy rounds).

Sampled, which drafts a round takes is fixed by the tokens alone, never by timing
(``max(1, k // 4)`` after a start, k in a run, fewer where the stream ends or the learned
positions run out), and a draft is drawn from a generator seeded from the stream's generator
and the epoch (counted from the stream's first): the text is a function of the prompt, the
settings and the seed, speculative sampling's exact distribution, the same draws on every run.
Greedy, a round takes the drafts that are ready (``max(1, k // 4)`` at least, k at most): the
tokens are plain decoding's whatever the drafts, so a round need not wait for all k
(tests/test_pipeline.py: greedy against plain decoding; sampled against the distribution
enumerated exactly, and run against run). The drafter is told a round's outcome before its
tokens go out, so it drafts while the caller reads them.

What it needs: Linux (``fork``), CPU, one sequence, eager decoding through the lean steps
(the draft's and the own solve's: lean_draft.py, lean_stack.py), a fixed number of drafted
tokens per round (``Draft.tokens``, not ``"auto"``), no ``confidence``. Layer drafts make
their own first layers' caches in the drafter (LayerSkip's cache reuse is between two steps
of one process). The verifier runs on one intra-op thread while the stream runs (the drafter
has the other core); the count found is put back at the end. A decoder keeps its drafting
processes between streams (:class:`DrafterPool`) while the model's weights are unchanged.

The drafting process and its shared state are :mod:`.drafter`'s.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator

import torch

from .draft import AUTO, Draft, DraftStats
from .drafter import Choice, DrafterPool, DraftProcess
from .lean import own_step
from .lean_draft import own_solve, refusal
from .lean_stack import stack_refusal
from .speculative import _Solves, verify


def pipeline_refusal(model, draft: Draft, idx: torch.Tensor) -> str | None:
    """Why ``draft`` cannot be pipelined for ``model`` and the prompt ``idx``, in one phrase
    naming the way out; None when it can."""
    if "fork" not in mp.get_all_start_methods():
        return "it forks the drafting process, which this platform cannot (Linux can)"
    if idx.device.type != "cpu":
        return (f"it pipelines over two CPU cores and the prompt is on {idx.device}; decode on "
                f"the CPU, or drop pipeline=True")
    if draft.tokens == AUTO:
        return ("a round takes a fixed number of drafts: give tokens=N (on the command line, "
                "--draft-tokens N)")
    if draft.confidence is not None:
        return ("every draft is made ahead of the verdict, so there is no round to stop: drop "
                "confidence (on the command line, --draft-confidence)")
    if not draft.lean:
        return "both processes run the lean steps: drop lean=False"
    was = model.training
    model.eval()  # as the stream will hold it
    try:
        with torch.inference_mode():
            stack = model.config.depth != "ode"
            why = stack_refusal(model) if stack else refusal(model, own_solve(model))
            if why is not None:
                return f"the model's own solve does not run as the lean step ({why})"
            why = _draft_refusal(model, draft)
    finally:
        model.train(was)
    return None if why is None else f"the draft does not run as the lean step ({why})"


def _draft_refusal(model, draft: Draft) -> str | None:
    if draft.layers is not None:
        return None  # the stack's own lean step, checked above, runs its first layers
    return refusal(model, _Solves(model, draft.solver, draft.steps).draft[1])


# pipelined streams open in this process, and torch's thread count before the first: streams
# may interleave, so the count goes back when the last one ends, not when each does
_threads = [0, 0]


def _hold_threads() -> None:
    if _threads[0] == 0:
        _threads[1] = torch.get_num_threads()
        torch.set_num_threads(1)
    _threads[0] += 1


def _release_threads() -> None:
    _threads[0] -= 1
    if _threads[0] == 0:
        torch.set_num_threads(_threads[1])


@torch.inference_mode()
def pipelined_tokens(model, idx: torch.Tensor, max_new_tokens: int, draft: Draft,
                     eos_token_id: int | None, stats: DraftStats, how,
                     pool: DrafterPool | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token (1,) at a time, as :func:`.speculative.speculative_tokens` does,
    with the drafts made by a drafting process ahead of the verifier (see the module's
    text); ``how``: the stream's :class:`.speculative.Sampling`; ``pool``: where the
    drafting process is kept between streams (a decoder's), else one for this stream."""
    if max_new_tokens == 0:
        return
    start = time.perf_counter()
    verifier, stats.verified_by = own_step(model, idx, True, False)
    if verifier is None:  # checked when the stream was made; the model changed since
        raise ValueError(f"Draft(pipeline=True): the model's own solve does not run as the "
                         f"lean step ({stats.verified_by}).")
    stats.drafted_by = ("first layers, " if draft.layers is not None else "") + \
        "lean step, pipelined (a drafting process of its own; one thread each)"
    k = draft.tokens
    first = max(1, k // 4)  # a round right after a start waits for this many drafts, not k
    limit = model.config.max_seq_len if model.config.position == "learned" else None
    device = idx.device
    # the drafter's seed, from the stream's generator (sampling): the same seed, the same text
    seed = 0 if how.greedy else int(torch.randint(0, 2 ** 62, (), generator=how.generator))
    _hold_threads()  # the verifier's core; the drafter has the other
    proc = None
    try:
        seq = idx[0].tolist()
        row = verifier.logits(seq, every=True)[-1]
        stats.nfe += verifier.nfe
        last = int(row.argmax()) if how.greedy else how.draw(how.probs(row))
        made = stats.tokens = 1
        yield torch.tensor([last], device=device)
        if made >= max_new_tokens or last == eos_token_id:
            return
        seq.append(last)
        proc = pool.acquire(model, draft) if pool is not None else DraftProcess(model, draft)
        proc.begin(seq, Choice(how.greedy, how.temperature, how.top_k, how.top_p, seed),
                   limit)
        used, fresh = 0, True  # drafts taken in this epoch; a round right after a start
        while True:
            base = verifier.pos  # the position of `last`, which the verifier has not seen
            need = min(first if fresh else k, max_new_tokens - made - 1)
            if limit is not None:
                need = min(need, limit - 1 - base)
            if need <= 0:
                drafts, qs = [], []
            elif how.greedy:
                # as many as are ready, up to `need` (a few at least): greedy tokens are plain
                # decoding's whatever the drafts, so the round need not wait for all of them
                drafts, qs = proc.take(used, min(first, need), most=need)
            else:
                drafts, qs = proc.take(used, need)
            rows = verifier.logits([last, *drafts], every=True)
            stats.nfe += verifier.nfe
            n, after = verify(drafts, None if how.greedy else qs, rows, how, bonus=False)
            verifier.crop(base + 1 + n)  # the latest token and the kept drafts
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += n
            going = False  # the drafter's run goes on past this round
            if after is None:  # every draft kept: the token after them is open
                nxt = used + len(drafts)
                if made + n + 1 < max_new_tokens and proc.reaches(nxt):
                    # the drafter's next draft, made from the kept ones, is checked at the
                    # last row as one more draft; kept, the run goes on from it
                    extra, q = proc.take(nxt, 1)
                    m, after = verify(extra, q, rows[len(drafts):], how, bonus=False)
                    stats.drafted += 1
                    if m == 1:
                        after, going = extra[0], True
                        stats.accepted += 1  # not fed to the verifier yet: the next `last`
                if after is None:
                    after = (int(rows[-1].argmax()) if how.greedy
                             else how.draw(how.probs(rows[-1])))
            out = [*drafts[:n], after]
            done = (made + len(out) >= max_new_tokens
                    or (eos_token_id is not None and eos_token_id in out))
            # the drafter is told before the tokens go out: it drafts while the caller reads
            if going:
                used, fresh = used + len(drafts) + 1, False
                proc.keep_from(used)
            elif not done:  # from the verifier's token, at the position after the kept ones
                proc.restart(verifier.pos, after)
                used, fresh = 0, True
            stats.kept_per_round.append(n + 1)
            for t in out:
                made += 1
                last = t
                yield torch.tensor([t], device=device)
                if t == eos_token_id or made >= max_new_tokens:
                    break
            stats.tokens = made
            stats.seconds = time.perf_counter() - start
            if last == eos_token_id or made >= max_new_tokens:
                break
    finally:
        if proc is not None:
            clean = False
            try:
                clean = proc.end()
            finally:
                stats.nfe += proc.evals
                if pool is not None:
                    pool.release(model, draft, proc, clean)
                else:
                    proc.close()
        _release_threads()
        stats.seconds = time.perf_counter() - start
