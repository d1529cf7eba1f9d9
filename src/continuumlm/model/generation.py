"""Generation: next-token selection, the token stream over a decoding state, and the one-token
static step that ``torch.compile`` serves (``LanguageModel.generate(..., compile=True)``).

The functions take the model as their first argument and use its decoding interface
(``init_state``, ``step``, ``hidden_states``, ``lm_head``, the static one-token step), so
generation can change without touching the model's definition.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Iterator

import torch

from ..errors import first_line
from ..nn import tensor_state
from ..threads import ThreadPolicy
from .cache import DecodeState
from .speculative import Draft, DraftStats, SpeculativeStream, check_draft, speculative_tokens

log = logging.getLogger("continuumlm")


# ------------------------------------------------------------------ next-token selection

def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None,
                        greedy: bool = False) -> None:
    """Refuse settings that mean nothing. Greedy decoding ignores the temperature (0 is a
    common way to ask for it), but out-of-range top-k/top-p are refused there too rather than
    passed over without a word."""
    if not greedy and not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {temperature}; use "
                         f"greedy=True (--greedy) for deterministic argmax decoding.")
    if top_k is not None and (isinstance(top_k, bool) or not _whole(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a whole number of tokens, at least 1, got {top_k!r}.")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}.")


def _whole(x) -> bool:
    """An integer of any kind (int, numpy integer, 0-d integer tensor), not a float."""
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


def filter_logits(logits: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the nucleus of mass top_p.

    The nucleus is the smallest set of most probable tokens whose probability reaches top_p
    (a token is kept when the mass of the tokens ranked above it is below top_p).
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, greedy: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    if greedy:
        return logits.argmax(dim=-1)
    # Shift the row maximum to 0 before dividing: a tiny temperature then sends the rest to
    # -inf (sampling becomes argmax) instead of overflowing every logit to inf (NaN probabilities).
    logits = logits.float()
    logits = filter_logits((logits - logits.amax(-1, keepdim=True)) / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ------------------------------------------------------------------ token streams

def generate_stream(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None,
                    greedy: bool = False, use_cache: bool = True,
                    generator: torch.Generator | None = None,
                    eos_token_id: int | None = None,
                    compile: bool = False,
                    cuda_graph: bool | None = None,
                    threads: ThreadPolicy | int | str | None = None,
                    draft: Draft | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) one step at a time.

    ``draft`` (a :class:`~continuumlm.model.speculative.Draft`; ODE models, greedy, batch 1):
    self-speculative decoding through depth, the same weights integrated with the draft's
    coarser solve proposing tokens that the model's own solve verifies in one pass; the same
    tokens as without it. The stream then has ``stats`` (a ``DraftStats``: acceptance, field
    evaluations per token).

    ``threads``: torch's intra-op threads while the stream runs (see
    :mod:`continuumlm.threads`): ``None`` (the default) leaves the count as it is, ``"auto"``
    takes the cores other processes leave idle (looked at again every few seconds), a number
    that many; the count found is put back when the stream ends. A :class:`ThreadPolicy` is
    applied as it is (the command line's, made before the model was loaded).

    ``compile=True`` (with the cache) decodes through a compiled unit: after the prompt, the
    state is frozen to fixed-capacity buffers with the position held in tensors, and one
    ``torch.compile`` graph of one solver step (or layer) serves every step of every token
    (see :func:`static_decoder`; graphs are compiled on first use and kept for later
    generations). A compiler failure warns once and decodes eagerly. It is refused with
    ``use_cache=False``, and warned of and ignored for an adaptive solver, which decodes by
    recomputing the context.

    ``cuda_graph`` (CUDA, with the cache): decode the frozen state by replaying one recorded
    CUDA graph of a whole token step per buffer capacity (:class:`TokenGraphs`), compiled
    units or eager. ``None`` (the default) does so when ``compile`` is on and the prompt is on
    a CUDA device, unless the model decodes with per-token exit (whose decisions are read on
    the host every step), an adaptive solver or inference-tensor weights; ``True`` asks for it
    (refused, naming why, in those cases and on another device), ``False`` never. If CUDA
    refuses to record the step, generation warns and decodes without replay, and no graph is
    recorded again in that process (later generations decode without; one that asks for
    graphs is warned). Bad arguments raise here, when the stream is made, not at its first
    token.
    """
    cfg = model.config
    if cfg.mode != "decoder":
        raise ValueError("generation needs mode = 'decoder'; this model is an encoder.")
    check_sampling_args(temperature, top_k, top_p, greedy)
    if isinstance(max_new_tokens, bool) or not _whole(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}.")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token, shaped (batch, length).")
    if cfg.position == "learned" and idx.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"the prompt has {idx.shape[1]} tokens, more than max_seq_len = {cfg.max_seq_len} "
            f"of this model's learned positions; shorten it to at most {cfg.max_seq_len} "
            f"tokens (its last ones), or use a RoPE model.")
    if cfg.position == "learned" and idx.shape[1] + max_new_tokens - 1 > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({idx.shape[1]} tokens) plus {max_new_tokens} new tokens exceeds "
            f"max_seq_len = {cfg.max_seq_len} of this model's learned positions; ask for at most "
            f"{max(cfg.max_seq_len - idx.shape[1] + 1, 0)} new tokens or use a RoPE model.")
    if cuda_graph and not use_cache:
        raise ValueError("cuda_graph=True replays the cached one-token step; it needs the "
                         "cache (use_cache=True; no --no-cache).")
    if compile and not use_cache:
        raise ValueError("compile=True compiles the cached one-token step, and use_cache=False "
                         "(--no-cache) recomputes the whole context instead: drop one of them.")
    if threads is not None and not isinstance(threads, ThreadPolicy):
        threads = ThreadPolicy(threads, "decoding")  # a bad count raises here
    if draft is not None:
        if not use_cache:
            raise ValueError("draft= verifies the drafted tokens through the cache; drop "
                             "use_cache=False (--no-cache).")
        if compile or cuda_graph:
            raise ValueError("draft= decodes eagerly in this version; drop compile=True / "
                             "cuda_graph=True (--compile, --cuda-graph on).")
        check_draft(model, draft, idx, greedy)
        stats = DraftStats()
        return SpeculativeStream(_speculative(model, idx, max_new_tokens, draft, eos_token_id,
                                              stats, threads), stats)
    graphs = _graph_recorder(model, idx.device, cuda_graph, compile) if use_cache else None
    return _token_stream(model, idx, max_new_tokens, temperature, top_k, top_p, greedy,
                         use_cache, generator, eos_token_id, compile, graphs, threads)


def _graph_recorder(model, device: torch.device, cuda_graph: bool | None,
                    compile: bool) -> GraphRecorder | None:
    """The recorder for ``generate(cuda_graph=...)``, or None (see :func:`generate_stream`)."""
    if cuda_graph is False or (cuda_graph is None and not compile):
        return None
    why = None
    if device.type != "cuda":
        why = (f"CUDA graphs record CUDA work and the prompt is on {device}; move the model "
               f"and prompt to a CUDA device, or leave cuda_graph off")
    elif not getattr(model.depth, "exact_cache", True):
        why = (f"an adaptive solver ({model.config.ode_solver}) is decoded by recomputing the "
               f"context, with no one-token step to record; use a fixed-grid solver")
    elif getattr(model.depth, "exit", None) is not None:
        why = ("per-token exit decides on the host at every solver step, which a recorded "
               "graph cannot; call model.set_exit(None) or leave cuda_graph off")
    elif any(t.is_inference() for t in model.parameters()):
        why = ("the model's weights are inference tensors (made under torch.inference_mode), "
               "whose changes cannot be told from their version counters; load or build the "
               "model outside inference mode, or leave cuda_graph off")
    elif _CAPTURE_FAILED is not None:  # warned when it happened; again only when asked for
        log.log(logging.WARNING if cuda_graph else logging.DEBUG,
                "generate(cuda_graph): not recording; CUDA refused an earlier recording in "
                "this process (%s), after which graphs stay off.", _CAPTURE_FAILED)
        return None
    if why is None:
        return GraphRecorder(device)
    if cuda_graph:
        raise ValueError(f"cuda_graph=True: {why}.")
    log.debug("generate: no CUDA-graph replay (%s)", why)
    return None


# inference mode, not only no_grad: no version counters or view tracking on the dozens of
# small tensors each field evaluation makes (about 15% of an eager decoded token on CPU); the
# caches are the stream's own, and what it yields is made an ordinary tensor (_plain)
@torch.inference_mode()
def _token_stream(model, idx, max_new_tokens, temperature, top_k, top_p, greedy, use_cache,
                  generator, eos_token_id, compile, graphs,
                  threads: ThreadPolicy | None = None) -> Iterator[torch.Tensor]:
    cfg = model.config
    if use_cache and not getattr(model.depth, "exact_cache", True):
        # asked to compile, told why nothing is: there is no one-token step to compile
        log.log(logging.WARNING if compile else logging.DEBUG,
                "generate: %s solves cannot be cached exactly; recomputing the whole context "
                "for every token%s", cfg.ode_solver,
                ", eagerly (compile=True compiles the cached one-token step)" if compile else "")
        use_cache = False
    with _streaming(model, threads):
        seq = idx
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        state = model.init_state(idx.shape[0]) if use_cache else None
        logits = model.step(idx, state)[0] if use_cache else None
        token_fn = None
        if use_cache and (compile or graphs is not None) and max_new_tokens > 1:
            token_fn = static_decoder(model, state, compile, graphs=graphs)
        for i in range(max_new_tokens):
            if not use_cache:
                logits = model.lm_head(model.hidden_states(seq)[:, -1])
            nxt = sample_next(logits, temperature, top_k, top_p, greedy, generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            yield _plain(nxt)
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            if threads is not None:
                threads.poll()
            if token_fn is not None:
                logits = token_fn(nxt[:, None], state)
                state.advance()
            elif use_cache:
                logits = model.step(nxt[:, None], state)[0]
            else:
                seq = torch.cat([seq, nxt[:, None]], dim=1)


def _speculative(model, idx, max_new_tokens, draft, eos_token_id, stats, threads):
    with _streaming(model, threads):
        for t in speculative_tokens(model, idx, max_new_tokens, draft, eos_token_id, stats):
            yield _plain(t)


@contextlib.contextmanager
def _streaming(model, threads: ThreadPolicy | None):
    """A stream's hold on the model: eval mode (streams may interleave: the model leaves it
    only when the last one ends) and the stream's thread count, both put back at its end."""
    if threads is not None:
        threads.apply()
    if model._open_streams == 0:
        model._mode_before_streams = model.training
    model._open_streams += 1
    model.eval()
    try:
        yield
    finally:
        model._open_streams -= 1
        if model._open_streams == 0:
            model.train(model._mode_before_streams)
        if threads is not None:
            threads.restore()


def _plain(t: torch.Tensor) -> torch.Tensor:
    """An ordinary copy of an inference tensor: a caller may change it in place or use it in
    autograd outside inference mode, which an inference tensor refuses."""
    with torch.inference_mode(False):
        return t.clone()


# ------------------------------------------------------------------ the static one-token step

def static_decoder(model, state: DecodeState, compile: bool = True,
                   min_capacity: int = 64, graphs: GraphRecorder | None = None):
    """Freeze ``state`` and return the one-token step ``fn(ids (B, 1), state) -> logits
    (B, vocab)``, whose repeating units run compiled unless ``compile`` is False.

    What is compiled is the unit that repeats, ``module(*args)`` through
    ``DecodeState.evaluate``: an ODE block's solver step (its stage evaluations and the
    solver's combinations; one field evaluation under per-token exit or with a reversible
    solver), a discrete stack's layer. Weights and caches are the graph's inputs, so the same
    graph serves every step of every block; a model compiles one small graph, not one graph
    holding all of a token's evaluations (64 for 4 blocks of RK4 x 4: minutes of compilation
    on CPU). The rest of a token (embedding, head, early-exit decisions) runs eagerly.

    Capacities are powers of two (at least ``min_capacity``) that grow with the sequence:
    the state is frozen at the smallest one that holds the next token and refrozen at twice
    the size when it is full. A frozen attention step reads its whole buffer (the mask
    hides the tail), so a buffer sized to the final length would make every early token pay
    for the last; with doubling, each token reads fewer than twice the positions it needs.
    The capacity is symbolic from the first graph on (``StaticStep``, ``SeqCache.freeze``),
    so growing compiles nothing. A compiler failure warns once and that model decodes
    eagerly from the unit that failed.

    ``graphs`` (a :class:`GraphRecorder`; CUDA): the whole token step, compiled units and
    eager glue alike, is recorded once per capacity and replayed for every later token
    (:class:`TokenGraphs`)."""
    device = model.tok_emb.weight.device
    state.freeze(_capacity_for(state.pos + 1, min_capacity), device)
    if compile and not model._compile_failed:
        state.evaluate = _compiled_call(model, device.type)

    def run(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        if st.evaluate is None:
            return model._static_token_logits(ids, st)
        with _recompile_limit(_RECOMPILE_LIMIT):
            return model._static_token_logits(ids, st)

    replay = TokenGraphs(model, graphs, run) if graphs is not None else None

    def step(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        st.check_solve(model.config)  # as hidden_states does, on the host for static steps
        if st.pos >= st.static.capacity:
            st.freeze(2 * st.static.capacity, device)
        return replay(ids, st) if replay is not None else run(ids, st)

    return step


# ------------------------------------------------------------------ graph replay (CUDA)

class GraphRecorder:
    """Records a function's device work once and replays it (CUDA graphs): ``warmup(fn)``
    runs ``fn`` for real on a side stream, as capture needs before it (lazy library
    initialization, compilation); ``record(fn) -> (replay, out)`` captures ``fn`` without
    running it, and each ``replay()`` then runs its recorded work, leaving the results in
    ``out``'s memory. ``warmups``, ``records`` and ``replays`` count what it did. Everything
    runs on ``device`` (the prompt's), whichever CUDA device is current. Tests use an
    emulation with this interface on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.warmups = self.records = self.replays = 0
        self._stream = None  # the capture stream, made on ``device`` at the first record

    def warmup(self, fn):
        self.warmups += 1
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = fn()
            torch.cuda.current_stream().wait_stream(side)
        return out

    def record(self, fn):
        """(replay, out); or None, after a warning, when CUDA refuses to record ``fn`` (nothing
        of it ran: the caller runs the step itself and records no more). After one refusal
        none is tried again in this process (see ``_CAPTURE_FAILED``): None at once."""
        global _CAPTURE_FAILED
        if _CAPTURE_FAILED is not None:
            return None
        with torch.cuda.device(self.device):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            before = torch.cuda.current_stream()
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a CUDA call another thread makes meanwhile (a data loader's
                # pinned-memory copies) does not spoil this capture
                with torch.cuda.graph(graph, stream=self._stream,
                                      capture_error_mode="thread_local"):
                    out = fn()
            except RuntimeError as e:  # CUDA's errors, torch.AcceleratorError among them
                # an error inside the capture makes ending it fail too, and that error, which
                # only says the capture is invalid, replaces the first: name the first
                cause = e.__context__ if isinstance(e.__context__, Exception) else e
                _CAPTURE_FAILED = f"{type(cause).__name__}: {first_line(cause)}"
                log.warning("generate(cuda_graph): CUDA could not record the token step as a "
                            "graph (%s); decoding without graph replay, and recording no "
                            "more graphs in this process.", _CAPTURE_FAILED)
                return None
            finally:
                # torch.cuda.graph leaves its capture stream current when ending a capture
                # fails (it ends the capture before it restores the stream)
                torch.cuda.set_stream(before)
        self.records += 1

        def replay() -> None:
            self.replays += 1
            graph.replay()
        return replay, out


# why CUDA refused a recording in this process, or None. A failed capture can leave CUDA's
# caching allocator believing the capture still runs (releases without pytorch#180395: a later
# torch.cuda.empty_cache(), which every capture starts with, then fails an internal assert) and
# its memory pool reserved; so after one refusal, graphs stay off
_CAPTURE_FAILED: str | None = None


class TokenGraphs:
    """A frozen state's token step ``run(ids, state)`` replayed from a recorded graph.

    A frozen state keeps every buffer at a fixed address and its position in tensors, and
    the step reads no Python value that changes between tokens (the property the compiled
    unit already needs), so the device work of one token, recorded once, is the work of
    every later token at that capacity. The first token at a capacity runs for real (the
    recorder's warm-up), the next is recorded and replayed, the rest replayed: on CUDA, one
    graph launch per token instead of a kernel launch per operation (hundreds per field
    evaluation's worth of Python and dispatch). A refreeze (new buffers), another batch shape,
    or a weight changed or replaced between tokens (its address or version counter) records
    again. What the step returns is copied out of the graph's memory, which the next replay
    overwrites."""

    def __init__(self, model, recorder: GraphRecorder, run) -> None:
        self.model, self.recorder, self.run = model, recorder, run
        self.recorded = None  # (key, replay, logits in the graph's memory, ids buffer)
        self.warmed = None    # the key last run as a warm-up
        self.failed = False   # the recorder refused (and warned): run the step directly

    def _key(self, ids: torch.Tensor, st: DecodeState, tensors: list[torch.Tensor]):
        # the StaticStep itself (compared by identity): a refreeze makes a new one. A buffer
        # made under inference mode (a RoPE table grown by a long prompt) has no version
        # counter; the model replaces such tables rather than changing them, which the
        # address shows (weights of that kind are refused in _graph_recorder). A graph reads
        # by address, dtype and shape, which the key holds too
        return (st.static, tuple(ids.shape), ids.dtype, tuple(map(tensor_state, tensors)))

    def __call__(self, ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
        if self.failed or getattr(self.model.depth, "exit", None) is not None:
            return self.run(ids, st)  # refused; or per-token exit (decided on the host)
        tensors, training = _walk(self.model)
        if training:  # a module switched to training between tokens: dropout draws masks
            return self.run(ids, st)
        key = self._key(ids, st, tensors)
        if self.recorded is None or self.recorded[0] != key:
            self.recorded = None  # the old graph's memory goes before a new one is recorded
            if self.warmed != key:
                self.warmed = key
                return self.recorder.warmup(lambda: self.run(ids, st))
            buffer = ids.clone()
            recorded = self.recorder.record(lambda: self.run(buffer, st))
            if recorded is None:
                self.failed = True
                return self.run(ids, st)
            self.recorded = (key, *recorded, buffer)
        _, replay, out, buffer = self.recorded
        buffer.copy_(ids)
        replay()
        return out.clone()


def _walk(module: torch.nn.Module) -> tuple[list[torch.Tensor], bool]:
    """Every parameter and buffer of ``module`` and its submodules (what ``parameters()`` and
    ``buffers()`` give, in a fixed order; a tensor two modules share comes twice), and whether
    any of the modules is in training mode: read from the modules' own tables, faster than
    those generators (which build names), since this runs for every replayed token."""
    out, seen, todo, training = [], set(), [module], False
    while todo:
        m = todo.pop()
        if id(m) in seen:  # a module registered twice, or a cycle
            continue
        seen.add(id(m))
        training = training or m.training
        out += [t for t in m._parameters.values() if t is not None]
        out += [t for t in m._buffers.values() if t is not None]
        todo += [c for c in reversed(m._modules.values()) if c is not None]
    return out, training


def _compiled_call(model, device_type: str = "cpu"):
    """``evaluate(module, *args)``: ``module(*args)`` through the compiled call for
    ``device_type``, or directly once compiling has failed for ``model`` (warned once)."""
    def evaluate(module, *args):
        if not model._compile_failed:
            try:
                return _compiled_evaluation(device_type)(module, *args)
            except _compile_errors() as e:
                # fullgraph: tracing and compiling end before anything runs, so the caches
                # are untouched and the direct call below makes this evaluation exactly once
                log.warning("generate(compile=True): torch.compile failed (%s: %s); "
                            "decoding eagerly.", type(e).__name__, first_line(e))
                model._compile_failed = True  # not again for this model
        return module(*args)
    return evaluate


def _call(module, *args):
    return module(*args)


_COMPILED: dict = {}  # device type -> the compiled _call
# inductor's options per device type. CPU: a C++ wrapper around the generated kernels instead
# of a Python one. A solver step's graph is a few dozen small kernels and matrix products, and
# the Python wrapper's glue around them (tensor views, allocations and size checks around
# every kernel) is a sizeable share of each call: with the C++ wrapper a 4-block
# RK4 x 4 model decodes 1.24x (softmax) and 1.39x (DeltaNet) the tokens/s
# (bench/decode_speed.py's record). On CUDA, graph replay (TokenGraphs) removes the host's
# share altogether, and the Python wrapper stays.
_INDUCTOR_OPTIONS = {"cpu": {"cpp_wrapper": True}}
# one compiled function serves every model, module type and batch size: allow more graphs
# than dynamo's default of 8 before it refuses to compile another (it then raises, under
# fullgraph, and that model decodes eagerly)
_RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def _recompile_limit(n: int):
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


def _capacity_for(n: int, minimum: int = 64) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def _compiled_evaluation(device_type: str = "cpu"):
    """One compiled ``_call`` per device type for every model, built on first use (nothing
    compiled is stored on a model, so copies and pickles of a model are unaffected); dynamo's
    guards tell module types and batch sizes apart (the capacity is symbolic). fullgraph: no
    graph breaks, so a failure to compile happens before any cache has moved."""
    fn = _COMPILED.get(device_type)
    if fn is None:
        fn = _COMPILED[device_type] = torch.compile(
            _call, fullgraph=True, options=_INDUCTOR_OPTIONS.get(device_type))
    return fn
