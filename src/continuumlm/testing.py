"""The invariants every component keeps, as checks a plugin author runs on their own part.

    from continuumlm.testing import check_component

    def test_my_mixer():
        check_component("mixer", "my_mixer")

A registered mixer, field or solver is built into small language models (discrete and ODE
depth for a mixer; every registered mixer for a field; the softmax mixer in a sequential
field for a solver) and each model must be

- exactly causal: changing the tokens after position i leaves the logits at <= i unchanged
  (for every fixed-grid solver; adaptive solvers couple positions through step-size control);
- decodable with its caches: greedy generation with the cache equals generation by
  recomputing, and prefill + one step per token gives the logits of one full forward, both
  eagerly (the mixer's ``extend(x, cache)``) and on the frozen one-token path that
  ``generate(compile=True)`` compiles (``extend_frozen(x, cache)`` on the layout its cache's
  ``freeze(step)`` returns; a mixer without these methods is called as ``forward(x,
  cache)`` throughout); that
  path, recorded once and replayed as a CUDA graph is (emulated on the CPU), gives its
  logits bit for bit (without per-token exit, whose decisions are made on the host);
  (a mixer with no decoding cache, ``cache_factory = None``: generation by recomputing
  gives the full forward's argmax, and decoding with caches is refused by naming it);
- rewindable: a decoding state cut back to an earlier length (inside a block of tokens
  consumed in one pass, or before it) and decoded on gives what a state of that length gives
  (float64, to 1e-12): what assisted and speculative decoding need; a frozen state too, cut
  back in place and decoded on through the frozen step, eager and graph-replayed (emulated):
  what speculative decoding through compiled or recorded steps needs (a cache type whose
  frozen layout has no crop of its own is not held to it; compiled speculative decoding
  refuses it by name);
- padded (when its mixers declare ``supports_padding``): a row padded on the left or right
  gives, at its real tokens, the logits of the row alone, in a full forward and in cached
  decoding; a mixer without padding support refuses a padded batch by name;
- trainable: the loss backpropagates to finite gradients on every parameter that takes part;
- (ODE depth) the same size whatever the number of solver steps;
- (a mixer with ``write(m, cache)`` and ``read(x, cache)``) all of the above again with its
  memory taken from the start of each solver step and from the block's input
  (``model.ode_kv = "step"`` and ``"block"``), and a field with them for ``"step"``; a mixer
  without them is refused those options by name.

The project's own tests run these checks over every registered component, so a built-in and
a plugin are held to the same standard. Each check raises AssertionError saying what broke.
"""

from __future__ import annotations

import copy

import torch

from .config import ModelConfig
from .decoding.frozen import frozen_block_decoder, frozen_decoder
from .decoding.replay import CaptureError, EmulatedGraphRecorder
from .errors import ConfigError
from .mixers.padding import takes_memory
from .model.lm import LanguageModel
from .registry import MIXERS, REGISTRIES, SOLVERS

SMALL = dict(vocab_size=37, hidden_size=32, num_heads=4, num_layers=2, max_seq_len=64)


def small_model(seed: int = 0, **kw) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(**{**SMALL, **kw})).eval()


def check_causal(model: LanguageModel, length: int = 24, atol: float = 1e-5) -> None:
    """Changing tokens after position i leaves the logits at positions <= i unchanged."""
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    idx = torch.randint(0, V, (2, length), generator=g)
    with torch.no_grad():
        ref = model(idx)[0]
        for i in (0, length // 3, length - 2):
            alt = idx.clone()
            alt[:, i + 1:] = torch.randint(0, V, alt[:, i + 1:].shape, generator=g)
            out = model(alt)[0]
            err = (out[:, :i + 1] - ref[:, :i + 1]).abs().max().item()
            assert err <= atol, (f"not causal: changing tokens after position {i} moved the "
                                 f"logits at <= {i} by {err:.3g} (> {atol})")


def check_cached_decoding(model: LanguageModel, prompt: torch.Tensor, n_new: int,
                          atol: float = 1e-4) -> torch.Tensor:
    """Greedy generation with the cache equals generation by recompute token for token, and
    prefill + one step per token gives the logits of one full forward within ``atol``, eagerly
    and on the frozen one-token path. Returns the generated sequence."""
    a = model.generate(prompt, n_new, greedy=True)
    b = model.generate(prompt, n_new, greedy=True, use_cache=False)
    assert torch.equal(a, b), "cached greedy generation differs from recomputing the context"
    P = prompt.shape[1]
    state = model.init_state(prompt.shape[0])
    steps = [model.step(a[:, :P], state)[0]] + [model.step(a[:, t:t + 1], state)[0]
                                                for t in range(P, a.shape[1] - 1)]
    with torch.no_grad():
        full, _ = model(a[:, :-1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, P - 1:], rtol=0, atol=atol,
                               msg=lambda m: f"cached decoding != full forward: {m}")
    if getattr(model.depth, "exact_cache", True):
        # the static one-token path that generate(compile=True) compiles, run eagerly here;
        # with the smallest first capacity, so that the buffers are refrozen larger on the way
        frozen, (first, last) = _frozen_logits(model, a[:, :P], a[:, P:])
        assert first == 1 << P.bit_length() and last >= a.shape[1] - 1
        torch.testing.assert_close(frozen, full[:, P - 1:], rtol=0, atol=atol,
                                   msg=lambda m: f"frozen one-token decoding != full forward: "
                                                 f"{m}")
        if getattr(model.depth, "exit", None) is None:  # exit decides on the host: no graphs
            # other tokens than the greedy ones, which a small model often repeats: a replay
            # that kept reading the recorded token would pass on those
            g = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, model.config.vocab_size, a[:, P:].shape, generator=g)
            check_graph_replay(model, a[:, :P], tokens,
                               _frozen_logits(model, a[:, :P], tokens)[0])
    return a


def _frozen_logits(model: LanguageModel, prompt: torch.Tensor, tokens: torch.Tensor,
                   graphs=None) -> tuple[torch.Tensor, tuple[int, int]]:
    """The prompt's last logits and then each of ``tokens`` (but the last) through the frozen
    one-token step, eager units, from the smallest first capacity (so that the buffers are
    refrozen larger on the way), recorded and replayed by ``graphs`` if given; with the
    first and last capacities."""
    state = model.init_state(prompt.shape[0])
    with torch.no_grad():
        steps = [model.step(prompt, state)[0]]
        fn = frozen_decoder(model, state, None, min_capacity=1, recorder=graphs)
        first = state.static.capacity
        for t in range(tokens.shape[1] - 1):
            steps.append(fn(tokens[:, t:t + 1], state))
            state.advance()
    return torch.stack(steps, 1), (first, state.static.capacity)


def check_graph_replay(model: LanguageModel, prompt: torch.Tensor, tokens: torch.Tensor,
                       expected: torch.Tensor) -> None:
    """The frozen one-token step, recorded once per buffer capacity and replayed for the
    tokens after (what ``generate(cuda_graph=True)`` does with CUDA graphs; emulated on the
    CPU by :mod:`continuumlm.decoding.replay`), gives the unrecorded step's logits ``expected`` bit
    for bit: the step reads no Python value that changes between tokens and reads no device
    value on the host."""

    try:
        got, _ = _frozen_logits(model, prompt, tokens, EmulatedGraphRecorder())
    except CaptureError as e:
        raise AssertionError(f"the frozen one-token step cannot be recorded as a graph: "
                             f"{e}; keep device values on the device (no .item(), bool() "
                             f"or int() of a tensor in a frozen step)") from None
    if not torch.equal(got, expected):
        bad = int((got != expected).flatten(2).any(-1).any(0).nonzero()[0])
        raise AssertionError(
            f"graph-replayed decoding differs from the frozen step from token {bad} on (max "
            f"|diff| {float((got - expected).abs().max()):.3g}): the step reads a Python "
            f"value that changes between tokens (a position kept as an int, a count on the "
            f"module), which a recorded graph keeps at its value when it was recorded; keep "
            f"it in a tensor updated in place (StaticStep.pos)")


def check_rewind(model: LanguageModel, prompt_len: int = 5, n_new: int = 4, block: int = 4,
                 atol: float = 1e-12) -> None:
    """A decoding state cut back to an earlier length and extended again gives what a state
    that only ever consumed that length gives, in float64 to ``atol``. After a prompt, one
    token per step and then a ``block`` of tokens in one extension (the pass that verifies
    drafted tokens), the state is cut back inside the block, to its start, to a one-token
    step's and to the prompt's end, each time decoding on one token per step to the end."""
    model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(2)
    B, V = 2, model.config.vocab_size
    block_at = prompt_len + n_new
    seq = torch.randint(0, V, (B, block_at + block + 2), generator=g)

    def logits(ids, state):
        return model.lm_head(model.hidden_states(ids, state))[:, -1]

    def on_from(m: int, state) -> torch.Tensor:
        """The logits of every later token, fed one per step to ``state`` of ``m`` tokens."""
        return torch.stack([logits(seq[:, t:t + 1], state)
                            for t in range(m, seq.shape[1])], 1)

    with torch.no_grad():
        state = model.init_state(B, rewind=seq.shape[1] - prompt_len)
        logits(seq[:, :prompt_len], state)
        for t in range(prompt_len, block_at):
            logits(seq[:, t:t + 1], state)
        logits(seq[:, block_at:block_at + block], state)  # the block, in one pass
        for m in sorted({block_at + block - 1, block_at + 1, block_at, block_at - 1,
                         prompt_len}, reverse=True):
            state.crop(m)
            assert state.pos == m, f"cut back to {m} tokens, the state holds {state.pos}"
            alone = model.init_state(B)
            logits(seq[:, :m], alone)
            torch.testing.assert_close(
                on_from(m, state), on_from(m, alone), rtol=0, atol=atol,
                msg=lambda msg, m=m: f"decoding on after cutting back to {m} tokens != "
                                     f"decoding on from a state of {m} tokens: {msg}")
    if getattr(model.depth, "exit", None) is None:
        for graphs in (None, EmulatedGraphRecorder()):
            _check_frozen_rewind(model, seq, prompt_len, graphs, atol)


def _check_frozen_rewind(model, seq, prompt_len: int, graphs, atol: float) -> None:
    """The frozen one-token step (eager units; recorded and replayed by ``graphs`` if
    given), cut back in place (``DecodeState.crop`` of a frozen state: what speculative
    decoding through compiled or recorded draft steps does) and decoded on, gives what an
    eager state of that length decoding on gives."""
    B, n = seq.shape[0], seq.shape[1] - prompt_len
    what = "graph-replayed" if graphs is not None else "frozen"
    with torch.no_grad():
        state = model.init_state(B, rewind=n)
        model.step(seq[:, :prompt_len], state)
        fn = frozen_decoder(model, state, None, min_capacity=1, recorder=graphs)
        if state.frozen_crop_refusal() is not None:
            return  # a frozen layout without a crop: compiled drafting refuses it by name

        def on_from(m: int, st, step) -> torch.Tensor:
            out = []
            for t in range(m, seq.shape[1]):
                out.append(step(seq[:, t:t + 1], st))
                if st.static is not None:
                    st.advance()
            return torch.stack(out, 1)

        def eager(ids, st):
            return model.step(ids, st)[0]

        # one token per frozen step up to the last 4, which go in one frozen step over a
        # block (a verifying pass); cut back inside it and to before it, decoded on one token
        # per frozen step
        end = seq.shape[1]
        for t in range(prompt_len, end - 4):
            fn(seq[:, t:t + 1], state)
            state.advance()
        block = frozen_block_decoder(model, state, None, min_capacity=1, recorder=graphs)
        got = block(seq[:, end - 4:], state)
        state.advance()
        want = model.lm_head(model.hidden_states(seq, model.init_state(B)))[:, end - 4:]
        torch.testing.assert_close(got, want, rtol=0, atol=atol,
                                   msg=lambda msg: f"a {what} step over a block of 4 tokens "
                                                   f"!= the eager pass: {msg}")
        for m in sorted({end - 2, end - 4, end - 5}, reverse=True):
            state.crop(m)
            alone = model.init_state(B)
            model.step(seq[:, :m], alone)
            torch.testing.assert_close(
                on_from(m, state, fn), on_from(m, alone, eager), rtol=0, atol=atol,
                msg=lambda msg, m=m: f"{what} decoding on after cutting a frozen block step "
                                     f"back to {m} tokens != decoding on from a state of {m} "
                                     f"tokens: {msg}")
        for m in sorted({seq.shape[1] - 1, seq.shape[1] - 3, prompt_len + 1, prompt_len},
                        reverse=True):
            state.crop(m)
            assert state.pos == m and int(state.static.pos) == m, \
                f"a {what} state cut back to {m} tokens holds {state.pos}"
            alone = model.init_state(B)
            model.step(seq[:, :m], alone)
            torch.testing.assert_close(
                on_from(m, state, fn), on_from(m, alone, eager), rtol=0, atol=atol,
                msg=lambda msg, m=m: f"{what} decoding on after cutting a frozen state back "
                                     f"to {m} tokens != decoding on from a state of {m} "
                                     f"tokens: {msg}")


def check_padding(model: LanguageModel, atol: float = 1e-5, cached: bool = True) -> None:
    """For a model whose mixers support padding (``supports_padding``): a row padded on the
    left or on the right gives, at its real tokens, the logits of the same sequence alone, in
    a full forward and in cached decoding (a left-padded prompt, then one token per step).
    A model whose mixer has no padding support must refuse a padded batch by name.
    ``cached=False``: the full forward alone (a mixer without a decoding cache)."""
    g = torch.Generator().manual_seed(1)
    # weights away from their initialization (a short convolution starts as the identity,
    # which hides what its history holds)
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
    V = model.config.vocab_size
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (9, 5, 1)]
    L = max(len(s) for s in seqs)
    supported = all(getattr(m, "supports_padding", False) for m in model.modules()
                    if type(m).__name__ != "LanguageModel" and hasattr(m, "cache_factory"))
    with torch.no_grad():
        alone = [model(s[None])[0][0] for s in seqs]
        for side in ("right", "left"):  # the left-padded batch is decoded on below
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            mask = torch.zeros(len(seqs), L, dtype=torch.long)
            for i, s in enumerate(seqs):
                where = slice(L - len(s), L) if side == "left" else slice(0, len(s))
                ids[i, where], mask[i, where] = s, 1
            if not supported:
                try:
                    model.hidden_states(ids, attention_mask=mask)
                except ValueError as e:
                    assert "padded" in str(e), f"a padded batch was refused unclearly: {e}"
                    return
                raise AssertionError("a mixer without supports_padding took a padded batch")
            out = model.lm_head(model.hidden_states(ids, attention_mask=mask))
            for i, s in enumerate(seqs):
                where = slice(L - len(s), L) if side == "left" else slice(0, len(s))
                torch.testing.assert_close(
                    out[i, where], alone[i], rtol=0, atol=atol,
                    msg=lambda m, side=side: f"a {side}-padded row != the row alone: {m}")
        if not cached:
            return
        # cached decoding after a left-padded prompt, three more tokens one at a time; after a
        # right-padded one (pads between a row's tokens) a mixer either gets it right or
        # refuses it by name
        more = torch.randint(0, V, (len(seqs), 3), generator=g)
        for side in ("left", "right"):
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            mask = torch.zeros(len(seqs), L, dtype=torch.long)
            for i, s in enumerate(seqs):
                where = slice(L - len(s), L) if side == "left" else slice(0, len(s))
                ids[i, where], mask[i, where] = s, 1
            state = model.init_state(len(seqs))
            try:
                steps = [model.lm_head(model.hidden_states(ids, state, attention_mask=mask))]
                for t in range(more.shape[1]):
                    mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=mask.dtype)], 1)
                    h = model.hidden_states(more[:, t:t + 1], state, attention_mask=mask)
                    steps.append(model.lm_head(h)[:, -1:])
            except ValueError as e:
                assert side == "right" and "one stretch" in str(e), \
                    f"decoding after a {side}-padded prompt was refused: {e}"
                continue
            for i, s in enumerate(seqs):
                last = L - 1 if side == "left" else len(s) - 1
                got = torch.stack([steps[0][i, last]] + [x[i, 0] for x in steps[1:]])
                full = model(torch.cat([s, more[i]])[None])[0][0, len(s) - 1:]
                torch.testing.assert_close(
                    got, full, rtol=0, atol=atol * 10,
                    msg=lambda m, side=side: f"cached decoding of a {side}-padded row != the "
                                             f"row alone: {m}")


def check_trains(model: LanguageModel) -> None:
    """One backward of the loss: finite, and a gradient on every parameter."""
    model.train()
    idx = torch.randint(0, model.config.vocab_size, (2, 12))
    _, loss = model(idx, idx.roll(-1, dims=1))
    (loss + model.penalty()).backward()
    model.eval()
    assert torch.isfinite(loss), f"the loss is {loss.item()}"
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen on purpose
            continue
        assert p.grad is not None, f"{name} takes no part in the loss"
        assert torch.isfinite(p.grad).all(), f"the gradient of {name} is not finite"


def check_size_ignores_steps(**kw) -> None:
    sizes = {steps: small_model(**{**kw, "ode_steps": steps}).num_parameters()
             for steps in (1, 3)}
    assert len(set(sizes.values())) == 1, f"parameter count depends on ode_steps: {sizes}"


def check_cacheless_decoding(model: LanguageModel, prompt: torch.Tensor, n_new: int) -> None:
    """A model with a mixer that keeps no decoding cache (``cache_factory = None``): greedy
    generation by recomputing gives the argmax of a full forward token by token, and cached
    generation and ``step()`` through a state are refused by naming the mixer and the way
    out (``use_cache=False``)."""
    names = model.cacheless_mixers()
    out = model.generate(prompt, n_new, greedy=True, use_cache=False)
    ref = prompt
    with torch.no_grad():
        for _ in range(n_new):
            ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref), "generation by recomputing != the full forward's argmax"
    for attempt in (lambda: model.generate(prompt, 2, greedy=True),
                    lambda: model.step(prompt, model.init_state(prompt.shape[0]))):
        try:
            attempt()
        except ValueError as e:
            assert all(n in str(e) for n in names) and "use_cache=False" in str(e), \
                f"cached decoding of a cacheless mixer was refused unclearly: {e}"
        else:
            raise AssertionError(f"the mixer {names} has no decoding cache, and decoding "
                                 f"with caches was not refused")


def _check_model(kw: dict, fixed_grid: bool = True) -> None:
    model = small_model(**kw)
    if fixed_grid and model.cacheless_mixers():  # decodes only by recomputing
        check_causal(model)
        check_cacheless_decoding(model, torch.randint(0, SMALL["vocab_size"], (2, 5)), 6)
        if model.config.mode == "decoder":
            check_padding(model, cached=False)
    elif fixed_grid:
        check_causal(model)
        check_cached_decoding(model, torch.randint(0, SMALL["vocab_size"], (2, 5)), 12)
        if model.config.mode == "decoder":
            check_rewind(model)
            check_padding(model)
    else:  # adaptive: decoding recomputes the context; causality holds only approximately
        a = model.generate(torch.randint(0, SMALL["vocab_size"], (1, 4)), 3, greedy=True)
        assert a.shape == (1, 7)
    check_trains(small_model(**kw))
    if kw.get("depth") == "ode":
        check_size_ignores_steps(**kw)


def check_component(kind: str, name: str, **model_kw) -> None:
    """Every check above for the registered ``kind`` ("mixer", "field" or "solver") ``name``,
    in the small models described in this module's docstring; ``model_kw`` adds settings."""
    if kind not in ("mixer", "field", "solver"):
        raise ValueError(f"kind must be 'mixer', 'field' or 'solver', got {kind!r}.")
    REGISTRIES[kind][name]  # an unknown name fails here, listing the registered ones
    ode = dict(depth="ode", field="sequential", ode_solver="rk4", ode_steps=2)
    if kind == "mixer":
        for depth in (dict(depth="discrete"), ode):
            _check_model({**depth, "mixer": name, **model_kw})
        if "ode_kv" not in model_kw and takes_memory(MIXERS.component_class(name)):
            for kv in ("step", "block"):
                _check_model({**ode, "mixer": name, "ode_kv": kv, **model_kw})
        elif "ode_kv" not in model_kw:
            try:
                small_model(**{**ode, "mixer": name, "ode_kv": "step", **model_kw})
            except ConfigError as e:
                assert name in str(e) and "write" in str(e), f"refused without a reason: {e}"
            else:
                raise AssertionError(f"the mixer {name!r} has no write/read, and a model with "
                                     f"ode_kv = 'step' was built with it")
    elif kind == "field":
        for mixer in sorted(MIXERS):
            _check_model({**ode, "field": name, "mixer": mixer, **model_kw})
            if "ode_kv" not in model_kw and takes_memory(MIXERS.component_class(mixer)):
                _check_model({**ode, "field": name, "mixer": mixer, "ode_kv": "step",
                              **model_kw})
    else:
        fixed = SOLVERS.component_class(name).fixed_grid
        _check_model({**ode, "ode_solver": name, **model_kw}, fixed_grid=fixed)
