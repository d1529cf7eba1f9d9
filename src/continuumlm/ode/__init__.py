"""Continuous depth: vector fields, solvers and gradient modes, each a registry.

A solver integrates any f(t, h) and knows nothing about attention; a field composes mixers,
MLPs and norms into f; the ODE depth module (model/depth.py) owns the solver call.
"""

# FIELDS and SOLVERS (continuumlm.registry) are filled by the modules above, each of which
# registers its own classes: fields.py the three fields; solvers.py the Butcher tableaus and
# rk2_gated; reversible.py reversible_heun; adaptive.py torchdiffeq's adaptive methods.
from ..config import GRAD_MODES  # noqa: E402 - the config validates it
from ..registry import FIELDS, SOLVERS
from .adaptive import (
    ADAPTIVE_METHODS,
    ADJOINT_FIXED,
    AdaptiveSolver,
    ODESolverError,
    solver_errors,
)
from .fields import AttentionField, ParallelField, SequentialField
from .grad import integrate
from .reversible import ReversibleError, ReversibleHeun
from .solvers import TABLEAUS, FixedGridSolver, GatedRK2, Tableau, rk_step

__all__ = [
    "ADAPTIVE_METHODS", "ADJOINT_FIXED", "FIELDS", "GRAD_MODES", "SOLVERS", "TABLEAUS",
    "AdaptiveSolver", "AttentionField", "FixedGridSolver", "GatedRK2", "ODESolverError",
    "ParallelField", "ReversibleError", "ReversibleHeun", "SequentialField", "Tableau", "integrate", "rk_step",
    "solver_errors",
]
