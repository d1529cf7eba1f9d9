"""Exact gradients for adaptive solves (ode_grad = "checkpoint" with an adaptive solver): the
forward is one solve, whose output is bit for bit the accepted steps replayed from their stored
starts; the gradient is that of direct backpropagation through those steps, and near the
continuous gradient at tight tolerances; the backward evaluates each accepted step once more."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from continuumlm.ode.aca import AcceptedSteps, replay
from continuumlm.ode.adaptive import ADAPTIVE_METHODS, _RecordingFunc, odeint_call

METHODS = sorted(ADAPTIVE_METHODS)


def _alphas(name):
    import importlib

    solvers = importlib.import_module("torchdiffeq._impl.odeint").SOLVERS
    return solvers[ADAPTIVE_METHODS[name]].tableau.alpha


ADAPTIVE_TABLEAU_STAGES = {name: _alphas(name) for name in METHODS}


class Field(nn.Module):
    """A small non-autonomous field with parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 6).double()
        self.w = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, t, h):
        return torch.tanh(self.lin(h)) * torch.cos(self.w * t) - 0.3 * h


def grads(field, h0, **kw):
    field.zero_grad()
    h = h0.clone().requires_grad_(True)
    out = odeint_call(field, h, 0.0, 1.5, kw.pop("method"), False, tuple(field.parameters()),
                      "test", options={"max_num_steps": 10_000}, **kw)
    (out * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
    return out.detach(), torch.cat([h.grad.flatten()] + [p.grad.flatten()
                                                         for p in field.parameters()])


@pytest.mark.parametrize("name", METHODS)
def test_gradient_equals_direct_backprop_through_the_accepted_steps(name):
    method, field = ADAPTIVE_METHODS[name], Field()
    h0 = torch.randn(3, 6, dtype=torch.float64)
    out, g = grads(field, h0, method=method, rtol=1e-6, atol=1e-8, checkpoint=True)
    # the reference: the same search, then the accepted steps replayed with autograd
    import torchdiffeq

    func = _RecordingFunc(field, tuple(field.parameters()), "test", name)
    t = torch.tensor([0.0, 1.5], dtype=torch.float64)
    func.accepted = AcceptedSteps(t[1], method, h0)
    with torch.no_grad():
        solved = torchdiffeq.odeint(func, h0, t, method=method, rtol=1e-6, atol=1e-8,
                                    options={"max_num_steps": 10_000, "step_t": t[1:]})[-1]
    steps = func.accepted.steps()
    assert len(steps) >= 2
    field.zero_grad()
    h = h0.clone().requires_grad_(True)
    ref = replay(field, h, steps, method)
    (ref * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
    g_ref = torch.cat([h.grad.flatten()] + [p.grad.flatten() for p in field.parameters()])
    # the output is the replayed steps' (bit for bit), and the solution torchdiffeq computed
    # (its own output at t1 is read from its interpolant: equal to rounding)
    assert torch.equal(out, ref.detach())
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out, solved, rtol=1e-13, atol=1e-14)


def count_evaluations(field):
    calls = [0]

    def f(t, h):
        calls[0] += 1
        return field(t, h)

    return f, calls


@pytest.mark.parametrize("name", METHODS)
def test_the_forward_costs_one_solve(name):
    """The checkpointed forward evaluates the field as often as a direct solve (the search is
    the solve); the backward once more per accepted step's stages, plus f(t0, h0)."""
    method, field = ADAPTIVE_METHODS[name], Field()
    h0 = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    counts = {}
    for mode in ("direct", "checkpoint"):
        f, calls = count_evaluations(field)
        out = odeint_call(f, h0, 0.0, 1.5, method, False, tuple(field.parameters()), "test",
                          options={"max_num_steps": 10_000}, rtol=1e-6, atol=1e-8,
                          checkpoint=mode == "checkpoint")
        counts[mode] = calls[0]
        if mode == "checkpoint":
            out.sum().backward()
            counts["backward"] = calls[0] - counts[mode]
    assert counts["checkpoint"] == counts["direct"], counts
    stages = len(ADAPTIVE_TABLEAU_STAGES[name])
    assert counts["backward"] > 1 and (counts["backward"] - 1) % stages == 0, counts


@pytest.mark.parametrize("name", ["tsit5", "dopri5"])
def test_close_to_the_continuous_gradient_at_tight_tolerance(name):
    field, h0 = Field(), torch.randn(3, 6, dtype=torch.float64)
    method = ADAPTIVE_METHODS[name]
    _, g = grads(field, h0, method=method, rtol=1e-10, atol=1e-12, checkpoint=True)
    _, g_fine = grads(field, h0, method="dopri8", rtol=1e-12, atol=1e-14)  # direct, very fine
    assert ((g - g_fine).norm() / g_fine.norm()).item() < 1e-7


def test_in_a_model_the_backward_recomputes_each_accepted_step_once():
    from continuumlm.testing import check_trains, small_model

    kw = dict(depth="ode", num_layers=1, ode_solver="tsit5", ode_grad="checkpoint",
              ode_rtol=1e-5, ode_atol=1e-7)
    m = small_model(**kw).double()
    idx = torch.randint(0, 37, (2, 7))
    _, loss = m(idx, idx.roll(-1, 1))
    forward = m.last_nfe
    loss.backward()
    # the forward is the search (accepted and rejected attempts); the backward 6 evaluations
    # per accepted step (the first stage is the derivative the step began with) and f(t0, h0)
    assert m.last_backward_nfe > 0 and (m.last_backward_nfe % 6 == 1)
    assert forward >= m.last_backward_nfe - 1
    check_trains(small_model(**kw))


def test_the_backward_recomputes_under_the_forwards_autocast():
    """Under bf16 autocast the replayed steps are recomputed in bf16 too, so the gradient is
    that of the output returned (the reference: the same replay, differentiated directly,
    inside the same autocast)."""
    import torchdiffeq

    field = Field().float()
    h0 = torch.randn(3, 6)
    method = ADAPTIVE_METHODS["tsit5"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = h0.clone().requires_grad_(True)
        out = odeint_call(field, h, 0.0, 1.5, method, False, tuple(field.parameters()), "test",
                          options={"max_num_steps": 10_000}, rtol=1e-4, atol=1e-6,
                          checkpoint=True)
    out.float().sum().backward()
    g = h.grad.clone()
    func = _RecordingFunc(field, tuple(field.parameters()), "test", "tsit5")
    t = torch.tensor([0.0, 1.5])
    func.accepted = AcceptedSteps(t[1], method, h0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torchdiffeq.odeint(func, h0, t, method=method, rtol=1e-4, atol=1e-6,
                           options={"max_num_steps": 10_000, "step_t": t[1:]})
    h = h0.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = replay(field, h, func.accepted.steps(), method)
    ref.float().sum().backward()
    torch.testing.assert_close(g, h.grad, rtol=1e-5, atol=1e-6)
