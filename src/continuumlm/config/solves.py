"""What [train] asks of the model's solve, checked against [model]: the solvers and step
counts elastic training draws (and their field-evaluation cap), the solve regularizers, STEER's
end time and the read-outs of intermediate steps. ``RunConfig.check`` calls it; elastic
training (``train/elastic.py``) draws from :func:`solve_pairs`."""

from __future__ import annotations

import dataclasses
import itertools

from ..errors import ConfigError
from ..registry import SOLVERS
from .model import _check_selectors


def check_training_solves(m, t) -> None:
    """Refuse [train] options the model's depth, solver or gradient mode cannot take (``m``:
    the ModelConfig, ``t``: the TrainConfig), each by name with the way out."""
    regs = [n for n in ("kinetic_weight", "jacobian_weight", "steer") if getattr(t, n)]
    if regs and m.depth != "ode":
        raise ConfigError(f"train.{regs[0]} regularizes an ODE model's solve; model.depth = "
                          f"{m.depth!r} has none. Use depth = 'ode', or leave it out.")
    weighted = [n for n in ("kinetic_weight", "jacobian_weight") if getattr(t, n)]
    # what training integrates with: the elastic choices replace the model's own solver
    # (names not registered are reported by the elastic checks below)
    fixed = [s for s in (t.ode_solver_choices or [m.ode_solver])
             if s in SOLVERS and getattr(SOLVERS.component_class(s), "fixed_grid", True)
             ] if weighted and m.depth == "ode" else []
    if fixed:
        raise ConfigError(f"train.{weighted[0]} makes an adaptive solver's dynamics cheaper "
                          f"to integrate (fewer steps for the same tolerance); with the "
                          f"fixed-grid {fixed[0]!r} every solve takes the same steps, so "
                          f"it would only constrain the field. Use an adaptive solver "
                          f"(tsit5, dopri5, ...) or leave it out.")
    if t.step_readout_weight:
        # what training integrates with: the elastic choices replace the model's own
        solvers = list(t.ode_solver_choices or [m.ode_solver])
        steps = list(t.ode_steps_choices or [m.ode_steps])
        if m.depth != "ode":
            raise ConfigError(f"train.step_readout_weight reads out an ODE model's solver "
                              f"steps; model.depth = {m.depth!r} has none. Use depth = "
                              f"'ode', or leave it out.")
        for name in solvers:
            cls = SOLVERS.component_class(name)
            if not getattr(cls, "fixed_grid", True) or getattr(cls, "reversible", False):
                raise ConfigError(
                    f"train.step_readout_weight reads out the states of a fixed grid of "
                    f"steps; {name!r} is {'reversible' if getattr(cls, 'reversible', False) else 'adaptive'} "
                    f"(its steps are not kept as a graph). Use a fixed-grid solver such as "
                    f"euler or rk4, or leave it out.")
        if m.ode_grad not in ("direct", "checkpoint"):
            raise ConfigError(f"train.step_readout_weight needs the states of every step "
                              f"in the graph: model.ode_grad = 'direct' or 'checkpoint', "
                              f"not {m.ode_grad!r}.")
        if max(steps) < 2:
            where = ("train.ode_steps_choices" if t.ode_steps_choices
                     else "model.ode_steps")
            raise ConfigError(f"train.step_readout_weight reads out the states between "
                              f"solver steps; {where} = {t.ode_steps_choices or m.ode_steps} "
                              f"has none. Use at least two steps.")
    if t.ode_max_nfe is not None and m.depth == "ode":
        if not solve_pairs(m, t):
            raise ConfigError(
                f"train.ode_max_nfe = {t.ode_max_nfe} allows none of the drawn solves "
                f"(solvers {t.ode_solver_choices or [m.ode_solver]}, steps "
                f"{t.ode_steps_choices or [m.ode_steps]}): raise the cap or add smaller "
                f"step counts.")
    if t.steer and t.consistency_weight:
        raise ConfigError("train.steer moves each training step's end time, and "
                          "train.consistency_weight pulls that solve toward a finer one "
                          "integrated to model.ode_t1: the two would compare solves of "
                          "different intervals. Use one of them.")
    # (the gradient mode against every drawn solve: checked per draw below)
    if t.steer and t.compile:
        raise ConfigError("train.steer changes the solve's end time every step, which "
                          "would recompile a compiled model every step; leave "
                          "train.compile off with STEER.")
    if t.steer and not t.steer < m.ode_t1 - m.ode_t0:
        raise ConfigError(f"train.steer = {t.steer} must be below model.ode_t1 - "
                          f"model.ode_t0 = {m.ode_t1 - m.ode_t0}, so that every drawn end "
                          f"time stays after ode_t0.")
    if (t.ode_steps_choices or t.ode_solver_choices) and m.depth != "ode":
        raise ConfigError(f"train.ode_steps_choices / ode_solver_choices draw an ODE "
                          f"model's solver per step; model.depth = {m.depth!r} has none. "
                          f"Use depth = 'ode', or leave them out.")
    for solver in t.ode_solver_choices or []:
        if solver not in SOLVERS:
            raise ConfigError(f"train.ode_solver_choices: {SOLVERS.unknown_message(solver)}")
        cls = SOLVERS.component_class(solver)
        if not getattr(cls, "fixed_grid", True) or solver == "rk2_gated" \
                or m.ode_solver == "rk2_gated":
            raise ConfigError(f"train.ode_solver_choices may list fixed-grid solvers without "
                              f"weights of their own (euler, midpoint, heun, rk4, ...), "
                              f"and the model's own solver may not have weights either "
                              f"(rk2_gated); got {solver!r} with model.ode_solver = "
                              f"{m.ode_solver!r}.")
    if m.depth == "ode" and (t.ode_steps_choices or t.ode_solver_choices):
        # every solve a step may draw must suit the model's gradient mode (e.g. reversible
        # Heun's 'reversible' backward with rk4 drawn), or training would stop at its draw
        for solver, steps in itertools.product(
                dict.fromkeys(t.ode_solver_choices or [m.ode_solver]),
                dict.fromkeys(t.ode_steps_choices or [m.ode_steps])):
            try:
                _check_selectors(dataclasses.replace(m, ode_solver=solver, ode_steps=steps))
            except ConfigError as e:
                raise ConfigError(
                    f"train.ode_solver_choices / ode_steps_choices may draw ode_solver = "
                    f"{solver!r} with ode_steps = {steps}, which this model cannot take: "
                    f"{e}") from None


def solve_nfe(model_config, solver: str, steps: int) -> int:
    """Field evaluations of a fixed-grid solve with ``solver`` over ``steps`` steps."""
    per_step = SOLVERS[solver](model_config).evals_per_step
    if per_step is None:  # adaptive: no fixed count (elastic draws refuse them elsewhere)
        return 1 << 62
    return int(per_step) * steps


def solve_pairs(model_config, t) -> list[tuple[str, int]]:
    """The (solver, steps) pairs that elastic training may draw: every pair of the two lists,
    less those over ``train.ode_max_nfe`` when it is set, in list order (an entry listed twice
    counts twice)."""
    solvers = list(t.ode_solver_choices or [model_config.ode_solver])
    steps = list(t.ode_steps_choices or [model_config.ode_steps])
    return [(s, n) for s in solvers for n in steps
            if t.ode_max_nfe is None or solve_nfe(model_config, s, n) <= t.ode_max_nfe]
