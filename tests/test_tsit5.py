"""Tsit5 (Tsitouras 2011) and the other adaptive methods exposed from torchdiffeq: the tableau's
order conditions, the observed convergence order of the fifth-order solution and of the
embedded fourth-order one on problems with known solutions, the dense output, and adaptive
solves through the package's own entry point."""

from __future__ import annotations

import math

import pytest
import torch

from continuumlm.ode.adaptive import (
    ADAPTIVE_METHODS,
    TSIT5_A,
    TSIT5_B_ERROR,
    TSIT5_C,
    odeint_call,
    tsit5_dense_weights,
)

C = (0.0,) + TSIT5_C  # stage nodes, the first one 0
A = ((),) + TSIT5_A  # stage i uses A[i]
B = TSIT5_A[-1] + (0.0,)  # fifth order (first same as last: stage 7 is f at the new point)
# the error row is (fourth-order weights) - (fifth-order weights), as Tsitouras tabulates
# b-hat - b, so the embedded fourth-order weights are B + E (B - E = 2 b - b-hat satisfies the
# same conditions up to order four, so only the values themselves tell them apart)
B4 = tuple(b + e for b, e in zip(B, TSIT5_B_ERROR))


def test_embedded_weights_are_tsitouras_b_hat():
    # Tsitouras 2011, Table 1: b-hat_1 = 0.09468075576583945..., b-hat_7 = 1/66
    assert math.isclose(B4[0], 0.09468075576583945, abs_tol=1e-15)
    assert math.isclose(B4[6], 1 / 66, abs_tol=1e-16)


def test_row_sums_and_low_order_conditions():
    for i in range(1, 7):
        assert math.isclose(sum(A[i]), C[i], abs_tol=1e-14), i
    for w, order in ((B, 5), (B4, 4)):
        assert math.isclose(sum(w), 1.0, abs_tol=1e-14)
        # quadrature conditions sum b_i c_i^(q-1) = 1/q up to the order
        for q in range(1, order + 1):
            assert math.isclose(sum(b * c ** (q - 1) for b, c in zip(w, C)), 1 / q,
                                abs_tol=1e-13), (order, q)
    # the fourth-order weights are not also fifth order (else there is no error estimate)
    assert not math.isclose(sum(b * c ** 4 for b, c in zip(B4, C)), 1 / 5, abs_tol=1e-6)


def tsit5_step(f, t, y, dt, weights):
    k = []
    for i in range(7):
        yi = y + dt * sum((a * kj for a, kj in zip(A[i], k)), torch.zeros_like(y))
        k.append(f(t + C[i] * dt, yi))
    return y + dt * sum((b * ki for b, ki in zip(weights, k)), torch.zeros_like(y)), k


def integrate(f, y0, t1, n, weights):
    y, dt = y0, t1 / n
    for i in range(n):
        y, _ = tsit5_step(f, i * dt, y, dt, weights)
    return y


PROBLEMS = {
    # y' = y cos t, y = exp(sin t); a rotation with a time-dependent rate
    "exp_sin": (lambda t, y: y * math.cos(t), torch.tensor([1.0], dtype=torch.float64),
                lambda t: torch.tensor([math.exp(math.sin(t))], dtype=torch.float64)),
    "rotation": (lambda t, y: (1 + t) * torch.stack([-y[1], y[0]]),
                 torch.tensor([1.0, 0.0], dtype=torch.float64),
                 lambda t: torch.tensor([math.cos(t + t * t / 2), math.sin(t + t * t / 2)],
                                        dtype=torch.float64)),
}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("weights,order", [(B, 5), (B4, 4)], ids=["fifth", "embedded_fourth"])
def test_observed_convergence_order(problem, weights, order):
    f, y0, exact = PROBLEMS[problem]
    t1 = 2.0
    errs = [(integrate(f, y0, t1, n, weights) - exact(t1)).abs().max().item()
            for n in (8, 16, 32)]
    observed = [math.log2(a / b) for a, b in zip(errs, errs[1:])]
    # at least the order; a little more before the asymptotic range (Tsit5 was tuned for
    # small sixth-order error terms)
    assert all(order - 0.3 < o < order + 1.2 for o in observed), (errs, observed)


def test_error_estimate_is_the_local_error_of_the_fourth_order_solution():
    f, y0, exact = PROBLEMS["exp_sin"]
    for dt in (0.2, 0.1):
        y5, k = tsit5_step(f, 0.0, y0, dt, B)
        estimate = dt * sum(e * ki for e, ki in zip(TSIT5_B_ERROR, k))
        y4 = y5 - estimate
        true4 = (y4 - exact(dt)).abs().item()
        true5 = (y5 - exact(dt)).abs().item()
        # the estimate y5 - y4 differs from y4's error by y5's error, which is far smaller
        assert true5 < 0.2 * true4, (dt, true5, true4)
        assert abs(estimate.abs().item() - true4) <= true5 * (1 + 1e-6), (dt, estimate, true4)


def test_dense_output_weights():
    assert [round(x, 14) for x in tsit5_dense_weights(1.0)] == [round(x, 14) for x in B]
    for s in (0.25, 0.5, 0.8):
        assert math.isclose(sum(tsit5_dense_weights(s)), s, abs_tol=1e-13)
    # fourth-order accurate inside the step: the error at the midpoint shrinks ~32x per halving
    f, y0, exact = PROBLEMS["rotation"]
    errs = []
    for dt in (0.2, 0.1, 0.05):
        _, k = tsit5_step(f, 0.0, y0, dt, B)
        mid = y0 + dt * sum(w * ki for w, ki in zip(tsit5_dense_weights(0.5), k))
        errs.append((mid - exact(dt / 2)).abs().max().item())
    assert all(a / b > 2 ** 4.5 for a, b in zip(errs, errs[1:])), errs


@pytest.mark.parametrize("name", sorted(ADAPTIVE_METHODS))
def test_adaptive_solves_reach_their_tolerance(name):
    f, y0, exact = PROBLEMS["rotation"]
    calls = [0]

    def field(t, y):
        calls[0] += 1
        return f(float(t), y)

    # adaptive_heun (second order) needs ~36,000 evaluations at 1e-8; 100x looser suffices
    rtol, atol = (1e-6, 1e-8) if name == "adaptive_heun" else (1e-8, 1e-10)
    out = odeint_call(field, y0, 0.0, 2.0, ADAPTIVE_METHODS[name], False, (), "test",
                      rtol=rtol, atol=atol, options={"max_num_steps": 100_000})
    err = (out - exact(2.0)).abs().max().item()
    assert err < (1e-4 if name in ("bosh3", "fehlberg2", "adaptive_heun") else 1e-6), (name, err)
    if name in ("tsit5", "dopri5"):  # fifth-order pairs: a few hundred evaluations at most
        assert calls[0] < 600, calls[0]


def test_tsit5_takes_fewer_evaluations_than_a_low_order_pair_for_the_same_accuracy():
    f, y0, exact = PROBLEMS["exp_sin"]
    used = {}
    for name in ("tsit5", "bosh3"):
        calls = [0]

        def field(t, y, calls=calls):
            calls[0] += 1
            return f(float(t), y)

        out = odeint_call(field, y0, 0.0, 2.0, ADAPTIVE_METHODS[name], False, (), "test",
                          rtol=1e-9, atol=1e-11, options={"max_num_steps": 100_000})
        used[name] = (calls[0], (out - exact(2.0)).abs().item())
    # more accurate with a fraction of the evaluations
    assert used["tsit5"][1] < used["bosh3"][1] and used["tsit5"][0] < used["bosh3"][0] / 3, used


# ------------------------------------------------------------------ in a model

def _grads(model, idx):
    model.zero_grad()
    _, loss = model(idx, idx.roll(-1, 1))
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _ode(**kw):
    from continuumlm.testing import small_model

    return small_model(**{**dict(depth="ode", num_layers=1, hidden_size=16, num_heads=2,
                                 ode_time_embedding="sinusoidal"), **kw}).double()


def test_tsit5_adjoint_with_seminorm_matches_direct_and_takes_fewer_backward_steps():
    tol = dict(ode_solver="tsit5", ode_rtol=1e-7, ode_atol=1e-9)
    idx = torch.randint(0, 37, (2, 7))
    ref = _ode(**tol)
    g_direct = _grads(ref, idx)
    assert ref.last_backward_nfe == 0  # direct backprop evaluates nothing again
    backward = {}
    for norm in ("default", "seminorm"):
        m = _ode(**tol, ode_grad="adjoint", ode_adjoint_norm=norm)
        m.load_state_dict(ref.state_dict())
        g = _grads(m, idx)
        assert ((g - g_direct).norm() / g_direct.norm()).item() < 1e-4, norm
        backward[norm] = m.last_backward_nfe
    assert 0 < backward["seminorm"] < backward["default"], backward


def test_checkpointed_steps_count_as_backward_evaluations():
    m = _ode(ode_solver="rk4", ode_steps=3, ode_grad="checkpoint")
    _grads(m, torch.randint(0, 37, (2, 7)))
    assert m.last_nfe == 12 and m.last_backward_nfe == 12  # every step recomputed once


class _Field(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(6, 6).double()
        self.w = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, t, h):
        return torch.tanh(self.lin(h)) * torch.cos(self.w * t) - 0.3 * h


@pytest.mark.parametrize("name", sorted(set(ADAPTIVE_METHODS) - {"adaptive_heun"}))
def test_adjoint_gradients_are_as_accurate_as_direct_backprop(name):
    """The adjoint's backward solve ends exactly on t0, as the forward ends on t1: for the
    methods whose interpolant is too coarse to end a solve on (tsit5, dopri8, fehlberg2) it
    was left there by interpolation, and dopri8's gradient erred 1000x more than its solve."""
    field = _Field()
    h0 = torch.randn(3, 6, dtype=torch.float64)
    weights = torch.linspace(-1, 1, 6, dtype=torch.float64)

    def grads(method, adjoint, rtol):
        field.zero_grad()
        h = h0.clone().requires_grad_(True)
        out = odeint_call(field, h, 0.0, 1.5, method, adjoint, tuple(field.parameters()), "test",
                          rtol=rtol, atol=rtol * 1e-2, options={"max_num_steps": 100_000})
        (out * weights).sum().backward()
        return torch.cat([h.grad.flatten()] + [p.grad.flatten() for p in field.parameters()])

    ref = grads(ADAPTIVE_METHODS["dopri8"], False, 1e-13)

    def err(g):
        return ((g - ref).norm() / ref.norm()).item()

    direct = err(grads(ADAPTIVE_METHODS[name], False, 1e-6))
    adjoint = err(grads(ADAPTIVE_METHODS[name], True, 1e-6))
    assert adjoint < 3 * direct + 1e-12, (adjoint, direct)
