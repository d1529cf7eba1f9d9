"""Continuous depth: vector fields, solvers and gradient modes, each a registry.

A solver integrates any f(t, h) and knows nothing about attention; a field composes mixers,
MLPs and norms into f; the ODE depth module (model/depth.py) owns the solver call.
"""

from functools import partial

from .adaptive import (
    ADAPTIVE_METHODS,
    ADJOINT_FIXED,
    AdaptiveSolver,
    ODESolverError,
    solver_errors,
)
from .fields import AttentionField, ParallelField, SequentialField
from .grad import integrate
from .reversible import ReversibleHeun
from .solvers import TABLEAUS, FixedGridSolver, GatedRK2, Tableau, rk_step

FIELDS = {
    "attention": AttentionField,
    "sequential": SequentialField,
    "parallel": ParallelField,
}

SOLVERS = {
    **{name: partial(FixedGridSolver, tableau=tab) for name, tab in TABLEAUS.items()},
    "rk2_gated": GatedRK2,
    "reversible_heun": ReversibleHeun,
    **{name: partial(AdaptiveSolver, method=name) for name in ADAPTIVE_METHODS},
}

GRAD_MODES = ("direct", "adjoint", "checkpoint", "reversible")

__all__ = [
    "ADAPTIVE_METHODS", "ADJOINT_FIXED", "FIELDS", "GRAD_MODES", "SOLVERS", "TABLEAUS",
    "AdaptiveSolver", "AttentionField", "FixedGridSolver", "GatedRK2", "ODESolverError",
    "ParallelField", "ReversibleHeun", "SequentialField", "Tableau", "integrate", "rk_step",
    "solver_errors",
]
