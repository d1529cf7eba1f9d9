"""[train.regularize]: what training adds to an ODE model's solve beyond the loss, the kinetic
and Jacobian integrals, the read-outs of intermediate solver steps, and STEER's drawn end time
(RegularizeConfig, implemented by ``train/elastic.SolveRegularizers`` and the model's
``depth.extras``); with the checks against the model's solve."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from ..registry import SOLVERS
from .checks import _validate


@dataclass
class RegularizeConfig:
    """Regularizers of the solve, and STEER."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    kinetic_weight: float = 0.0
    """ODE models: add this weight times the kinetic energy of the solve, the integral of
    ||f||^2 / hidden_size over t per token, averaged (Finlay et al. 2020): straighter
    trajectories that adaptive solvers take in fewer steps. Adaptive solvers only (a fixed
    grid takes the same steps whatever the field). Logged as "kinetic". (Before:
    train.kinetic_weight.)"""
    jacobian_weight: float = 0.0
    """ODE models: add this weight times the integral of ||df/dh||_F^2 / hidden_size along the
    solve, estimated with one Gaussian probe per forward (Hutchinson; one extra
    vector-Jacobian product per evaluation). Adaptive solvers only, as kinetic_weight.
    Logged as "jacobian". (Before: train.jacobian_weight.)"""
    step_readout_weight: float = 0.0
    """ODE models with a fixed-grid solver: add this weight times the mean cross-entropy of the
    read-out (final norm + head) of every intermediate solver step's state, in every block
    (deep supervision along depth: a solve that is good at every step, which per-token exit,
    eval --exit-threshold, needs). Needs model.ode_grad = "direct" or "checkpoint" and at
    least two steps. Logged as "step_readout". (Before: train.step_readout_weight.)"""
    steer: float = 0.0
    """ODE models: STEER (Ghosh et al. 2020) draws each training step's end time uniformly from
    [ode_t1 - steer, ode_t1 + steer] (from the seed and the step, so a resumed run and every
    rank draw alike); evaluation integrates to ode_t1. Must be below ode_t1 - ode_t0.
    (Before: train.steer.)"""

    def __post_init__(self) -> None:
        _validate(self, "train.regularize")
        for name in ("kinetic_weight", "jacobian_weight", "step_readout_weight", "steer"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train.regularize.{name} must be >= 0, got "
                                  f"{getattr(self, name)}.")

    @property
    def enabled(self) -> bool:
        return bool(self.kinetic_weight or self.jacobian_weight or self.step_readout_weight
                    or self.steer)

    def check_train(self, t) -> None:
        """What the table asks of the rest of [train] (``t``: the TrainConfig)."""
        if self.steer and t.elastic.consistency_weight:
            raise ConfigError("train.regularize.steer moves each training step's end time, and "
                              "train.elastic.consistency_weight pulls that solve toward a finer "
                              "one integrated to model.ode_t1: the two would compare solves of "
                              "different intervals. Use one of them.")
        if self.steer and t.compile:
            raise ConfigError("train.regularize.steer changes the solve's end time every "
                              "step, which would recompile a compiled model every step; leave "
                              "train.compile off with STEER.")

    def check_model(self, m, elastic) -> None:
        """What the regularizers ask of the model (``m``: the ModelConfig) and of the solves
        training integrates with (``elastic``'s drawn solvers and steps replace the model's
        own), each refused by name with the way out."""
        regs = [n for n in ("kinetic_weight", "jacobian_weight", "steer") if getattr(self, n)]
        if regs and m.depth != "ode":
            raise ConfigError(f"train.regularize.{regs[0]} regularizes an ODE model's solve; "
                              f"model.depth = {m.depth!r} has none. Use depth = 'ode', or "
                              f"leave it out.")
        weighted = [n for n in ("kinetic_weight", "jacobian_weight") if getattr(self, n)]
        # (names not registered are reported by the elastic checks)
        fixed = [s for s in (elastic.solvers or [m.ode_solver])
                 if s in SOLVERS and getattr(SOLVERS.component_class(s), "fixed_grid", True)
                 ] if weighted and m.depth == "ode" else []
        if fixed:
            raise ConfigError(f"train.regularize.{weighted[0]} makes an adaptive solver's "
                              f"dynamics cheaper to integrate (fewer steps for the same "
                              f"tolerance); with the fixed-grid {fixed[0]!r} every solve takes "
                              f"the same steps, so it would only constrain the field. Use an "
                              f"adaptive solver (tsit5, dopri5, ...) or leave it out.")
        if self.steer and not self.steer < m.ode_t1 - m.ode_t0:
            raise ConfigError(f"train.regularize.steer = {self.steer} must be below "
                              f"model.ode_t1 - model.ode_t0 = {m.ode_t1 - m.ode_t0}, so that "
                              f"every drawn end time stays after ode_t0.")
        if self.step_readout_weight:
            self._check_readout(m, elastic)

    def _check_readout(self, m, elastic) -> None:
        check_step_states("train.regularize.step_readout_weight", m, elastic)


def check_step_states(setting: str, m, elastic, steps_needed: bool = True) -> None:
    """What reading the states between an ODE solve's steps in training asks (the step
    read-outs, the halting gate): an ODE model, fixed-grid non-reversible solvers (the
    model's, or the ones elastic training draws), a gradient mode that keeps every step in
    the graph and, with ``steps_needed``, at least two steps; each refused by ``setting``'s
    name with the way out."""
    if m.depth != "ode":
        raise ConfigError(f"{setting} reads out an ODE model's solver steps; model.depth = "
                          f"{m.depth!r} has none. Use depth = 'ode', or leave it out.")
    for name in (elastic.solvers if elastic is not None and elastic.solvers
                 else [m.ode_solver]):
        cls = SOLVERS.component_class(name)
        if not getattr(cls, "fixed_grid", True) or getattr(cls, "reversible", False):
            kind = "reversible" if getattr(cls, "reversible", False) else "adaptive"
            raise ConfigError(
                f"{setting} reads out the states of a fixed grid of steps; {name!r} is {kind} "
                f"(its steps are not kept as a graph). Use a fixed-grid solver such as euler "
                f"or rk4, or leave it out.")
    if m.ode_grad not in ("direct", "checkpoint"):
        raise ConfigError(f"{setting} needs the states of every step in the graph: "
                          f"model.ode_grad = 'direct' or 'checkpoint', not {m.ode_grad!r}.")
    drawn = elastic.steps if elastic is not None and elastic.steps else None
    if steps_needed and max(drawn or [m.ode_steps]) < 2:
        where = "train.elastic.steps" if drawn else "model.ode_steps"
        raise ConfigError(f"{setting} reads out the states between solver steps; {where} = "
                          f"{drawn or m.ode_steps} has none. Use at least two steps.")
