"""Binomial checkpointing (ode_grad = "binomial"): gradients equal direct backpropagation for
every fixed-grid solver (dropout, time embedding, the gated solver's own weights), for every
number of kept states from none to more than the steps, on awkward step counts; the backward
pass evaluates exactly what the plan says; the plan against an exhaustive search; memory;
config refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from continuumlm import ConfigError, LanguageModel, ModelConfig
from continuumlm.ode.binomial import _plan, default_checkpoints, recomputed_steps, spine
from continuumlm.registry import SOLVERS

FIXED = sorted(n for n in SOLVERS if SOLVERS.component_class(n).fixed_grid
               and not SOLVERS.component_class(n).reversible)
BASE = dict(vocab_size=29, hidden_size=16, num_heads=2, num_layers=2, max_seq_len=32,
            depth="ode", ode_time_embedding="sinusoidal", dropout=0.1)


def build(**kw) -> LanguageModel:
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(**{**BASE, **kw})).double()
    with torch.no_grad():
        for b in m.depth.blocks:
            b.field.time.proj.weight.normal_(0, 0.2)
            if hasattr(b.solver, "gate"):  # rk2_gated: a gate that depends on its inputs
                b.solver.gate.weight.normal_(0, 0.2)
    return m


def grads(model, idx):
    model.zero_grad()
    torch.manual_seed(3)  # the same dropout masks in both models
    _, loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def same(ref, **kw):
    m = build(**kw)
    m.load_state_dict(ref.state_dict())
    return m


@pytest.mark.parametrize("solver", FIXED)
def test_gradients_equal_direct(solver):
    idx = torch.randint(0, 29, (2, 9))
    ref = build(ode_solver=solver, ode_steps=5)
    loss_d, g_d = grads(ref, idx)
    m = same(ref, ode_solver=solver, ode_steps=5, ode_grad="binomial")
    loss_b, g_b = grads(m, idx)
    assert torch.equal(loss_b, loss_d)
    assert g_b.keys() == g_d.keys()
    for n in g_d:
        torch.testing.assert_close(g_b[n], g_d[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("steps,checkpoints", [(1, 1), (2, 1), (7, 0), (7, 1), (7, 2),
                                               (13, 3), (16, 4), (9, 20)])
def test_any_number_of_kept_states_and_the_backward_evaluations(steps, checkpoints):
    idx = torch.randint(0, 29, (2, 6))
    kw = dict(ode_solver="heun", ode_steps=steps, num_layers=1)
    ref = build(**kw)
    _, g_d = grads(ref, idx)
    m = same(ref, **kw, ode_grad="binomial", ode_checkpoints=checkpoints)
    _, g_b = grads(m, idx)
    for n in g_d:
        torch.testing.assert_close(g_b[n], g_d[n], rtol=1e-10, atol=1e-12, msg=n)
    # every step reversed once with its graph, plus the planned advances; 2 stages per step
    assert m.last_nfe == 2 * steps
    c = checkpoints or default_checkpoints(steps)  # 0: about log2 of the steps
    assert m.last_backward_nfe == 2 * (steps + recomputed_steps(steps, c))


def _brute(n: int, c: int) -> int:
    """The recursion's cost by exhaustive search over every split."""
    if n <= 1:
        return 0
    if c == 0:
        return n * (n - 1) // 2
    return min(m + _brute(n - m, c - 1) + _brute(m, c) for m in range(1, n))


def test_plan_is_the_cheapest_split_and_keeps_at_most_c_states():
    for n, c in itertools.product(range(1, 14), range(0, 5)):
        assert _plan(n, c)[0] == _brute(n, c), (n, c)
        points = spine(n, c)
        assert len(points) <= c + 1 and [p[0] for p in points] == sorted({p[0] for p in points})
    # with log2(n) states the backward recomputes a few times n, against n^2/2 with none
    for n in (16, 64, 256):
        c = default_checkpoints(n)
        assert recomputed_steps(n, c) < c * n < recomputed_steps(n, 0)


class _Held:
    """A tensor saved for backward, counted while autograd holds it."""

    live = peak = 0

    def __init__(self, t):
        self.t, self.bytes = t, t.numel() * t.element_size()
        _Held.live += self.bytes
        _Held.peak = max(_Held.peak, _Held.live)

    def __del__(self):
        _Held.live -= self.bytes


def test_memory_does_not_grow_with_the_steps(monkeypatch):
    """At its peak, autograd holds the kept states and one step's graph, not a graph per step:
    the bytes saved for backward plus the states the solve keeps for its backward (held on
    its context, which the hooks do not see) stay flat from 8 to 64 steps with 3 kept states,
    and grow with plain per-step checkpointing."""
    from continuumlm.ode import binomial

    kept = []
    forward = binomial._BinomialSolve.forward

    def counting(ctx, *args):
        out = forward(ctx, *args)
        kept.append(sum(h.nbytes for h in ctx.kept))
        return out

    monkeypatch.setattr(binomial._BinomialSolve, "forward", staticmethod(counting))

    def peak(grad, steps):
        m = build(ode_solver="rk4", ode_steps=steps, num_layers=1, ode_grad=grad,
                  ode_checkpoints=3, dropout=0.0)
        idx = torch.randint(0, 29, (4, 32))
        _Held.live = _Held.peak = 0
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(_Held, lambda h: h.t):
            m(idx, idx)[1].backward()
        assert (grad == "binomial") == bool(kept)  # the count saw the binomial solve
        return _Held.peak + sum(kept)

    b8, b64 = peak("binomial", 8), peak("binomial", 64)
    c8, c64 = peak("checkpoint", 8), peak("checkpoint", 64)
    assert b64 <= b8 * 1.05, (b8, b64)
    assert c64 > 3 * c8, (c8, c64)


@pytest.mark.parametrize("kw,needle", [
    (dict(ode_grad="binomial", ode_solver="dopri5"), "fixed-grid"),
    (dict(ode_grad="binomial", ode_solver="reversible_heun"), "ode_grad = 'reversible'"),
    (dict(ode_grad="binomial", ode_steps=5000), "at most 4096"),
    (dict(ode_checkpoints=-1), "ode_checkpoints"),
])
def test_refusals(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ModelConfig(**{**BASE, **kw})


@pytest.mark.parametrize("kw", [dict(ode_solver="rk4", ode_grad="binomial"),
                                dict(ode_solver="reversible_heun", ode_grad="reversible"),
                                dict(ode_solver="dopri5", ode_grad="checkpoint"),
                                dict(ode_solver="rk4", ode_grad="adjoint")],
                         ids=["binomial", "reversible", "adaptive-checkpoint", "adjoint"])
def test_a_double_backward_is_refused_not_wrong(kw):
    """These modes' backward passes build no graph of their own: differentiating a gradient
    through them raises (it gave a wrong Hessian-vector product for reversible), and binomial
    checkpointing, which lets go of its checkpoints as it reverses them, refuses a second
    backward by name instead of failing on an empty list."""
    m = build(**kw, ode_steps=4, dropout=0.0)
    idx = torch.randint(0, 29, (2, 9))
    params = [p for n, p in m.named_parameters() if "depth" in n]  # the ODE block's weights
    _, loss = m(idx, idx.roll(-1, 1))
    if kw["ode_grad"] == "adjoint":  # refused as soon as the graph would be built
        with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
            torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        return
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    with pytest.raises(RuntimeError, match="differentiate twice|once_differentiable"):
        sum(g.square().sum() for g in grads if g is not None).backward()
    if kw["ode_grad"] == "binomial":
        _, loss = m(idx, idx.roll(-1, 1))
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="differentiated once"):
            loss.backward()
