"""Exact gradients for adaptive solves (``ode_grad = "checkpoint"`` with an adaptive solver): the
adaptive checkpoint adjoint of Zhuang et al. (ICML 2020).

The backsolve adjoint differentiates the continuous ODE and integrates it backwards, so its
gradient is off by the discretization error and the backward solve can diverge. Here the
forward pass records the steps torchdiffeq's controller accepted (rejected attempts are
forgotten), the output is the solution those steps compute, and the backward pass recomputes
each accepted step from its stored starting state, with a graph, one at a time: the gradient is
exactly that of the computed solution with the accepted step sizes held fixed (what direct
backpropagation through the same steps gives), and memory holds the states at the accepted step
boundaries plus one step's graph.

The steps are taken with torchdiffeq's own Runge-Kutta step and tableau (``_runge_kutta_step``
and the solver class's ``tableau``: torchdiffeq exposes no public step API), so the method is
exactly the one the controller chose the steps for. Each step starts from f(t_k, h_k): the
first-same-as-last evaluation torchdiffeq reuses is taken at t_k minus one rounding unit, which
would tie every step to the one before it. (For the pairs that are not first-same-as-last,
adaptive_heun and fehlberg2, torchdiffeq reuses their last stage's evaluation, taken elsewhere,
so there the replayed solution differs from its own within the solve's tolerance; the gradient
is still exactly that of the solution returned.)
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .binomial import reverse_step


def _method_tableau(method: str, like: torch.Tensor):
    import importlib

    from torchdiffeq._impl.rk_common import _ButcherTableau

    solvers = importlib.import_module("torchdiffeq._impl.odeint").SOLVERS
    tab = solvers[method].tableau
    cast = dict(device=like.device, dtype=like.dtype)
    return _ButcherTableau(alpha=tab.alpha.to(**cast), beta=[b.to(**cast) for b in tab.beta],
                           c_sol=tab.c_sol.to(**cast), c_error=tab.c_error.to(**cast))


class AcceptedSteps:
    """Collects the (t0, t1) of every accepted step (torchdiffeq's callback_accept_step)."""

    def __init__(self, t_end: torch.Tensor) -> None:
        self.starts: list[torch.Tensor] = []
        self.t_end = t_end

    def accept(self, t0, y0, dt) -> None:
        self.starts.append(t0.detach().clone())

    def intervals(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ends = self.starts[1:] + [self.t_end]
        return list(zip(self.starts, ends))


def _step(func, tableau, h: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    from torchdiffeq._impl.misc import _PerturbFunc
    from torchdiffeq._impl.rk_common import _runge_kutta_step

    pf = _PerturbFunc(func)
    f0 = pf(t0, h)
    return _runge_kutta_step(pf, h, f0, t0, t1 - t0, t1, tableau)[0]


def replay(func, h0: torch.Tensor, intervals, method: str) -> torch.Tensor:
    """The accepted steps taken again, differentiably (the reference the checkpointed
    backward is held to)."""
    tableau = _method_tableau(method, h0)
    h = h0
    for t0, t1 in intervals:
        h = _step(func, tableau, h, t0, t1)
    return h


class _CheckpointedReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h0, func, intervals, method, *params):
        ctx.func, ctx.intervals = func, intervals
        # the backward recomputes each step under the forward's autocast setting, or it would
        # differentiate another function than the one that made the output
        kind = h0.device.type
        ctx.autocast = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                            dtype=torch.get_autocast_dtype(kind))
        ctx.tableau = _method_tableau(method, h0)
        kept, h = [], h0
        for t0, t1 in intervals:
            kept.append(h)
            h = _step(func, ctx.tableau, h, t0, t1)
        ctx.save_for_backward(*params, *kept)
        ctx.num_params = len(params)
        return h

    @staticmethod
    @once_differentiable  # its vjps build no graph: a double backward would be wrong
    def backward(ctx, g):
        saved = ctx.saved_tensors
        params, kept = saved[:ctx.num_params], saved[ctx.num_params:]
        grads: list[torch.Tensor | None] = [None] * len(params)
        with torch.autocast(**ctx.autocast):
            for (t0, t1), h in zip(reversed(ctx.intervals), reversed(kept)):
                g = reverse_step(lambda x, t0=t0, t1=t1: _step(ctx.func, ctx.tableau, x, t0, t1),
                                 h, g, params, grads)
        return (g, None, None, None, *grads)


def checkpointed(func, h0: torch.Tensor, intervals, method: str,
                 params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h at the end of the accepted ``intervals``, differentiable in h0 and ``params`` with
    memory for one state per step."""
    return _CheckpointedReplay.apply(h0, func, intervals, method, *params)
