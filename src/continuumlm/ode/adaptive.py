"""Adaptive solvers and the adjoint, through torchdiffeq.

Adaptive step-size control is torchdiffeq's (dopri5, dopri8, bosh3, fehlberg2, adaptive_heun,
and tsit5 below); the backsolve adjoint is torchdiffeq's ``odeint_adjoint``. Methods that
torchdiffeq 0.2.5 lacks are added to its method table with its own base classes, so that its
step-size controller, dense output and adjoint serve them: classical RK4 (torchdiffeq's "rk4"
is the 3/8 rule) on a fixed grid, and Tsitouras' 5(4) pair (Tsit5, the default of
DifferentialEquations.jl and diffrax) as an adaptive method.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch
import torch.nn as nn

from ..errors import ContinuumLMError
from ..registry import SOLVERS
from .solvers import TABLEAUS, combine

# our names -> the torchdiffeq method
ADAPTIVE_METHODS = {"dopri5": "dopri5", "dopri8": "dopri8", "tsit5": "continuumlm_tsit5",
                    "bosh3": "bosh3", "fehlberg2": "fehlberg2", "adaptive_heun": "adaptive_heun"}
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

    from torchdiffeq._impl.misc import Perturb

    tab = TABLEAUS["rk4"]

    class ClassicalRK4(FixedGridODESolver):
        order = 4

        def _step_func(self, func, t0, dt, t1, y0):
            # the first stage at t0 and the last at t1, each on the step's side of a
            # discontinuity there when torchdiffeq's perturb option asks for it
            ks: list[torch.Tensor] = []
            for i, c in enumerate(tab.c):
                at = t1 if c == 1.0 else t0 + c * dt
                side = (Perturb.NEXT if c == 0.0 else Perturb.PREV if c == 1.0
                        else Perturb.NONE) if self.perturb else Perturb.NONE
                ks.append(func(at, combine(y0, dt, tab.a[i], ks) if i else y0, perturb=side))
            dy = sum((dt * b) * k for b, k in zip(tab.b, ks))
            return dy, ks[0]

    _odeint_mod.SOLVERS["continuumlm_rk4"] = ClassicalRK4


# Tsitouras, "Runge-Kutta pairs of order 5(4) satisfying only the first column simplifying
# assumption", Comput. Math. Appl. 62 (2011): nodes, stages (row 7 = the fifth-order weights,
# first same as last) and the difference of the fifth- and fourth-order weights.
TSIT5_C = (0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0)
TSIT5_A = (
    (0.161,),
    (-0.008480655492356989, 0.335480655492357),
    (2.8971530571054935, -6.359448489975075, 4.3622954328695815),
    (5.325864828439257, -11.748883564062828, 7.4955393428898365, -0.09249506636175525),
    (5.86145544294642, -12.92096931784711, 8.159367898576159, -0.071584973281401,
     -0.028269050394068383),
    (0.09646076681806523, 0.01, 0.4798896504144996, 1.379008574103742, -3.290069515436081,
     2.324710524099774),
)
TSIT5_B_ERROR = (-0.00178001105222577714, -0.0008164344596567469, 0.007880878010261995,
                 -0.1447110071732629, 0.5823571654525552, -0.45808210592918697, 1 / 66)
# The continuous extension: y(t0 + s dt) = y0 + dt sum_i b_i(s) k_i, b_i(s) = sum_j P[i][j] s^(j+1).
TSIT5_DENSE = (
    (1.0, -2.763706197274826, 2.9132554618219126, -1.0530884977290216),
    (0.0, 0.1317, -0.2234, 0.1017),
    (0.0, 3.9302962368947516, -5.941033872131505, 2.490627285651253),
    (0.0, -12.411077166933676, 30.33818863028232, -16.548102889244902),
    (0.0, 37.50931341651104, -88.1789048947664, 47.37952196281928),
    (0.0, -27.896526289197286, 65.09189467479366, -34.87065786149661),
    (0.0, 1.5, -4.0, 2.5),
)


def tsit5_dense_weights(s: float) -> list[float]:
    """b_i(s) of Tsit5's continuous extension (b_i(1) are the fifth-order weights)."""
    return [sum(c * s ** (j + 1) for j, c in enumerate(row)) for row in TSIT5_DENSE]


def _register_tsit5() -> None:
    import importlib

    from torchdiffeq._impl.rk_common import RKAdaptiveStepsizeODESolver, _ButcherTableau

    # torchdiffeq's method table (see _register_classical_rk4)
    _odeint_mod = importlib.import_module("torchdiffeq._impl.odeint")
    if "continuumlm_tsit5" in _odeint_mod.SOLVERS:
        return
    f64 = dict(dtype=torch.float64)
    b = TSIT5_A[-1] + (0.0,)

    class Tsit5Solver(RKAdaptiveStepsizeODESolver):
        order = 5
        tableau = _ButcherTableau(alpha=torch.tensor(TSIT5_C, **f64),
                                  beta=[torch.tensor(row, **f64) for row in TSIT5_A],
                                  c_sol=torch.tensor(b, **f64),
                                  c_error=torch.tensor(TSIT5_B_ERROR, **f64))
        # torchdiffeq's dense output is a quartic through both ends, both slopes and this
        # midpoint value, taken here from Tsit5's own continuous extension at s = 1/2
        mid = torch.tensor(tsit5_dense_weights(0.5), **f64)

    _odeint_mod.SOLVERS["continuumlm_tsit5"] = Tsit5Solver


# torchdiffeq steps past t1 and interpolates back to it. Every adaptive solve here is made to
# end a step exactly at t1 instead (torchdiffeq's step_t), for two reasons: the interpolants
# are less accurate than a step at the tolerances asked of them (dopri8's error at t1 was a
# thousand times its tolerance; bosh3's and adaptive_heun's 50-100 times a landed step's at
# rtol 1e-7), and torchdiffeq chooses its steps without a graph, so backpropagation cannot see
# the interpolation point move with the state: only a solve that lands on t1 has the gradient
# of what it returned.
LAND_ON_T1 = set(ADAPTIVE_METHODS.values())


class AdaptiveSolver(nn.Module):
    fixed_grid = False
    reversible = False
    evals_per_step = None

    def __init__(self, cfg, method: str):
        super().__init__()
        self.method = method
        self.rtol, self.atol, self.max_steps = cfg.ode_rtol, cfg.ode_atol, cfg.ode_max_steps
        self.adjoint_norm = getattr(cfg, "ode_adjoint_norm", "default")


class _Func(nn.Module):
    """torchdiffeq wants an nn.Module (for the adjoint's parameters) with forward(t, y)."""

    def __init__(self, f, params: tuple[torch.Tensor, ...], where: str, method: str,
                 autocast: dict | None = None):
        super().__init__()
        self.f = f
        # the forward's autocast setting: the adjoint's backward solve runs outside it, and
        # would otherwise integrate the field in another precision than the forward did
        # (None: evaluate under whatever autocast setting the caller has)
        self.autocast = autocast
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
        if self.autocast is None:
            return self.f(t, y)
        with torch.autocast(**self.autocast):
            return self.f(t, y)

    def callback_step(self, t0, y0, dt):
        self.last_step, self.backward = (_number(t0), _number(dt)), False

    def callback_step_adjoint(self, t0, y0, dt):
        self.last_step, self.backward = (_number(t0), _number(dt)), True



class _RecordingFunc(_Func):
    """A field whose solve records its accepted steps (a checkpointed solve's search): every
    evaluation and torchdiffeq's accept/reject callbacks. Apart, because torchdiffeq warns when
    a solver cannot make a callback the field defines."""

    accepted = None  # an aca.AcceptedSteps

    def forward(self, t, y):
        out = super().forward(t, y)
        if self.accepted is not None:
            self.accepted.evaluated(y, out)
        return out

    def callback_accept_step(self, t0, y0, dt):
        if self.accepted is not None:
            self.accepted.accept(t0, y0, dt)

    def callback_reject_step(self, t0, y0, dt):
        if self.accepted is not None:
            self.accepted.reject()


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on the adjoint's output whose backward refuses create_graph: torchdiffeq's
    adjoint backward builds no graph, so a double backward through it (a Hessian-vector
    product, a gradient penalty) would silently miss its second-order part."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():  # backward(create_graph=True)
            raise RuntimeError(
                "the adjoint's backward solve builds no graph, so its gradient cannot be "
                "differentiated twice (create_graph=True); use ode_grad = 'direct' or, on a "
                "fixed grid, 'checkpoint'.")
        return g


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
                rtol: float = 1e-7, atol: float = 1e-9, adjoint_norm: str = "default",
                checkpoint: bool = False):
    """h(t1) of torchdiffeq's solve with ``method``. ``adjoint``: gradients by its backsolve
    adjoint; ``checkpoint``: by replaying the accepted steps (aca.py)."""
    import torchdiffeq

    # errors name the solver as the config does (tsit5, not the torchdiffeq table's name)
    name = next((k for k, v in ADAPTIVE_METHODS.items() if v == method), method)
    kind = h0.device.type
    autocast = dict(device_type=kind, enabled=torch.is_autocast_enabled(kind),
                    dtype=torch.get_autocast_dtype(kind))
    func = (_RecordingFunc if checkpoint else _Func)(f, params, where, name, autocast)
    # float64 time for a float64 state (float32 would round the interval, e.g. 0.1); float32
    # otherwise, as torchdiffeq casts it to the state's dtype anyway
    t = torch.tensor([t0, t1], device=h0.device,
                     dtype=torch.float64 if h0.dtype == torch.float64 else torch.float32)
    options = dict(options or {})
    backward_options = dict(options)  # max_num_steps; the backward solve ends where it ends
    if method in LAND_ON_T1:  # every adaptive method (a checkpointed one's steps end there)
        options["step_t"] = t[1:]
    if method in LAND_ON_T1:  # the adjoint's backward solve lands on t0 for the same reason
        backward_options["step_t"] = t[:1]  # (torchdiffeq flips it with the reversed interval)
    kwargs = dict(method=method, rtol=rtol, atol=atol, options=options)
    try:
        if adjoint:
            if adjoint_norm == "seminorm":
                backward_options["norm"] = "seminorm"
            out = _NoDoubleBackward.apply(torchdiffeq.odeint_adjoint(
                func, h0, t, adjoint_params=tuple(params), adjoint_options=backward_options,
                **kwargs))
        elif checkpoint:
            from .aca import AcceptedSteps, checkpointed

            func.accepted = accepted = AcceptedSteps(t[1], method, h0)
            with torch.no_grad():  # the one solve: its accepted steps are kept for the backward
                torchdiffeq.odeint(func, h0, t, **kwargs)
            func.accepted = None
            return checkpointed(func, h0, accepted, tuple(params))
        else:
            out = torchdiffeq.odeint(func, h0, t, **kwargs)
    except AssertionError as e:
        if _is_solver_assertion(e):
            raise _solver_error(func, str(e)) from None
        raise
    return out[-1]


for _name, _method in ADAPTIVE_METHODS.items():
    SOLVERS.register(_name, partial(AdaptiveSolver, method=_method))

# torchdiffeq's table holds both methods as soon as this module is imported (import
# continuumlm.ode, or anything that builds a model), not only after a first solve
_register_classical_rk4()
_register_tsit5()
