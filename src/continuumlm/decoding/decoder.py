"""The decoder: one model's generation with what it keeps between calls (its evaluator, its
graph recorders, and what either was refused), and the choice of path for each request."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import torch

from ..registry import DECODERS
from ..threads import ThreadPolicy
from .drafter import DrafterPool
from .frozen import Compiled, frozen_block_decoder, frozen_decoder
from .pipeline import pipeline_refusal, pipelined_tokens
from .replay import GraphRecorder, Recorder
from .speculative import (
    Draft,
    DraftStats,
    Sampling,
    SpeculativeStream,
    check_draft,
    speculative_tokens,
)
from .stream import check_request, plain, streaming, token_stream

log = logging.getLogger("continuumlm")


@DECODERS.register("default")
class Decoder:
    """Generates from ``model``: ``Decoder(model, compile=True).generate(idx, 100)``; what
    ``model.generate(...)`` makes for each call. A decoder kept and called again reuses its
    compiled evaluator and its recorders, and remembers what they were refused.

    ``compile`` (with the cache): decode through a compiled unit: after the prompt, the
    state is frozen to fixed-capacity buffers with the position held in tensors, and one
    ``torch.compile`` graph of one solver step (or layer) serves every step of every token
    (:func:`.frozen.frozen_decoder`). ``True`` compiles for the prompt's device type; an
    evaluator (:class:`.frozen.Compiled` with options of one's own) is used as given. A
    compiler failure warns once and this decoder decodes eagerly. Refused with
    ``use_cache=False``; warned of and ignored for an adaptive solver, which decodes by
    recomputing the context.

    ``cuda_graph`` (CUDA, with the cache): decode the frozen state by replaying one recorded
    graph of a whole token step per buffer capacity (:class:`.replay.TokenGraphs`), compiled
    units or eager. ``None`` (the default) does so when ``compile`` is on and the prompt is on
    a CUDA device, unless the model decodes with per-token exit (whose decisions are read on
    the host every step), an adaptive solver or inference-tensor weights; ``True`` asks for
    it (refused, naming why, in those cases and on another device), ``False`` never; a
    :class:`.replay.Recorder` is used as given (tests record through the CPU emulation). If
    CUDA refuses to record the step, the decoder warns once and decodes without replay.

    ``lean`` (eager, with the cache): the model's own solve runs as the lean step
    (:class:`.lean_draft.LeanDraft`: the solve written out op by op, with caches of its own;
    a discrete stack's layers: :class:`.lean_stack.LeanStack`, which also runs its first-layer
    drafts) where it covers the model: batch 1 on the CPU, and the prompt and each
    verification of self-speculative decoding. The same logits up to rounding
    (tests/test_lean_draft.py, tests/test_lean_stack.py) at
    about half the time per token on a small model, whose one-token pass is mostly dispatch
    and Python. ``decoded_by`` says how the last plain stream ran ("lean step", or "decoding
    pass" and why); a speculative stream's ``stats.verified_by`` the same. False: always
    through the decoding pass."""

    def __init__(self, model, compile: bool | Compiled = False,
                 cuda_graph: bool | Recorder | None = None, min_capacity: int = 64,
                 lean: bool = True) -> None:
        self.model = model
        if not isinstance(lean, bool):
            raise ValueError(f"Decoder(lean={lean!r}): give True or False.")
        self.lean = lean
        self.decoded_by: str | None = None
        self.compile = compile
        self.cuda_graph = cuda_graph
        self.min_capacity = min_capacity
        self.evaluator: Compiled | None = compile if isinstance(compile, Compiled) else None
        self.recorders: dict[torch.device, Recorder] = {}
        if cuda_graph not in (None, True, False):
            self.recorders[None] = cuda_graph  # the caller's, for every device
        self._pool = None  # pipelined drafts' processes, kept between streams

    def _drafters(self):
        """This decoder's :class:`.drafter.DrafterPool`, made at its first pipelined stream;
        its processes end with the decoder (or the interpreter: they are daemons)."""
        if self._pool is None:
            self._pool = DrafterPool()
            weakref.finalize(self, self._pool.close)
        return self._pool

    def close(self) -> None:
        """End the drafting processes this decoder keeps (``Draft(pipeline=True)``); a later
        pipelined stream starts new ones."""
        if self._pool is not None:
            self._pool.close()

    @property
    def compile_refused(self) -> str | None:
        return self.evaluator.refused if self.evaluator is not None else None

    @property
    def capture_refused(self) -> str | None:
        return next((r.refused for r in self.recorders.values() if r.refused), None)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
        """(B, T + new) token ids: the prompt followed by the new tokens (fewer than
        ``max_new_tokens`` only when every row produced ``eos_token_id``)."""
        new = list(self.stream(idx, max_new_tokens, **kwargs))
        return torch.cat([idx] + [t[:, None] for t in new], dim=1)

    def stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
               use_cache: bool = True, generator: torch.Generator | None = None,
               eos_token_id: int | None = None,
               threads: ThreadPolicy | int | str | None = None,
               draft: Draft | None = None) -> Iterator[torch.Tensor]:
        """Yield the next token ids (B,) one step at a time. Bad arguments raise here, when
        the stream is made, not at its first token.

        ``draft`` (a :class:`.speculative.Draft`; ODE models, batch 1): self-speculative
        decoding through depth, the same weights integrated with the draft's coarser solve
        proposing tokens that the model's own solve verifies in one pass: greedy, the same
        tokens as without it; sampling, speculative sampling, tokens distributed exactly as
        without it (not the same draws: it uses the generator in its own order). The stream
        then has ``stats`` (a ``DraftStats``: acceptance, field evaluations per token).

        ``threads``: torch's intra-op threads while the stream runs (see
        :mod:`continuumlm.threads`): ``None`` leaves the count as it is, ``"auto"`` takes the
        cores other processes leave idle (looked at again every few seconds), a number that
        many; the count found is put back when the stream ends. A :class:`ThreadPolicy` is
        applied as it is (the command line's, made before the model was loaded)."""
        model = self.model
        check_request(model, idx, max_new_tokens, temperature, top_k, top_p, greedy)
        compiling = bool(self.compile)
        if self.cuda_graph not in (None, False) and not use_cache:
            raise ValueError("cuda_graph=True replays the cached one-token step; it needs the "
                             "cache (use_cache=True; no --no-cache).")
        if compiling and not use_cache:
            raise ValueError("compile=True compiles the cached one-token step, and "
                             "use_cache=False (--no-cache) recomputes the whole context "
                             "instead: drop one of them.")
        if use_cache and getattr(model.depth, "exact_cache", True):
            # a mixer without a decoding cache: refused by name, with the way out (an
            # adaptive solve recomputes anyway, below)
            model.check_cacheable("generation with caches (use_cache=True)")
        if threads is not None and not isinstance(threads, ThreadPolicy):
            threads = ThreadPolicy(threads, "decoding")  # a bad count raises here
        if draft is not None:
            if not use_cache:
                raise ValueError("draft= verifies the drafted tokens through the cache; drop "
                                 "use_cache=False (--no-cache).")
            check_draft(model, draft, idx)
            if draft.pipeline:
                why = ("it runs eagerly through the lean steps: drop compile / cuda_graph, and "
                       "Decoder(lean=False)"
                       if self._freezer(idx.device) is not None or not self.lean
                       else pipeline_refusal(model, draft, idx))
                if why is not None:
                    raise ValueError(f"Draft(pipeline=True) (--draft-pipeline): {why}.")
            stats = DraftStats()
            how = Sampling(greedy, temperature, top_k, top_p, generator)
            return SpeculativeStream(self._speculative(idx, max_new_tokens, draft,
                                                       eos_token_id, stats, threads, how,
                                                       self._freezer(idx.device),
                                                       self._freezer(idx.device, block=True)),
                                     stats)
        exact = getattr(model.depth, "exact_cache", True)
        if use_cache and not exact:
            # asked to compile, told why nothing is: there is no one-token step to compile
            log.log(logging.WARNING if compiling else logging.DEBUG,
                    "generate: %s solves cannot be cached exactly; recomputing the whole "
                    "context for every token%s", model.config.ode_solver,
                    ", eagerly (compile=True compiles the cached one-token step)"
                    if compiling else "")
            use_cache = False
        freeze = self._freezer(idx.device) if use_cache else None
        return token_stream(model, idx, max_new_tokens, temperature, top_k, top_p, greedy,
                            use_cache, generator, eos_token_id, freeze, threads, self.lean,
                            lambda how: setattr(self, "decoded_by", how))

    def _freezer(self, device: torch.device, block: bool = False):
        """``freeze(state) -> the frozen one-token step`` (``block``: the step over a block
        of tokens) for this request (compiled units, recorded graphs, or both), or None to
        decode eagerly."""
        recorder = self._recorder(device)
        if not (self.compile or recorder is not None):
            return None
        evaluate = self._evaluator(device) if self.compile else None
        model, capacity = self.model, self.min_capacity
        make = frozen_block_decoder if block else frozen_decoder

        def freeze(state):
            return make(model, state, evaluate, capacity, recorder)
        return freeze

    def _evaluator(self, device: torch.device) -> Compiled:
        if self.evaluator is None or self.evaluator.device_type != device.type:
            self.evaluator = Compiled(device.type)
        return self.evaluator

    def _recorder(self, device: torch.device) -> Recorder | None:
        """The recorder for this request's device, or None (see the class's text)."""
        if None in self.recorders:
            return self.recorders[None]
        asked = self.cuda_graph
        if asked is False or (asked is None and not self.compile):
            return None
        model = self.model
        why = None
        if device.type != "cuda":
            why = (f"CUDA graphs record CUDA work and the prompt is on {device}; move the "
                   f"model and prompt to a CUDA device, or leave cuda_graph off")
        elif not getattr(model.depth, "exact_cache", True):
            why = (f"an adaptive solver ({model.config.ode_solver}) is decoded by recomputing "
                   f"the context, with no one-token step to record; use a fixed-grid solver")
        elif getattr(model.depth, "exit", None) is not None or \
                getattr(model.depth, "ladder", None) is not None:
            why = ("per-token exit decides on the host at every solver step, which a recorded "
                   "graph cannot; call model.set_exit(None) or leave cuda_graph off")
        elif any(t.is_inference() for t in model.parameters()):
            why = ("the model's weights are inference tensors (made under "
                   "torch.inference_mode), whose changes cannot be told from their version "
                   "counters; load or build the model outside inference mode, or leave "
                   "cuda_graph off")
        if why is not None:
            if asked:
                raise ValueError(f"cuda_graph=True: {why}.")
            log.debug("generate: no CUDA-graph replay (%s)", why)
            return None
        recorder = self.recorders.get(device)
        if recorder is None:
            recorder = self.recorders[device] = GraphRecorder(device)
        elif recorder.refused is not None:  # warned when it happened; again only when asked
            log.log(logging.WARNING if asked else logging.DEBUG,
                    "generate(cuda_graph): not recording; CUDA refused an earlier recording "
                    "by this decoder (%s).", recorder.refused)
            return None
        return recorder

    def _speculative(self, idx, max_new_tokens, draft, eos_token_id, stats, threads, how,
                     freeze, freeze_block):
        with streaming(self.model, threads):
            tokens = (pipelined_tokens(self.model, idx, max_new_tokens, draft, eos_token_id,
                                       stats, how, self._drafters()) if draft.pipeline else
                      speculative_tokens(self.model, idx, max_new_tokens, draft, eos_token_id,
                                         stats, how, freeze, freeze_block, self.lean))
            for t in tokens:
                yield plain(t)

