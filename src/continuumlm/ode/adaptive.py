"""Adaptive solvers and the adjoint, through torchdiffeq.

Adaptive step-size control is torchdiffeq's (dopri5, bosh3, adaptive_heun); the backsolve
adjoint is torchdiffeq's ``odeint_adjoint``. Our fixed-grid tableaus that torchdiffeq lacks
(classical RK4; torchdiffeq's "rk4" is the 3/8 rule) are registered with its fixed-grid base
class so that the adjoint can integrate them too.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch
import torch.nn as nn

from ..errors import ContinuumLMError
from ..registry import SOLVERS
from .solvers import TABLEAUS, rk_stages

ADAPTIVE_METHODS = ("dopri5", "bosh3", "adaptive_heun")
# our fixed-grid names -> the torchdiffeq method used by the adjoint
ADJOINT_FIXED = {"euler": "euler", "midpoint": "midpoint", "heun": "heun2", "rk4_38": "rk4",
                 "rk4": "continuumlm_rk4"}


class ODESolverError(ContinuumLMError, RuntimeError):
    """An adaptive solve that could not finish (too many steps, step size underflow)."""


def _register_classical_rk4() -> None:
    import importlib

    from torchdiffeq._impl.solvers import FixedGridODESolver

    # torchdiffeq keeps its method table in this module; adding an entry is how a fixed-grid
    # method it lacks becomes usable by odeint and odeint_adjoint.
    _odeint_mod = importlib.import_module("torchdiffeq._impl.odeint")

    if "continuumlm_rk4" in _odeint_mod.SOLVERS:
        return

    class ClassicalRK4(FixedGridODESolver):
        order = 4

        def _step_func(self, func, t0, dt, t1, y0):
            ks = rk_stages(func, t0, y0, dt, TABLEAUS["rk4"])
            dy = sum((dt * b) * k for b, k in zip(TABLEAUS["rk4"].b, ks))
            return dy, ks[0]

    _odeint_mod.SOLVERS["continuumlm_rk4"] = ClassicalRK4


class AdaptiveSolver(nn.Module):
    fixed_grid = False
    reversible = False
    evals_per_step = None

    def __init__(self, cfg, method: str):
        super().__init__()
        self.method = method
        self.rtol, self.atol, self.max_steps = cfg.ode_rtol, cfg.ode_atol, cfg.ode_max_steps


class _Func(nn.Module):
    """torchdiffeq wants an nn.Module (for the adjoint's parameters) with forward(t, y)."""

    def __init__(self, f, params: tuple[torch.Tensor, ...], where: str, method: str):
        super().__init__()
        self.f = f
        self.where, self.method = where, method
        self.plist = nn.ParameterList([p for p in params if isinstance(p, nn.Parameter)])
        self.last_step: tuple[float, float] | None = None  # the step last attempted: (t, dt)
        self.backward = False

    def forward(self, t, y):
        global _active
        _active = weakref.ref(self)  # a weak reference: the solve's closure is not kept alive
        # t stays a tensor: an adaptive solver's step sizes depend on the state, and a field
        # that reads t (the time embedding) must see that dependence for direct backprop to
        # give the gradient of what was computed
        return self.f(t, y)

    def callback_step(self, t0, y0, dt):
        self.last_step, self.backward = (_number(t0), _number(dt)), False

    def callback_step_adjoint(self, t0, y0, dt):
        self.last_step, self.backward = (_number(t0), _number(dt)), True


def _number(x) -> float:
    return float(x.detach()) if torch.is_tensor(x) else float(x)


_active: weakref.ref | None = None  # the solve whose field ran last (forward or adjoint backward)


def _solver_error(func: _Func | None, message: str) -> ODESolverError:
    where = func.where if func is not None else "an ODE block"
    method = func.method if func is not None else "adaptive"
    phase = "the backward (adjoint) solve" if func is not None and func.backward else "the solve"
    at = (f" at t = {func.last_step[0]:.6g} with step size {func.last_step[1]:.3g}"
          if func is not None and func.last_step is not None else "")
    return ODESolverError(
        f"{where}: {phase} of the adaptive solver {method} stopped{at} ({message}); the field "
        f"is stiff or non-finite there. Raise model.ode_max_steps or ode_rtol/ode_atol, or use "
        f"a fixed-grid solver.")


def _is_solver_assertion(e: AssertionError) -> bool:
    return "max_num_steps" in str(e) or "underflow" in str(e)


@contextlib.contextmanager
def solver_errors():
    """Turn torchdiffeq's step-limit assertions raised during ``loss.backward()`` (the
    adjoint's backward solve runs inside autograd, past ``odeint_call``) into
    :class:`ODESolverError`. Wrap backward calls of models that may use ``ode_grad =
    'adjoint'`` with an adaptive solver."""
    try:
        yield
    except AssertionError as e:
        if not _is_solver_assertion(e):
            raise
        raise _solver_error(_active() if _active is not None else None, str(e)) from None


def odeint_call(f, h0: torch.Tensor, t0: float, t1: float, method: str, adjoint: bool,
                params: tuple[torch.Tensor, ...], where: str, options: dict | None = None,
                rtol: float = 1e-7, atol: float = 1e-9):
    import torchdiffeq

    func = _Func(f, params, where, method)
    # float64 time for a float64 state (float32 would round the interval, e.g. 0.1); float32
    # otherwise, as torchdiffeq casts it to the state's dtype anyway
    t = torch.tensor([t0, t1], device=h0.device,
                     dtype=torch.float64 if h0.dtype == torch.float64 else torch.float32)
    kwargs = dict(method=method, rtol=rtol, atol=atol, options=options or {})
    try:
        if adjoint:
            # the backward solve takes the same options (max_num_steps) by default
            out = torchdiffeq.odeint_adjoint(func, h0, t, adjoint_params=tuple(params), **kwargs)
        else:
            out = torchdiffeq.odeint(func, h0, t, **kwargs)
    except AssertionError as e:
        if _is_solver_assertion(e):
            raise _solver_error(func, str(e)) from None
        raise
    return out[-1]


for _method in ADAPTIVE_METHODS:
    SOLVERS.register(_method, partial(AdaptiveSolver, method=_method))
