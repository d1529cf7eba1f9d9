"""nn.stacked_linear: several projections of one input as one product when autograd is off,
always equal to calling each projection, and never stale after a weight changes."""

from __future__ import annotations

import torch
import torch.nn as nn

from continuumlm.nn import BitLinear, stacked_linear
from continuumlm.nn import linear as lin


def _owner(bias=(True, False, True), sizes=(5, 7, 3), d=6, seed=0):
    torch.manual_seed(seed)
    owner = nn.Module()
    owner.projs = nn.ModuleList(nn.Linear(d, n, bias=b) for n, b in zip(sizes, bias))
    return owner


def _each(owner, x):
    return tuple(m(x) for m in owner.projs)


def _assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_stacked_equals_each_projection_and_is_kept_per_owner():
    kept: dict = {}  # the caller's store (a decoding state's)
    owner = _owner()
    x = torch.randn(2, 3, 6)
    with torch.no_grad():
        got = stacked_linear(owner, x, owner.projs, kept)
        _assert_same(got, _each(owner, x))
        copy = kept[owner][3][0]
        assert copy.shape == (15, 6)
        stacked_linear(owner, x, owner.projs, kept)
        assert kept[owner][3][0] is copy  # reused, not rebuilt
    assert set(owner.state_dict()) == {n for n, _ in owner.named_parameters()}


def test_a_changed_weight_is_never_read_stale():
    kept: dict = {}  # the caller's store (a decoding state's)
    owner = _owner()
    x = torch.randn(1, 1, 6)
    with torch.no_grad():
        stacked_linear(owner, x, owner.projs, kept)
        owner.projs[1].weight.add_(1.0)  # in place: the version moves
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
        owner.projs[2].bias = nn.Parameter(torch.randn(3))  # replaced
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
        owner.projs[0].weight.data = torch.randn(5, 6)  # data swapped, version unchanged
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
        owner.double()  # module.to() swaps .data too
        xd = x.double()
        got = stacked_linear(owner, xd, owner.projs, kept)
        assert all(t.dtype == torch.float64 for t in got)
        _assert_same(got, _each(owner, xd))


def test_with_autograd_on_each_projection_gets_its_gradient():
    kept: dict = {}  # the caller's store (a decoding state's)
    owner = _owner()
    x = torch.randn(2, 1, 6)
    sum(t.sum() for t in stacked_linear(owner, x, owner.projs, kept)).backward()
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in owner.projs)
    assert owner not in kept


def test_what_a_stack_would_change_is_called_as_itself():
    """BitLinear (its own forward), a module hook, a global hook and inference-tensor weights:
    each projection runs as itself (the hook fires), and the outputs are still right."""
    kept: dict = {}  # the caller's store (a decoding state's)
    x = torch.randn(1, 1, 6)
    owner = _owner()
    owner.projs[1] = BitLinear(6, 7)
    with torch.no_grad():
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
    assert owner not in kept

    owner = _owner()
    seen = []
    handle = owner.projs[2].register_forward_hook(lambda *a: seen.append("module"))
    with torch.no_grad():
        stacked_linear(owner, x, owner.projs, kept)
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda *a: seen.append("global"))
    try:
        with torch.no_grad():
            stacked_linear(owner, x, owner.projs, kept)
    finally:
        handle.remove()
    assert seen == ["module"] + ["global"] * 3
    assert owner not in kept

    with torch.inference_mode():
        owner = _owner()  # weights made in inference mode have no version counter
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
    assert owner not in kept


def test_wide_projections_are_not_copied(monkeypatch):
    """Past STACK_MAX_ELEMENTS the copy would cost memory for little: each as itself."""
    kept: dict = {}  # the caller's store (a decoding state's)
    owner = _owner()
    x = torch.randn(1, 1, 6)
    monkeypatch.setattr(lin, "STACK_MAX_ELEMENTS", 15 * 6 - 1)
    with torch.no_grad():
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
    assert owner not in kept
    monkeypatch.setattr(lin, "STACK_MAX_ELEMENTS", 15 * 6)
    with torch.no_grad():
        stacked_linear(owner, x, owner.projs, kept)
    assert owner in kept


def test_the_stacked_copy_lives_in_its_store_and_outlives_inference_mode():
    """The copy is held by the store the caller gives (a decoding state's): nothing is kept
    on the module or in the process, and it is an ordinary tensor when made in inference
    mode."""
    import gc
    import weakref

    kept: dict = {}
    owner = _owner()
    x = torch.randn(1, 1, 6)
    with torch.inference_mode():
        stacked_linear(owner, x, owner.projs, kept)
    assert not kept[owner][3][0].is_inference()
    with torch.no_grad():  # built in inference mode, used outside it
        _assert_same(stacked_linear(owner, x, owner.projs, kept), _each(owner, x))
    copy = weakref.ref(kept[owner][3][0])
    del kept
    gc.collect()
    assert copy() is None and owner.projs[0].weight is not None


def test_a_decoding_state_keeps_deltanets_stacked_weights_for_its_caches():
    """Every DeltaNet cache of a decoding state (each field evaluation's) shares the state's
    store, so one copy per mixer serves all of them, and it goes with the state."""
    from conftest import small_model

    m = small_model(mixer="deltanet", depth="ode", ode_solver="rk4", ode_steps=2)
    state = m.init_state(1)
    with torch.no_grad():
        m.step(torch.randint(0, 37, (1, 4)), state)
        m.step(torch.randint(0, 37, (1, 1)), state)
    mixers = [b.field.mixer for b in m.depth.blocks]
    assert set(state.shared) == set(mixers)  # one copy per mixer, not per evaluation
    assert all(c.shared is state.shared for c in state._caches.values())
