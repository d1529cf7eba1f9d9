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

The forward pass costs one solve: the controller's search keeps, for every accepted step, its
start, size and end, its starting state and the derivative torchdiffeq began it with (the first
evaluation for the first step; for the others the last stage of the step before, which is
f(t_k, h_k) for the first-same-as-last pairs and an intermediate stage's evaluation for
adaptive_heun and fehlberg2), and the state it ended in. The steps are taken again with
torchdiffeq's own Runge-Kutta step and tableau (``_runge_kutta_step`` and the solver class's
``tableau``: torchdiffeq exposes no public step API) from exactly those inputs, so each
replayed step is bit for bit the step the search took, and the gradient is exactly that of the
state returned. The derivative a step hands the next is part of the replayed chain: the
backward carries its gradient from each step to the one before.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _method_tableau(method: str, like: torch.Tensor):
    import importlib

    from torchdiffeq._impl.rk_common import _ButcherTableau

    solvers = importlib.import_module("torchdiffeq._impl.odeint").SOLVERS
    tab = solvers[method].tableau
    cast = dict(device=like.device, dtype=like.dtype)
    return _ButcherTableau(alpha=tab.alpha.to(**cast), beta=[b.to(**cast) for b in tab.beta],
                           c_sol=tab.c_sol.to(**cast), c_error=tab.c_error.to(**cast))


class AcceptedSteps:
    """Fed by a recording field (``evaluated``) and torchdiffeq's step callbacks (``accept``,
    ``reject``) during the search: per accepted step (t0, dt, t1), its start state and
    starting derivative, and the last step's end state (``final``)."""

    def __init__(self, t_end: torch.Tensor, method: str, like: torch.Tensor) -> None:
        self.t_end = t_end
        self.tableau = _method_tableau(method, like)
        tab = self.tableau
        self.fsal = bool(tab.c_sol[-1] == 0 and (tab.c_sol[:-1] == tab.beta[-1]).all())
        self.stages = len(tab.alpha)  # evaluations per attempt after the starting derivative
        self.starts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (t0, dt)
        self.states: list[torch.Tensor] = []  # h at each accepted step's start
        self.derivs: list[torch.Tensor] = []  # the derivative each accepted step began with
        self.final: torch.Tensor | None = None
        self._f0: torch.Tensor | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, output) since

    def evaluated(self, y: torch.Tensor, out: torch.Tensor) -> None:
        if self._f0 is None:  # torchdiffeq's first evaluation: f(t0, h0), the first step's
            self._f0 = out.to(y.dtype)
        self._pending.append((y, out))

    def accept(self, t0, y0, dt) -> None:
        stages = self._pending[-self.stages:]
        self.starts.append((t0.detach().clone(), dt.detach().clone()))
        self.states.append(y0)
        self.derivs.append(self._f0)
        if self.fsal:  # the last stage was evaluated at the step's end state itself
            self.final = stages[-1][0]
        else:  # as torchdiffeq forms it from the stages
            k = torch.stack([self._f0] + [o.to(y0.dtype) for _, o in stages], dim=-1)
            step = dt.to(y0.abs().dtype)
            self.final = y0 + torch.sum(k * (step * self.tableau.c_sol), dim=-1).view_as(y0)
        self._f0 = stages[-1][1].to(y0.dtype)
        self._pending = []

    def reject(self) -> None:
        self._pending = []

    def steps(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(t0, dt, t1) of every accepted step; t1 is the next step's start (the end of the
        interval for the last: every checkpointed solve lands on it)."""
        ends = [t0 for t0, _ in self.starts[1:]] + [self.t_end.to(self.starts[-1][0].dtype)]
        return [(t0, dt, t1) for (t0, dt), t1 in zip(self.starts, ends)]


def _first_derivative(func, h: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
    from torchdiffeq._impl.misc import _PerturbFunc

    return _PerturbFunc(func)(t0, h).to(h.dtype)


def _step(func, tableau, h: torch.Tensor, f0: torch.Tensor, step) -> tuple:
    """One accepted step from (h, f0): (end state, the derivative the next step begins with)."""
    from torchdiffeq._impl.misc import _PerturbFunc
    from torchdiffeq._impl.rk_common import _runge_kutta_step

    t0, dt, t1 = step
    y1, f1, _, _ = _runge_kutta_step(_PerturbFunc(func), h, f0, t0, dt, t1, tableau)
    return y1, f1


def replay(func, h0: torch.Tensor, steps, method: str) -> torch.Tensor:
    """The accepted steps taken again, differentiably, from h0 (the reference the checkpointed
    backward is held to)."""
    tableau = _method_tableau(method, h0)
    h, f = h0, _first_derivative(func, h0, steps[0][0])
    for step in steps:
        h, f = _step(func, tableau, h, f, step)
    return h


class _CheckpointedSteps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h0, func, accepted, *params):
        ctx.func, ctx.steps, ctx.tableau = func, accepted.steps(), accepted.tableau
        # the backward recomputes each step under the forward's autocast setting, or it would
        # differentiate another function than the one that made the output
        kind = h0.device.type
        ctx.autocast = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                            dtype=torch.get_autocast_dtype(kind))
        ctx.save_for_backward(*params, *accepted.states, *accepted.derivs)
        ctx.num_params = len(params)
        return accepted.final.clone()

    @staticmethod
    @once_differentiable  # its vjps build no graph: a double backward would be wrong
    def backward(ctx, g):
        saved = ctx.saved_tensors
        n, m = ctx.num_params, len(ctx.steps)
        params, states, derivs = saved[:n], saved[n:n + m], saved[n + m:]
        live = [p for p in params if p.requires_grad]
        grads: list[torch.Tensor | None] = [None] * n

        def add(got) -> None:
            it = iter(got)
            for k, p in enumerate(params):
                if p.requires_grad:
                    d = next(it)
                    if d is not None:
                        grads[k] = d if grads[k] is None else grads[k] + d

        g_f = None  # the gradient at the derivative the step after began with
        with torch.autocast(**ctx.autocast):
            for k in range(m - 1, -1, -1):
                with torch.enable_grad():
                    h = states[k].detach().requires_grad_(True)
                    f = derivs[k].detach().requires_grad_(True)
                    y1, f1 = _step(ctx.func, ctx.tableau, h, f, ctx.steps[k])
                outs, cots = [y1], [g]
                if g_f is not None:
                    outs.append(f1)
                    cots.append(g_f)
                got = torch.autograd.grad(outs, [h, f, *live], cots, allow_unused=True)
                g = got[0] if got[0] is not None else torch.zeros_like(h)
                g_f = got[1] if got[1] is not None else torch.zeros_like(f)
                add(got[2:])
            # the first step's derivative is f(t0, h0): its gradient goes into h0 and the
            # parameters
            with torch.enable_grad():
                h = states[0].detach().requires_grad_(True)
                f0 = _first_derivative(ctx.func, h, ctx.steps[0][0])
            got = torch.autograd.grad([f0], [h, *live], [g_f], allow_unused=True)
            if got[0] is not None:
                g = g + got[0]
            add(got[1:])
        return (g, None, None, *grads)


def checkpointed(func, h0: torch.Tensor, accepted: AcceptedSteps,
                 params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The state the search ended in, differentiable in h0 and ``params`` through the accepted
    steps replayed one at a time (memory: a state and a derivative per step)."""
    return _CheckpointedSteps.apply(h0, func, accepted, *params)
