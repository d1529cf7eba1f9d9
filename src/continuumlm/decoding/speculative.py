"""Self-speculative decoding through depth: the model's own weights integrated with a coarser
solve draft a few tokens, the model's own solve verifies them in one pass, and both decoding
states are cut back to what was kept.

    model.generate(idx, 200, greedy=True, draft=Draft("euler", 1, tokens=4))

A round, batch 1: the draft state (the draft solve, caches of its own) catches up with the
tokens the model's state holds and the pending token, then proposes ``k`` tokens one at a
time; the model's state consumes the pending token and the ``k`` drafts in one ``k + 1``-token
pass (an extension of its caches, as a prompt's), whose logits give the model's own
distribution after each; some prefix of the drafts is kept, plus one token of the model's
after it, and both states are cut back (``DecodeState.crop``) to what was kept.

Greedy: a draft is kept while it equals the model's greedy token, and the token after the
kept drafts is the model's greedy token there. Every kept token is the model's own greedy
choice after the kept tokens before it, so the tokens are those of plain greedy decoding (up
to logits that tie within float rounding, which a pass over ``k + 1`` tokens may sum in
another order than ``k + 1`` one-token steps).

Sampling (temperature, top-k, top-p): speculative sampling (Leviathan et al. 2023, Chen et al.
2023) on the processed distributions (:func:`.sampling.probabilities` of the draft's and the
model's logits, q and p). Draft i is drawn from q_i and kept with probability min(1, p_i(x) /
q_i(x)); at the first draft refused, the token there is drawn from max(0, p_i - q_i)
normalized, and the round ends; when every draft is kept, one more token is drawn from
p_{k+1}. Each token is then distributed as the model's own sampling would draw it (the
acceptance and the residual together give exactly p_i), whatever the draft. Random draws, in
order, from the one ``generator``: the k drafts, then per verified draft one uniform and, at a
refusal, one residual draw, or the last token's draw.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..model.cache import DecodeState
from .draft import AUTO, MAX_AUTO_TOKENS, Draft, DraftStats
from .lean import own_step
from .lean_draft import LeanDraft, refusal
from .lean_stack import LeanStack
from .sampling import draw, probabilities


def _swap_child(parent: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
    """``parent.name = child`` for a name that already holds a submodule: the registry entry
    replaced directly. nn.Module.__setattr__ does the same after type checks that cost about
    10 us, paid twice per drafting round and block; at batch 1 a drafted token costs about
    200 us."""
    assert name in parent._modules
    parent._modules[name] = child


class _Solves:
    """The model's blocks integrated with its own solve or the draft's, switched by swapping
    each block's solver and config (both built once; ``set_solver`` checks the draft's)."""

    def __init__(self, model, solver: str, steps: int):
        self.model = model
        self.full = self._now()
        try:
            model.set_solver(solver, steps)
            self.draft = self._now()
        finally:
            self._put(self.full)
        if not getattr(self.draft[1][0][0], "fixed_grid", True):
            raise ValueError(f"draft solver {solver!r} is adaptive: a draft needs a fixed-grid "
                             f"solver (euler, midpoint, rk4, ...).")

    def _now(self):
        m = self.model
        return (m.config, [(b.solver, b.cfg) for b in m.depth.blocks], m.depth.exact_cache)

    def _put(self, solve) -> None:
        config, blocks, exact = solve
        for b, (solver, cfg) in zip(self.model.depth.blocks, blocks):
            _swap_child(b, "solver", solver)
            b.cfg = cfg
        self.model.config, self.model.depth.exact_cache = config, exact

    @contextlib.contextmanager
    def drafting(self):
        self._put(self.draft)
        try:
            yield
        finally:
            self._put(self.full)


class _Tap(torch.nn.Module):
    """A layer that keeps each output it makes (``outputs``): the last draft layer's, from
    which a verifying pass goes on (:class:`FirstLayers` with ``tap``)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        self.mixer = layer.mixer  # DiscreteStack asks a layer's mixer for its cache type
        self.outputs: list[torch.Tensor] = []

    def forward(self, x, cache=None, padding=None):
        out = self.layer(x, cache, padding)
        self.outputs.append(out)
        return out


class FirstLayers:
    """A discrete stack drafting with its first ``n`` layers: the stack's layer list swapped
    for its first ``n`` while drafting (the draft state holds caches of those alone). With
    ``tap``, the last of them keeps its outputs (``tapped``)."""

    def __init__(self, model, n: int, tap: bool = False):
        self.depth = model.depth
        self.full = model.depth.layers
        self.n = n
        first = list(self.full)[:n]
        self.tap = _Tap(first[-1]) if tap else None
        if self.tap is not None:
            first[-1] = self.tap
        self.draft = torch.nn.ModuleList(first)

    @property
    def tapped(self) -> list[torch.Tensor]:
        return self.tap.outputs

    @contextlib.contextmanager
    def drafting(self):
        _swap_child(self.depth, "layers", self.draft)
        try:
            yield
        finally:
            _swap_child(self.depth, "layers", self.full)


def check_draft(model, draft: Draft, idx: torch.Tensor) -> None:
    """Refuse, by name, what self-speculative decoding does not do."""
    cfg = model.config
    if cfg.depth != "ode":
        if not hasattr(model.depth, "layers"):
            raise ValueError(f"draft=: the {cfg.depth} depth has neither a solve to integrate "
                             f"more coarsely nor a list of layers to draft with the first of.")
        if draft.layers is None or not draft.layers < len(model.depth.layers):
            raise ValueError(f"draft=: a discrete model has no solve to integrate more "
                             f"coarsely; draft with its first layers: Draft(layers=N) "
                             f"(--draft-layers N) with N from 1 to "
                             f"{len(model.depth.layers) - 1}, got {draft.layers}.")
    elif draft.layers is not None:
        raise ValueError("draft=: an ODE model drafts with a coarser solve of its blocks "
                         "(Draft(solver, steps); --draft-solver, --draft-steps), not with "
                         "fewer layers: drop layers= (--draft-layers).")
    if not getattr(model.depth, "exact_cache", True):
        raise ValueError(f"draft=: the model's own solver ({cfg.ode_solver}) is adaptive and "
                         f"decodes by recomputing; self-speculative decoding verifies through "
                         f"the cache and needs a fixed-grid solver.")
    if getattr(model.depth, "exit", None) is not None or \
            getattr(model.depth, "ladder", None) is not None:
        raise ValueError("draft=: per-token exit decides each token's depth on the fly; call "
                         "model.set_exit(None) to draft.")
    if idx.shape[0] != 1:
        raise ValueError(f"draft=: one sequence at a time (batch 1; got {idx.shape[0]}): rows "
                         f"keep different numbers of drafts, which this version does not pad.")


class SpeculativeStream:
    """The tokens of :func:`speculative_tokens` as an iterator, with its :class:`DraftStats`
    (``stats``) for the caller to report."""

    def __init__(self, tokens: Iterator[torch.Tensor], stats: DraftStats):
        self._tokens, self.stats = tokens, stats

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._tokens)

    def close(self) -> None:
        """Stop early: what the stream holds is let go now (a pipelined drafter stops and
        is kept for the decoder's next stream) rather than when the stream is collected."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy, or drawn from the processed distribution."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: torch.Tensor) -> int:
        return int(draw(probs, self.generator))

    def uniform(self, device) -> float:
        return float(torch.rand((), generator=self.generator, device=device))


def verify(drafts: list[int], q: list[torch.Tensor] | None, logits: torch.Tensor,
           how: Sampling, bonus: bool = True) -> tuple[int, int | None]:
    """(drafts kept, the token after them) for ``drafts`` drawn from the distributions ``q``
    (None when greedy), against the model's ``logits`` (k + 1, V) after the pending token and
    each draft (see the module's text). ``bonus`` False: the logits may stop at the last
    draft's position, (k, V), and when every draft is kept the token after them is None (not
    chosen: a pipelined drafter may have a draft for it, pipeline.py)."""
    if how.greedy:
        own = logits.argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == own[n]:
            n += 1
        return n, (own[n] if n < len(own) and (bonus or n < len(drafts)) else None)
    device = logits.device
    ps = how.probs(logits)  # every position's at once (row by row, as one at a time)
    for i, x in enumerate(drafts):
        p = ps[i]
        # accept with probability min(1, p(x) / q(x)): u < p / q, as u * q < p (q(x) > 0:
        # x was drawn from q)
        if how.uniform(device) * float(q[i][x]) < float(p[x]):
            continue
        residual = (p - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q where both live: the refusal had no mass
            residual = p
        return i, how.draw(residual / residual.sum())
    return len(drafts), how.draw(ps[len(drafts)]) if bonus else None


@torch.inference_mode()
def speculative_tokens(model, idx: torch.Tensor, max_new_tokens: int, draft: Draft,
                       eos_token_id: int | None, stats: DraftStats,
                       how: Sampling = Sampling(),
                       freeze: Callable[[DecodeState], Callable] | None = None,
                       freeze_block: Callable[[DecodeState], Callable] | None = None,
                       lean_own: bool = True) -> Iterator[torch.Tensor]:
    """Yield the next token (1,) at a time, as plain decoding with ``how`` would (see the
    module's text); ``stats`` is filled as it goes. The model is in eval mode (the caller's
    stream sees to it).

    ``freeze`` (as :func:`.stream.token_stream`'s: ``freeze(state) -> fn(ids, state) ->
    logits``): the draft's tokens go through the frozen one-token step it returns for the
    draft state (compiled units, recorded graphs), made after the draft's first pass over
    the prompt; a round's cut-back moves that state back in place. ``freeze_block`` (the
    same for :func:`.frozen.frozen_block_decoder`): the verifying pass of ``k + 1`` tokens
    goes through the frozen step over a block, the model's state frozen after the prompt.
    ``lean_own`` (eager): the model's own solve (the prompt, each verification) runs as
    the lean step of that solve where it covers the model (lean.own_step: ODE blocks,
    or a discrete stack, whose first layers then draft through it too), with caches of its
    own (``stats.verified_by`` says which, and why not). Pipelined drafts (``draft.pipeline``) are
    :func:`.pipeline.pipelined_tokens`'s."""
    if draft.pipeline:
        raise ValueError("Draft(pipeline=True): pipelined drafts run through "
                         "decoding.pipeline.pipelined_tokens (Decoder.stream picks it).")
    # LayerSkip's cache reuse (Draft.reuse): eager only, a frozen step keeps caches of its own
    reuse = (draft.layers is not None and draft.reuse and freeze is None
             and freeze_block is None)
    solves = (FirstLayers(model, draft.layers, tap=reuse) if draft.layers is not None
              else _Solves(model, draft.solver, draft.steps))
    k = 4 if draft.tokens == AUTO else draft.tokens
    if max_new_tokens == 0:  # nothing to decode (the first token would come from the prompt)
        return
    start = time.perf_counter()
    window = (MAX_AUTO_TOKENS if draft.tokens == AUTO else k) + 2
    main = model.init_state(1, rewind=window)
    side = model.init_state(1, rewind=window)
    limit = model.config.max_seq_len if model.config.position == "learned" else None
    device = idx.device

    # the draft's frozen one-token step, once its state is frozen, and its field evaluations
    # (those of the draft's eager pass before it: a replayed step runs no Python to count them)
    frozen_step, frozen_nfe = None, 0

    verify_step, verify_nfe = None, 0  # the same for the model's state and its solve

    lean = None  # the draft solve's lean step (lean_draft.py), with caches of its own
    # the own solve's lean step, with caches of its own (then main holds none), or None
    verifier, stats.verified_by = own_step(model, idx, lean_own, freeze_block is not None)
    # a discrete stack's lean step drafts through its first layers too, in its own caches
    # (the verifier's: LayerSkip's reuse), when the drafts reuse them
    stacked = reuse and draft.lean and isinstance(verifier, LeanStack)
    if reuse and not draft.lean and verifier is not None:
        # the decoding pass's drafts share the model state's caches, which it then fills
        verifier, stats.verified_by = None, ("decoding pass (Draft(lean=False): the drafts "
                                             "share its caches)")
    if draft.layers is not None:
        stats.drafted_by = "first layers" + (", lean step" if stacked else "")
    else:
        why = ("Draft(lean=False)" if not draft.lean else
               "compiled or recorded drafts" if freeze is not None else
               refusal(model, solves.draft[1]))
        if why is None:
            lean = LeanDraft(model, solves.draft[1])
        stats.drafted_by = "lean step" if lean is not None else f"decoding pass ({why})"

    def logits(ids: list[int], state) -> torch.Tensor:
        if state is main and verifier is not None:
            out = verifier.logits(ids, every=True)
            stats.nfe += verifier.nfe
            return out
        if state is side and stacked:
            rows = [verifier.draft(t, draft.layers) for t in ids]
            stats.nfe += draft.layers * len(ids)
            return rows[0][None] if len(rows) == 1 else torch.stack(rows)
        if state is side and lean is not None:
            out = lean.logits(ids)
            stats.nfe += lean.nfe
            return out[None]
        if state is main and verify_step is not None:
            out = verify_step(torch.tensor([ids], device=device), main)[0]
            main.advance()
            stats.nfe += verify_nfe
            return out
        if state is side and frozen_step is not None:
            rows = []
            for t in ids:
                rows.append(frozen_step(torch.tensor([[t]], device=device), side)[0])
                side.advance()
                stats.nfe += frozen_nfe
            return torch.stack(rows)
        out = model.lm_head(model.hidden_states(torch.tensor([ids], device=device), state))
        stats.nfe += model.last_nfe
        return out[0]

    def resume(last_draft: int) -> torch.Tensor:
        """The model's logits after the pending token and each draft, (k + 1, V), from the
        draft's states: the last draft through the first layers (the others went through
        them while drafting), then the later layers over every one of them."""
        if stacked:
            out = verifier.resume(last_draft, draft.layers)
            stats.nfe += verifier.nfe  # the last draft's first layers, everyone's later ones
            return out
        with solves.drafting():
            model.hidden_states(torch.tensor([[last_draft]], device=device), side)
        stats.nfe += model.last_nfe
        h = torch.cat(solves.tapped, dim=1)
        solves.tapped.clear()
        out = model.lm_head(model.norm_f(model.depth.resume(h, main, draft.layers)))
        main.pos += h.shape[1]
        stats.nfe += model.depth.last_nfe
        return out[0]

    def choose(row: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if how.greedy:
            return int(row.argmax()), None
        q = how.probs(row)
        return how.draw(q), q

    seq = idx[0].tolist()  # every token so far: the prompt and what was yielded
    last = choose(logits(seq, main)[-1])[0]  # the latest token, which no state holds yet
    if freeze_block is not None and max_new_tokens > 1:
        verify_step, verify_nfe = freeze_block(main), model.last_nfe
        why = main.frozen_crop_refusal()  # before any token: the draft's caches are alike
        if why is not None:
            raise ValueError(f"draft= with compile or CUDA graphs: {why}.")
    if reuse and not stacked:
        # the draft state holds the model state's caches of the first layers: what the
        # drafts write there is what the verifier reads, and both states move together
        side.share(main, [("layer", i) for i in range(draft.layers)])
    seq.append(last)
    made = 1
    stats.tokens = made
    yield torch.tensor([last], device=device)
    while made < max_new_tokens and last != eos_token_id:
        k_now = min(k, max_new_tokens - made - 1)
        if limit is not None:  # learned positions: the verifying pass must fit
            k_now = min(k_now, limit - (verifier or main).pos - 1)
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        if k_now > 0:
            # a lean draft calls none of the model's modules: nothing to swap
            with contextlib.nullcontext() if stacked or lean is not None else solves.drafting():
                # catch up, draft one
                row = logits(seq[(verifier if stacked else lean or side).pos:], side)[-1]
                if freeze is not None and frozen_step is None:
                    # frozen here, at the round's first draft: every later cut keeps at
                    # least this much (a frozen recurrent cache cuts back no further)
                    frozen_step, frozen_nfe = freeze(side), model.last_nfe
                while True:
                    nxt, q = choose(row)
                    drafts.append(nxt)
                    qs.append(q)
                    if len(drafts) == k_now or (
                            draft.confidence is not None and
                            float(torch.softmax(row, -1)[nxt] if q is None else q[nxt])
                            < draft.confidence):
                        break
                    row = logits([nxt], side)[-1]
        before = (verifier or main).pos
        if reuse and drafts:
            own = resume(drafts[-1])
        else:
            own = logits([last, *drafts], main)
        n, after = verify(drafts, None if how.greedy else qs, own, how)
        (verifier or main).crop(before + 1 + n)  # the latest token and the kept drafts
        if reuse:
            side.pos = main.pos  # its caches are the model state's, cut with them
        elif lean is not None:
            lean.crop(before + 1 + n)
        elif side.pos > before + 1 + n:
            side.crop(before + 1 + n)
        stats.rounds += 1
        stats.drafted += len(drafts)
        stats.accepted += n
        stats.kept_per_round.append(n + 1)
        for t in [*drafts[:n], after]:
            seq.append(t)
            made += 1
            last = t
            yield torch.tensor([t], device=device)
            if t == eos_token_id or made >= max_new_tokens:
                break
        if draft.tokens == AUTO and drafts:
            if n == len(drafts):
                k = min(k + 1, MAX_AUTO_TOKENS)
            elif 2 * n < len(drafts):
                k = max(k - 1, 1)
        stats.tokens = made
        stats.seconds = time.perf_counter() - start
    stats.seconds = time.perf_counter() - start
