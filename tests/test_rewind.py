"""Cutting a decoding state back (DecodeState.crop): the log a recurrent cache keeps, the
refusals, and exactness over long stretches (the per-component invariant is
continuumlm.testing.check_rewind, run on every registered component in test_components.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from continuumlm.decoding import frozen_decoder
from continuumlm.mixers.cache import RewindLog, SeqCache
from continuumlm.testing import check_rewind, small_model


def _log_of(values: list[int], tokens: int, stride: int, sizes: list[int]) -> RewindLog:
    """A log over extensions of ``sizes`` tokens of the sequence ``values``; each entry's
    state is the list of values before it."""
    log, at = RewindLog(tokens, stride), 0
    for n in sizes:
        x = torch.tensor(values[at:at + n])[None]
        log.add(at, n, values[:at], {"x": (x, 1)})
        at += n
    return log


@pytest.mark.parametrize("sizes", [[1] * 40, [3, 1, 5, 1, 1, 7, 2, 1, 1, 4], [2] * 17])
@pytest.mark.parametrize("stride", [1, 4, 16])
def test_rewind_log_rebuilds_every_reachable_length(sizes, stride):
    values = list(range(100, 100 + sum(sizes)))
    n = sum(sizes)
    log = _log_of(values, 12, stride, sizes)
    floor = log.floor(n)
    assert floor <= n - 12 or floor == 0  # reaches at least 12 tokens back
    for m in range(n, floor - 1, -1):
        trial = _log_of(values, 12, stride, sizes)
        state, inputs = trial.cut(m)
        assert state + inputs["x"][0].tolist() == values[:m]  # kept state + replayed inputs
    if floor:
        with pytest.raises(ValueError, match="keeps what its last 12 tokens need"):
            _log_of(values, 12, stride, sizes).cut(floor - 1)


def test_rewind_log_cut_then_extend_again():
    values = list(range(30))
    log = _log_of(values, 20, 4, [1] * 30)
    state, inputs = log.cut(22)
    assert state + inputs["x"][0].tolist() == values[:22]
    other = list(range(200, 210))
    for i, v in enumerate(other):  # a different continuation
        log.add(22 + i, 1, values[:22] + other[:i], {"x": (torch.tensor([[v]]), 1)})
    state, inputs = log.cut(25)
    assert state + inputs["x"][0].tolist() == values[:22] + other[:3]


def test_a_long_extension_is_not_kept():
    log = RewindLog(8)
    log.add(0, 50, "start", {"x": (torch.zeros(1, 50), 1)})
    assert log.floor(50) == 50 and not log.entries
    with pytest.raises(ValueError):
        log.cut(49)


@pytest.mark.parametrize("mixer", ["deltanet", "softmax", "continuous"])
def test_cut_back_across_many_strides_is_exact(mixer):
    """40 tokens one per step (more than a stride of kept states), cut back 33: rebuilt from a
    kept state over the inputs since, as a state fed those tokens gives."""
    components = {"deltanet": {"short_conv": 4}} if mixer == "deltanet" else {}
    model = small_model(mixer=mixer, depth="ode", ode_solver="rk4", ode_steps=2,
                        components=components).double()
    seq = torch.randint(0, 37, (1, 45), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        state = model.init_state(1, rewind=40)
        model.step(seq[:, :3], state)
        for t in range(3, 43):
            model.step(seq[:, t:t + 1], state)
        state.crop(10)
        alone = model.init_state(1)
        model.step(seq[:, :10], alone)
        for t in range(10, 14):
            a, _ = model.step(seq[:, t:t + 1], state)
            b, _ = model.step(seq[:, t:t + 1], alone)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_crop_refusals_say_why():
    model = small_model(mixer="deltanet")
    seq = torch.randint(0, 37, (1, 12))
    with torch.no_grad():
        state = model.init_state(1, rewind=2)
        model.step(seq[:, :6], state)
        for t in range(6, 12):
            model.step(seq[:, t:t + 1], state)
        # the prompt (6 tokens, longer than 2) is not kept: back to its end at the earliest
        with pytest.raises(ValueError, match="cut back to 6 tokens at the earliest.*rewind=N"):
            state.crop(5)
        assert state.pos == 12  # refused before any cache changed
        with pytest.raises(ValueError, match="from 0 to 12"):
            state.crop(13)
        state.crop(10)
        assert state.pos == 10
        plain = model.init_state(1)  # rewind 0: nothing kept
        model.step(seq[:, :4], plain)
        model.step(seq[:, 4:5], plain)
        with pytest.raises(ValueError, match="at the earliest"):
            plain.crop(4)

    class NoCrop:
        length = 0
    state = model.init_state(1)
    state._caches[("layer", 0)] = NoCrop()
    state.pos = 3
    with pytest.raises(NotImplementedError, match="NoCrop .* has no crop"):
        state.crop(1)


def test_a_frozen_state_cut_back_in_place_and_its_refusals():
    """A frozen state is cut back in place: the position tensors and every buffer keep their
    addresses (what compiled and recorded steps read). A recurrent cache goes back no further
    than the token it was frozen at, nor further than its rewind window; a frozen cache type
    without a crop of its own is refused by name, before any cache changes."""
    from continuumlm.mixers.cache import FrozenCache

    model = small_model(mixer="deltanet", components={"deltanet": {"short_conv": 3}})
    seq = torch.randint(0, 37, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        state = model.init_state(1, rewind=4)
        model.step(seq[:, :6], state)
        fn = frozen_decoder(model, state)
        pos, mask = state.static.pos, state.static.mask
        addresses = {k: c.state.data_ptr() for k, c in state._caches.items()}
        for t in range(6, 9):
            fn(seq[:, t:t + 1], state)
            state.advance()
        with pytest.raises(ValueError, match="cut back to 6 tokens at the earliest"):
            state.crop(5)  # before the token it was frozen at
        assert state.pos == 9 and int(state.static.pos) == 9
        state.crop(6)
        assert state.static.pos is pos and state.static.mask is mask
        assert int(pos) == 6 and mask.sum() == 7
        assert {k: c.state.data_ptr() for k, c in state._caches.items()} == addresses
        for t in range(6, 14):
            fn(seq[:, t:t + 1], state)
            state.advance()
        with pytest.raises(ValueError, match="cut back to 10 tokens at the earliest.*rewind=N"):
            state.crop(9)  # beyond the window of 4

    class Stuck(FrozenCache):
        length = 14
    state._caches[("plugin", 0)] = Stuck()
    with pytest.raises(ValueError, match="type Stuck .*cannot be cut back"):
        state.crop(12)
    assert state.pos == 14
    cache = SeqCache()
    cache.append(torch.zeros(1, 1, 3, 2))
    with pytest.raises(ValueError, match="back to 4"):
        cache.crop(4)


def test_check_rewind_catches_a_cache_that_forgets(monkeypatch):
    """The invariant's check fails a cache whose crop only moves its length."""
    from continuumlm.mixers.deltanet import DeltaNetCache

    def careless(self, length):
        self.length = length

    monkeypatch.setattr(DeltaNetCache, "crop", careless)
    with pytest.raises(AssertionError, match="cutting back"):
        check_rewind(small_model(mixer="deltanet"))


def test_reordered_rows_are_not_cut_back_into_the_old_order():
    """After beam search reorders the rows, a recurrent cache forgets its log (its entries hold
    the old rows): it can be cut back to where the reorder happened, not before."""
    model = small_model(mixer="deltanet")
    seq = torch.randint(0, 37, (2, 8))
    with torch.no_grad():
        state = model.init_state(2, rewind=8)
        model.step(seq[:, :4], state)
        for t in range(4, 8):
            model.step(seq[:, t:t + 1], state)
        state.reorder(torch.tensor([1, 0]))
        with pytest.raises(ValueError, match="at the earliest"):
            state.crop(6)
        state.crop(8)  # where it is: nothing to do


def test_check_rewind_catches_a_frozen_cache_that_forgets(monkeypatch):
    """The frozen half of the check fails a frozen recurrent cache whose crop only moves its
    length, and a frozen state whose position tensors stay where they were."""
    from continuumlm.mixers.cache import StaticStep
    from continuumlm.mixers.deltanet import FrozenDeltaNetCache

    def careless(self, length):
        self.length = length

    with monkeypatch.context() as m:
        m.setattr(FrozenDeltaNetCache, "crop", careless)
        with pytest.raises(AssertionError, match="frozen step over a block|cutting a frozen"):
            check_rewind(small_model(mixer="deltanet"))
    with monkeypatch.context() as m:  # a block step that keeps only its last state
        m.setattr(FrozenDeltaNetCache, "update_tokens",
                  lambda self, states: self.state.copy_(states[:, :, -1]))
        with pytest.raises(AssertionError, match="cutting a frozen block step back"):
            check_rewind(small_model(mixer="deltanet"))
    def unmasked(self, pos):  # the positions moved back, the mask left as it was
        self.at = pos
        self.pos.copy_(torch.arange(pos, pos + self.width))

    monkeypatch.setattr(StaticStep, "rewind", unmasked)
    with pytest.raises(AssertionError, match="frozen step over a block|cutting a frozen"):
        check_rewind(small_model())


@pytest.mark.parametrize("mixer", ["deltanet", "softmax", "continuous"])
@pytest.mark.parametrize("depth", ["ode", "discrete"])
def test_cut_back_again_and_again_past_a_kept_state(mixer, depth):
    """Speculative decoding's pattern: extend by two tokens, cut one back, for more tokens
    than a recurrent cache's stride of kept states (16), each cut reaching back to a kept
    state that an earlier cut rebuilt from: every length decodes on as a fresh state of that
    length does (a cut once wrote the rebuilt convolution history into the log's own entry,
    so the next cut from there started from the wrong history)."""
    components = {"deltanet": {"short_conv": 4}} if mixer == "deltanet" else {}
    kw = dict(ode_solver="rk4", ode_steps=1) if depth == "ode" else {}
    model = small_model(mixer=mixer, depth=depth, components=components, **kw).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    seq = torch.randint(0, 37, (1, 34), generator=g)
    with torch.no_grad():
        state = model.init_state(1, rewind=18)
        model.step(seq[:, :5], state)
        for n in range(5, 30):
            model.step(seq[:, n:n + 2], state)
            state.crop(n + 1)
            probe = copy.deepcopy(state)
            a = model.step(seq[:, n + 1:n + 2], probe)[0]
            b = model.step(seq[:, :n + 2], model.init_state(1))[0]
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12,
                                       msg=lambda m, n=n: f"after the cut to {n + 1}: {m}")
