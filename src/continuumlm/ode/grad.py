"""One entry point, ``integrate``, for every solver and gradient mode; the gradient modes, each
registered by its ``model.ode_grad`` name (``registry.GRADS``) with the solvers it refuses:

- ``direct``: autograd through every solver operation (memory grows with steps);
- ``checkpoint``: each step is recomputed in backward (torch.utils.checkpoint), only the states
  at step boundaries are stored; gradients are exact; with an adaptive solver, the accepted
  steps are recorded and replayed (aca.py), gradients exact for the computed solution;
- ``binomial``: binomial checkpointing (binomial.py): ``checkpoints`` states kept, the rest
  recomputed on the Revolve schedule; exact gradients, memory independent of the steps;
- ``adjoint``: torchdiffeq's backsolve adjoint, O(1) memory in steps, gradients approximate;
- ``reversible``: the reversible Heun backward that rebuilds states (see reversible.py).
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import checkpoint

from ..registry import GRADS
from .adaptive import ADAPTIVE_METHODS, ADJOINT_FIXED, AdaptiveSolver, odeint_call
from .binomial import MAX_STEPS as MAX_BINOMIAL_STEPS
from .binomial import default_checkpoints, integrate_binomial
from .solvers import grid


class GradMode:
    """One way for gradients to pass through a solve, registered in ``registry.GRADS`` under
    its ``model.ode_grad`` name: which solvers it refuses (:meth:`refusal`, one sentence with
    the way out), how a fixed-grid solve runs with it when a gradient is needed (:meth:`fixed`),
    and what an adaptive solve does for it (``adaptive_backward``: "adjoint", the backsolve;
    "checkpoint", the accepted steps replayed; None, autograd through the solver).
    ``keeps_steps``: the states between fixed-grid steps stay in the graph (``observe``)."""

    adaptive_backward: str | None = None
    keeps_steps = False

    def refusal(self, solver: str, adaptive: bool, reversible: bool,
                steps: int | None) -> str | None:
        return None

    def fixed(self, solver, f, h0, t0: float, t1: float, times, dt, params, steps: int,
              checkpoints: int, observe, where: str) -> torch.Tensor:
        return _steps(solver.step, f, h0, times, dt, observe)


def _steps(step, f, h0, times, dt, observe) -> torch.Tensor:
    """The fixed grid's steps one after another; ``observe(n, h)`` after every one but the last."""
    h = h0
    for n, t in enumerate(times):
        h = step(f, t, h, dt)
        if observe is not None and n + 1 < len(times):
            observe(n, h)
    return h


def _not_for_reversible(grad: str, solver: str) -> str:
    return (f"ode_grad = {grad!r} is not implemented for {solver!r}: use ode_grad = "
            f"'reversible' (exact gradients, memory constant in the steps, less than "
            f"checkpointing stores) or 'direct'.")


@GRADS.register("direct")
class Direct(GradMode):
    """Autograd through every solver operation (memory grows with the steps)."""

    keeps_steps = True


@GRADS.register("checkpoint")
class Checkpointed(GradMode):
    """Each fixed-grid step recomputed in the backward (only step-boundary states stored); an
    adaptive solve's accepted steps recorded and replayed (aca.py). Exact gradients."""

    adaptive_backward = "checkpoint"
    keeps_steps = True

    def refusal(self, solver, adaptive, reversible, steps):
        return _not_for_reversible("checkpoint", solver) if reversible else None

    def fixed(self, solver, f, h0, t0, t1, times, dt, params, steps, checkpoints, observe,
              where):
        def step(f, t, h, dt):
            return checkpoint(solver.step, f, t, h, dt, use_reentrant=False)

        return _steps(step, f, h0, times, dt, observe)


@GRADS.register("binomial")
class Binomial(GradMode):
    """Binomial checkpointing (binomial.py): ``checkpoints`` states kept, the rest recomputed
    on the Revolve schedule; exact gradients, memory independent of the steps."""

    def refusal(self, solver, adaptive, reversible, steps):
        if reversible:
            return _not_for_reversible("binomial", solver)
        if adaptive:
            return ("ode_grad = 'binomial' needs a fixed-grid solver (its schedule is planned "
                    "from the number of steps); with an adaptive solver use 'checkpoint' (the "
                    "accepted steps replayed: exact gradients), 'adjoint' or 'direct'.")
        if steps is not None and steps > MAX_BINOMIAL_STEPS:
            return (f"ode_grad = 'binomial' plans at most {MAX_BINOMIAL_STEPS} steps, not "
                    f"ode_steps = {steps}; use 'checkpoint'.")
        return None

    def fixed(self, solver, f, h0, t0, t1, times, dt, params, steps, checkpoints, observe,
              where):
        return integrate_binomial(lambda i, h: solver.step(f, times[i], h, dt), h0, steps,
                                  checkpoints or default_checkpoints(steps), params)


@GRADS.register("adjoint")
class Adjoint(GradMode):
    """torchdiffeq's backsolve adjoint: memory constant in the steps, the gradient of the
    continuous ODE (off from the computed steps' by the discretization error)."""

    adaptive_backward = "adjoint"

    def refusal(self, solver, adaptive, reversible, steps):
        if not (adaptive or solver in ADJOINT_FIXED):
            return (f"ode_grad = 'adjoint' works with {', '.join(sorted(ADJOINT_FIXED))} and "
                    f"the adaptive solvers, not {solver!r}; use ode_grad = 'direct' or "
                    f"'checkpoint' (or 'reversible' with reversible_heun).")
        return None

    def fixed(self, solver, f, h0, t0, t1, times, dt, params, steps, checkpoints, observe,
              where):
        method = ADJOINT_FIXED[solver.tableau.name]
        _warn_low_order_adjoint(solver.tableau)

        # only h(t1) is returned and stored; the grid fixes the number of steps exactly (a
        # step_size can round into an extra step). The adjoint calls it again on the reversed,
        # negated interval, so it is built from the interval it is given.
        def grid_constructor(func, y0, t):
            return torch.linspace(float(t[0]), float(t[-1]), steps + 1, dtype=t.dtype,
                                  device=t.device)

        return odeint_call(f, h0, t0, t1, method, True, params, where,
                           options={"grid_constructor": grid_constructor})


@GRADS.register("reversible")
class Reversible(GradMode):
    """The reversible Heun backward, which rebuilds the states from the final one
    (reversible.py): exact gradients, memory constant in the steps."""

    def refusal(self, solver, adaptive, reversible, steps):
        if not reversible:
            return (f"ode_grad = 'reversible' needs an algebraically reversible solver, and "
                    f"{solver!r} is not; use ode_solver = 'reversible_heun' (or another "
                    f"ode_grad: direct, checkpoint, adjoint).")
        return None


def integrate(f, h0: torch.Tensor, t0: float, t1: float, solver, steps: int, grad: str,
              params: tuple[torch.Tensor, ...] = (), where: str = "ODE block",
              checkpoints: int = 0, observe=None) -> torch.Tensor:
    """Integrate dh/dt = f(t, h) from t0 to t1 and return h(t1). ``params``: every tensor with
    a gradient that f (and the solver) read; ``checkpoints``: states kept by ``binomial``
    (0: about log2 of the steps); ``observe(n, h)``: called with the state after every step n
    but the last, in the graph (fixed-grid solvers, ``direct`` or ``checkpoint`` only: the
    other modes keep no graph of the steps)."""
    _check_mode(solver, grad)
    mode = GRADS[grad]()
    needs_grad = torch.is_grad_enabled() and (h0.requires_grad or any(p.requires_grad for p in params))
    if observe is not None and (isinstance(solver, AdaptiveSolver)
                                or getattr(solver, "reversible", False)
                                or not mode.keeps_steps):
        raise ValueError(f"the states between solver steps are kept only by a fixed-grid, "
                         f"non-reversible solver with ode_grad 'direct' or 'checkpoint' "
                         f"(here {getattr(solver, 'method', type(solver).__name__)!s}, "
                         f"{grad!r}).")
    if isinstance(solver, AdaptiveSolver):
        backward = mode.adaptive_backward if needs_grad else None
        return odeint_call(f, h0, t0, t1, solver.method, backward == "adjoint", params,
                           where, options={"max_num_steps": solver.max_steps},
                           checkpoint=backward == "checkpoint",
                           rtol=solver.rtol, atol=solver.atol,
                           adjoint_norm=getattr(solver, "adjoint_norm", "default"))
    dt = (t1 - t0) / steps
    times = grid(t0, t1, steps)
    if getattr(solver, "reversible", False):  # reversible Heun, or a plugin's reversible solver
        if grad not in ("direct", "reversible"):  # never a silent switch to direct backprop
            raise ValueError(f"ode_grad = {grad!r} is not implemented for a reversible solver; "
                             f"use 'reversible' or 'direct'.")
        if grad == "reversible" and needs_grad:
            return solver.integrate_reversible(f, h0, times, dt, params)
        return solver.integrate_direct(f, h0, times, dt)
    if not needs_grad:
        return _steps(solver.step, f, h0, times, dt, observe)
    return mode.fixed(solver, f, h0, t0, t1, times, dt, params, steps, checkpoints, observe,
                      where)


_WARNED_ADJOINT: set[str] = set()


def _warn_low_order_adjoint(tableau) -> None:
    """Once per method and process: the backsolve adjoint differentiates the continuous ODE,
    so on a fixed grid of low order its gradient is far from that of the steps computed
    (8 steps on [0, 1]: Euler 16%, midpoint 0.3%, heun 0.06%, rk4 2e-6)."""
    if tableau.order >= 4 or tableau.name in _WARNED_ADJOINT:
        return
    _WARNED_ADJOINT.add(tableau.name)
    logging.getLogger("continuumlm").warning(
        "ode_grad = 'adjoint' with the order-%d solver %s: the backsolve adjoint's gradient is "
        "that of the continuous ODE, off from the gradient of the computed steps by the "
        "solver's discretization error (about 16%% for Euler at 8 steps). Use ode_grad = "
        "'checkpoint' or 'binomial' for the exact gradient at the same memory order, or rk4.",
        tableau.order, tableau.name)


def refusal(solver: str, grad: str, adaptive: bool, reversible: bool,
            steps: int | None = None) -> str | None:
    """Why the solver named ``solver`` (adaptive, reversible: its protocol's class attributes)
    cannot be integrated with gradient mode ``grad`` over ``steps`` steps, in one sentence
    with the way out; None when it can. Each mode states its own rules above; the model's
    config check (``ODEStack.check_config``, which elastic training's drawn solves go through
    too) and :func:`integrate` both read them here."""
    if grad not in GRADS:
        return GRADS.unknown_message(grad)
    return GRADS[grad]().refusal(solver, adaptive, reversible, steps)


def _check_mode(solver, grad: str) -> None:
    """Refuse a gradient mode the solver does not implement, rather than fall back to direct
    backprop without a word."""
    method = getattr(solver, "method", None)  # torchdiffeq's name; the config's is shown
    name = (next((k for k, v in ADAPTIVE_METHODS.items() if v == method), method)
            or getattr(getattr(solver, "tableau", None), "name", None) or type(solver).__name__)
    why = refusal(name, grad, isinstance(solver, AdaptiveSolver),
                  bool(getattr(solver, "reversible", False)))
    if why is not None:
        raise ValueError(why)
