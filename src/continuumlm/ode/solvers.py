"""Fixed-grid solvers, each written once as a Butcher tableau, plus the gated RK2 block.

A solver knows nothing about attention: it advances any ``f(t, h)`` over a uniform grid.
Zero tableau coefficients are skipped, so an Euler step costs exactly one evaluation and one
fused multiply-add, the same as a residual layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

from ..registry import SOLVERS, register_solver


@dataclass(frozen=True)
class Tableau:
    """Explicit Runge–Kutta method: stage i evaluates f(t + c_i dt, h + dt sum_j a_ij k_j)."""

    name: str
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    c: tuple[float, ...]
    order: int

    @property
    def stages(self) -> int:
        return len(self.b)


TABLEAUS: dict[str, Tableau] = {
    "euler": Tableau("euler", ((),), (1.0,), (0.0,), 1),
    "midpoint": Tableau("midpoint", ((), (0.5,)), (0.0, 1.0), (0.0, 0.5), 2),
    "heun": Tableau("heun", ((), (1.0,)), (0.5, 0.5), (0.0, 1.0), 2),
    # classical Runge–Kutta, weights 1/6, 1/3, 1/3, 1/6
    "rk4": Tableau("rk4", ((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
                   (1 / 6, 1 / 3, 1 / 3, 1 / 6), (0.0, 0.5, 0.5, 1.0), 4),
    # Kutta's 3/8 rule, which is what torchdiffeq calls "rk4"
    "rk4_38": Tableau("rk4_38", ((), (1 / 3,), (-1 / 3, 1.0), (1.0, -1.0, 1.0)),
                      (1 / 8, 3 / 8, 3 / 8, 1 / 8), (0.0, 1 / 3, 2 / 3, 1.0), 4),
}


def combine(h: torch.Tensor, dt, coeffs, ks) -> torch.Tensor:
    out = h
    for coef, k in zip(coeffs, ks):
        if coef != 0.0:
            if torch.is_tensor(dt):  # a time grid that requires grad (torchdiffeq's)
                out = out + (dt * coef) * k
            else:
                out = torch.add(out, k, alpha=dt * coef)  # one fused op per term
    return out


def rk_stages(f, t: float, h: torch.Tensor, dt: float, tab: Tableau) -> list[torch.Tensor]:
    """The stage derivatives k_i of one step."""
    ks: list[torch.Tensor] = []
    for i in range(tab.stages):
        hi = combine(h, dt, tab.a[i], ks) if i else h
        ks.append(f(t + tab.c[i] * dt, hi))
    return ks


def rk_step(f, t: float, h: torch.Tensor, dt: float, tab: Tableau) -> torch.Tensor:
    return combine(h, dt, tab.b, rk_stages(f, t, h, dt, tab))


class FixedGridSolver(nn.Module):
    """A Butcher-tableau method on ``steps`` uniform steps. Holds no parameters."""

    fixed_grid = True
    reversible = False

    def __init__(self, cfg, tableau: Tableau):
        super().__init__()
        self.tableau = tableau

    @property
    def evals_per_step(self) -> int:
        return self.tableau.stages

    def step(self, f, t: float, h: torch.Tensor, dt: float) -> torch.Tensor:
        return rk_step(f, t, h, dt, self.tableau)


@register_solver("rk2_gated")
class GatedRK2(nn.Module):
    """The RK2 block of the ODE Transformer (Li et al., ACL 2022) with a learned gate:

        F1 = f(t, y),  F2 = f(t + dt, y + dt F1),  y' = y + dt (g F1 + (1 - g) F2),
        g = sigmoid(Linear([F1; F2]))  — one scalar per token.

    With g = 1/2 this is Heun's method. The gate is one module per ODE block, shared by every
    step, so the parameter count does not depend on ``ode_steps``.
    """

    fixed_grid = True
    reversible = False
    evals_per_step = 2

    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(2 * cfg.hidden_size, 1)
        self.gate.keep_init = True
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)  # starts as Heun's method

    def step(self, f, t: float, h: torch.Tensor, dt: float) -> torch.Tensor:
        f1 = f(t, h)
        f2 = f(t + dt, h + dt * f1)
        g = torch.sigmoid(self.gate(torch.cat([f1, f2], dim=-1)))
        return h + dt * (g * f1 + (1 - g) * f2)


for _name, _tab in TABLEAUS.items():
    SOLVERS.register(_name, partial(FixedGridSolver, tableau=_tab))


def grid(t0: float, t1: float, steps: int) -> list[float]:
    dt = (t1 - t0) / steps
    return [t0 + i * dt for i in range(steps)]
