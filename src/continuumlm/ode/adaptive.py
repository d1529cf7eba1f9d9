"""Adaptive solvers and the adjoint, through torchdiffeq.

Adaptive step-size control is torchdiffeq's (dopri5, bosh3, adaptive_heun); the backsolve
adjoint is torchdiffeq's ``odeint_adjoint``. Our fixed-grid tableaus that torchdiffeq lacks
(classical RK4; torchdiffeq's "rk4" is the 3/8 rule) are registered with its fixed-grid base
class so that the adjoint can integrate them too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ContinuumLMError
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

    def __init__(self, f, params: tuple[torch.Tensor, ...]):
        super().__init__()
        self.f = f
        self.plist = nn.ParameterList([p for p in params if isinstance(p, nn.Parameter)])
        self.times: list[float] = []

    def forward(self, t, y):
        tf = float(t.detach()) if torch.is_tensor(t) else float(t)
        self.times.append(tf)
        return self.f(tf, y)


def odeint_call(f, h0: torch.Tensor, t0: float, t1: float, method: str, adjoint: bool,
                params: tuple[torch.Tensor, ...], where: str, options: dict | None = None,
                rtol: float = 1e-7, atol: float = 1e-9):
    import torchdiffeq

    func = _Func(f, params)
    t = torch.tensor([t0, t1], dtype=torch.float32, device=h0.device)
    kwargs = dict(method=method, rtol=rtol, atol=atol, options=options or {})
    try:
        if adjoint:
            out = torchdiffeq.odeint_adjoint(func, h0, t, adjoint_params=tuple(params), **kwargs)
        else:
            out = torchdiffeq.odeint(func, h0, t, **kwargs)
    except AssertionError as e:
        msg = str(e)
        if "max_num_steps" in msg or "underflow" in msg:
            ts = func.times
            last = ts[-1] if ts else t0
            step = abs(ts[-1] - ts[-2]) if len(ts) > 1 else float("nan")
            raise ODESolverError(
                f"{where}: the adaptive solver {method} stopped at t = {last:.6g} with step size "
                f"{step:.3g} ({msg}); the field is stiff or non-finite there. Raise "
                f"model.ode_max_steps or ode_rtol/ode_atol, or use a fixed-grid solver.") from None
        raise
    return out[-1]
