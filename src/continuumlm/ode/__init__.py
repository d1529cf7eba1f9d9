"""ODE numerics: solvers and gradient modes. A solver integrates any f(t, h) and knows nothing
about attention; the vector fields, which compose mixers, MLPs and norms into f, are the
model's (model/fields.py), and the ODE depth module (model/depth.py) owns the solver call.
"""

# SOLVERS (continuumlm.registry) is filled by the modules below, each of which registers its
# own classes: solvers.py the Butcher tableaus and rk2_gated; reversible.py reversible_heun;
# adaptive.py torchdiffeq's adaptive methods.
from ..config import GRAD_MODES  # noqa: E402 - the config validates it
from ..registry import SOLVERS
from .adaptive import (
    ADAPTIVE_METHODS,
    ADJOINT_FIXED,
    AdaptiveSolver,
    ODESolverError,
    solver_errors,
)
from .grad import integrate
from .reversible import ReversibleError, ReversibleHeun
from .solvers import TABLEAUS, FixedGridSolver, GatedRK2, Tableau, rk_step

__all__ = [
    "ADAPTIVE_METHODS", "ADJOINT_FIXED", "GRAD_MODES", "SOLVERS", "TABLEAUS",
    "AdaptiveSolver", "FixedGridSolver", "GatedRK2", "ODESolverError", "ReversibleError",
    "ReversibleHeun", "Tableau", "integrate", "rk_step", "solver_errors",
]
