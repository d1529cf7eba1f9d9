"""The frozen step: a decoding state fixed to buffers of one capacity, its position held in
tensors, so that one token's work reads no Python value that changes between tokens; and the
evaluator that runs its repeating unit compiled.

An *evaluator* is ``evaluate(module, *args) -> module(*args)``: the depth runs every unit
that repeats (an ODE block's solver step, a discrete layer) through the one it is given
(``LanguageModel.frozen_logits(ids, state, evaluate)``). ``None`` runs them directly
(eager); :class:`Compiled` runs them through ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..errors import first_line
from ..model.cache import DecodeState
from .replay import Recorder, TokenGraphs

log = logging.getLogger("continuumlm")

# inductor's options per device type. CPU: a C++ wrapper around the generated kernels instead
# of a Python one. A solver step's graph is a few dozen small kernels and matrix products, and
# the Python wrapper's glue around them (tensor views, allocations and size checks around
# every kernel) is a sizeable share of each call: with the C++ wrapper a 4-block
# RK4 x 4 model decodes 1.24x (softmax) and 1.39x (DeltaNet) the tokens/s
# (bench/decode_speed.py's record). On CUDA, graph replay (TokenGraphs) removes the host's
# share altogether, and the Python wrapper stays.
INDUCTOR_OPTIONS = {"cpu": {"cpp_wrapper": True}}
# one compiled function serves every model, module type and batch size: allow more graphs
# than dynamo's default of 8 before it refuses to compile another (it then raises, under
# fullgraph, and the decoder decodes eagerly)
RECOMPILE_LIMIT = 64


def _call(module, *args):
    return module(*args)


class Compiled:
    """The compiled evaluator for ``device_type``: ``module(*args)`` through one
    ``torch.compile`` of a plain call, so that one compiled function serves every module
    type and batch size (dynamo's guards tell them apart; a frozen state's capacity is
    symbolic). fullgraph: no graph breaks, so a failure to compile happens before any cache
    has moved; it is recorded here (``refused``), warned of once, and this evaluator runs
    modules directly from then on. dynamo keeps compiled graphs with the function's code, so
    a new evaluator reuses what an earlier one compiled."""

    def __init__(self, device_type: str = "cpu", options: dict | None = None) -> None:
        self.device_type = device_type
        self.options = INDUCTOR_OPTIONS.get(device_type) if options is None else options
        self.refused: str | None = None
        self._fn = None

    def __call__(self, module, *args):
        if self.refused is None:
            try:
                if self._fn is None:
                    self._fn = torch.compile(_call, fullgraph=True, options=self.options)
                return self._fn(module, *args)
            except _compile_errors() as e:
                # fullgraph: tracing and compiling end before anything runs, so the caches
                # are untouched and the direct call below makes this evaluation exactly once
                self.refused = f"{type(e).__name__}: {first_line(e)}"
                log.warning("generate(compile=True): torch.compile failed (%s); decoding "
                            "eagerly.", self.refused)
        return module(*args)


@contextlib.contextmanager
def recompile_limit(n: int):
    """Raise dynamo's per-function graph limit to at least ``n`` for one call (a plain
    attribute swap: ~3 us, against milliseconds per token)."""
    cfg = torch._dynamo.config
    # renamed from cache_size_limit in torch 2.7, which keeps the old name as an alias
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    setattr(cfg, name, max(old, n))
    try:
        yield
    finally:
        setattr(cfg, name, old)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises before anything runs: dynamo's errors, and (under
    fullgraph, where it exists) running out of graphs for the function."""
    exc = torch._dynamo.exc
    return tuple(e for e in (exc.TorchDynamoException,
                             getattr(exc, "FailOnRecompileLimitHit", None)) if e is not None)


def capacity_for(n: int, minimum: int = 64) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def _runner(logits, evaluate):
    """``run(ids, state)``: the frozen step ``logits(ids, state[, evaluate])``, its units run
    by ``evaluate`` (None: directly) under the raised recompile limit."""
    def run(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        if evaluate is None:
            return logits(ids, st)
        with recompile_limit(RECOMPILE_LIMIT):
            return logits(ids, st, evaluate)
    return run


def frozen_decoder(model, state: DecodeState, evaluate=None, min_capacity: int = 64,
                   recorder: Recorder | None = None):
    """Freeze ``state`` and return the one-token step ``fn(ids (B, 1), state) -> logits
    (B, vocab)``; the caller moves the state on with ``state.advance()``.

    ``evaluate`` (an evaluator, above; None: eager) runs the unit that repeats: an ODE
    block's solver step (its stage evaluations and the solver's combinations; one field
    evaluation under per-token exit or with a reversible solver), a discrete stack's layer.
    Weights and caches are the compiled graph's inputs, so the same graph serves every step
    of every block; a model compiles one small graph, not one graph holding all of a
    token's evaluations (64 for 4 blocks of RK4 x 4: minutes of compilation on CPU). The
    rest of a token (embedding, head, early-exit decisions) runs eagerly.

    Capacities are powers of two (at least ``min_capacity``) that grow with the sequence:
    the state is frozen at the smallest one that holds the next token and refrozen at twice
    the size when it is full. A frozen attention step reads its whole buffer (the mask
    hides the tail), so a buffer sized to the final length would make every early token pay
    for the last; with doubling, each token reads fewer than twice the positions it needs.
    The capacity is symbolic from the first graph on (``StaticStep``, ``SeqCache.freeze``),
    so growing compiles nothing.

    ``recorder`` (see :mod:`.replay`): the whole token step, compiled units and eager glue
    alike, is recorded once per capacity and replayed for every later token
    (:class:`TokenGraphs`)."""
    device = model.tok_emb.weight.device
    state.freeze(capacity_for(state.pos + 1, min_capacity), device)

    def last(ids, st, *evaluate):  # the one token's logits, (B, vocab)
        return model.frozen_logits(ids, st, *evaluate)[:, -1]

    run = _runner(last, evaluate)

    replay = TokenGraphs(model, recorder, run) if recorder is not None else None

    def step(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        st.check_solve(model.config)  # as hidden_states does, on the host for frozen steps
        if st.pos >= st.static.capacity:
            st.freeze(2 * st.static.capacity, device)
        elif st.static.width != 1:
            st.static.set_width(1)
        return replay(ids, st) if replay is not None else run(ids, st)

    return step


def frozen_block_decoder(model, state: DecodeState, evaluate=None, min_capacity: int = 64,
                         recorder: Recorder | None = None):
    """Freeze ``state`` and return the step over a block of tokens ``fn(ids (B, w), state) ->
    logits (B, w, vocab)``, every token's: speculative decoding's verifying pass, through the
    same compiled units (and recorded graphs) as :func:`frozen_decoder`'s one-token step. The
    static step's width is set to ``w`` for each call (its tensors are kept per width, and
    so is a recorded graph), the buffers refrozen larger when the block does not fit; the
    caller moves the state on with ``state.advance()`` (by ``w``) and may cut it back."""
    device = model.tok_emb.weight.device
    state.freeze(capacity_for(state.pos + 1, min_capacity), device)

    run = _runner(model.frozen_logits, evaluate)

    replays: dict[int, TokenGraphs] = {}

    def step(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        st.check_solve(model.config)
        w = ids.shape[1]
        if st.pos + w > st.static.capacity:
            st.freeze(capacity_for(st.pos + w, 2 * st.static.capacity), device)
        st.static.set_width(w)
        if recorder is None:
            return run(ids, st)
        if w not in replays:
            replays[w] = TokenGraphs(model, recorder, run)
        return replays[w](ids, st)

    return step
