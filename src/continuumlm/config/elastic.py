"""[train.elastic]: elastic depth, an ODE model trained with a solver and step count drawn per
optimizer step, and the consistency term that pulls each drawn solve toward a finer one
(ElasticConfig, implemented by ``train/elastic.ElasticDepth``); with the checks against the
model's solve and the (solver, steps) pairs a run draws (:func:`solve_pairs`)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from ..registry import SOLVERS
from .checks import _validate
from .model import _check_selectors


@dataclass
class ElasticConfig:
    """Elastic depth: the solves a training step draws from, and the consistency term."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    steps: list[int] | None = None
    """ODE models: each optimizer step integrates with a step count drawn from this list,
    seeded by train.seed and the step (a resumed run and every rank draw alike); every entry
    is equally likely, so a count listed twice is drawn twice as often; evaluation and
    checkpoints keep model.ode_steps. (Before: train.ode_steps_choices.)"""
    solvers: list[str] | None = None
    """... and with a fixed-grid solver drawn from this list (model.ode_solver if unset).
    (Before: train.ode_solver_choices.)"""
    max_nfe: int | None = None
    """With steps / solvers: draw only the (solver, steps) pairs whose solve takes at most this
    many field evaluations (RK4 x 16 is 64), every allowed pair equally likely (each entry of
    the lists counted as listed); the consistency term's finer solve is the next larger step
    count within the cap too. None: solver and step count drawn independently from the two
    lists. (Before: train.ode_max_nfe.)"""
    start: int = 0
    """With steps / solvers: the first optimizer step (counted from 0) that draws; every step
    before it integrates with model.ode_solver and model.ode_steps and has no consistency term.
    A fixed-trained run made elastic for its last max_steps - start steps; the draws from there
    on are the ones a run with 0 makes. (Before: train.elastic_from.)"""
    consistency_weight: float = 0.0
    """With steps: add this weight times KL(finer || drawn) of the next-token distributions,
    the finer solve being the next larger step count of the choices on the same batch (no
    gradient, dropout off); logged as "consistency" on the steps that have it. (Before:
    train.consistency_weight.)"""
    consistency_max_nfe: int | None = None
    """With max_nfe and the consistency term: the finer solve may take up to this many field
    evaluations (at least max_nfe; None: max_nfe), e.g. 64 so that a drawn RK4 x 8 is pulled
    toward RK4 x 16 although RK4 x 16 itself is never drawn. The finer solve runs without
    gradients, so it costs about a third of a drawn solve of its size. (Before:
    train.consistency_max_nfe.)"""
    consistency_every: int = 1
    """Add the consistency term on every N-th optimizer step only (steps 0, N, 2N, ...): its
    finer solve is an extra forward pass, so N = 2 halves what the term costs. (Before:
    train.consistency_every.)"""

    @property
    def enabled(self) -> bool:
        return bool(self.steps or self.solvers)

    def __post_init__(self) -> None:
        _validate(self, "train.elastic")
        for name in ("steps", "solvers"):
            v = getattr(self, name)
            if v is not None and not v:
                raise ConfigError(f"train.elastic.{name} is empty; list at least one value, or "
                                  f"leave it out.")
        if self.steps is not None and not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 10_000
                for n in self.steps):
            raise ConfigError(f"train.elastic.steps must list positive integers (up to "
                              f"10000), got {self.steps}.")
        if not self.consistency_weight >= 0:
            raise ConfigError(f"train.elastic.consistency_weight must be >= 0, got "
                              f"{self.consistency_weight}.")
        if self.max_nfe is not None and not self.max_nfe >= 1:
            raise ConfigError(f"train.elastic.max_nfe must be a positive integer (or left "
                              f"out), got {self.max_nfe!r}.")
        if self.max_nfe is not None and not self.enabled:
            raise ConfigError("train.elastic.max_nfe caps the solves that elastic training "
                              "draws; set train.elastic.steps (and/or solvers), or leave it "
                              "out.")
        if self.consistency_max_nfe is not None:
            if self.max_nfe is None or not self.consistency_weight > 0:
                raise ConfigError("train.elastic.consistency_max_nfe caps the consistency "
                                  "term's finer solve beyond train.elastic.max_nfe: set both "
                                  "max_nfe and consistency_weight > 0, or leave it out.")
            if not self.consistency_max_nfe >= self.max_nfe:
                raise ConfigError(f"train.elastic.consistency_max_nfe must be an integer at "
                                  f"least train.elastic.max_nfe ({self.max_nfe}), got "
                                  f"{self.consistency_max_nfe!r}.")
        if not self.start >= 0:
            raise ConfigError(f"train.elastic.start must be an integer >= 0 (the first "
                              f"optimizer step that draws a solve), got {self.start!r}.")
        if self.start and not self.enabled:
            raise ConfigError("train.elastic.start is the step where elastic training starts; "
                              "set train.elastic.steps (and/or solvers), or leave it out.")
        if not self.consistency_every >= 1:
            raise ConfigError(f"train.elastic.consistency_every must be a positive integer "
                              f"(1: every step), got {self.consistency_every!r}.")
        if self.consistency_weight > 0 and len(set(self.steps or [])) < 2:
            raise ConfigError("train.elastic.consistency_weight pulls a coarse solve toward a "
                              "finer one: it needs train.elastic.steps with at least two step "
                              "counts.")

    def check_train(self, t) -> None:
        """What the table asks of the rest of [train] (``t``: the TrainConfig)."""
        if self.start and self.start >= t.max_steps:
            raise ConfigError(f"train.elastic.start ({self.start}) is not below "
                              f"train.max_steps ({t.max_steps}): no step would draw. Lower "
                              f"it, or leave out [train.elastic] for a fixed-step run.")

    def check_model(self, m) -> None:
        """What the drawn solves ask of the model (``m``: the ModelConfig), each refused by
        name with the way out."""
        if not self.enabled:
            return
        if m.depth != "ode":
            raise ConfigError(f"train.elastic.steps / solvers draw an ODE model's solver per "
                              f"step; model.depth = {m.depth!r} has none. Use depth = 'ode', "
                              f"or leave them out.")
        if self.max_nfe is not None and not solve_pairs(m, self):
            raise ConfigError(
                f"train.elastic.max_nfe = {self.max_nfe} allows none of the drawn solves "
                f"(solvers {self.solvers or [m.ode_solver]}, steps "
                f"{self.steps or [m.ode_steps]}): raise the cap or add smaller step counts.")
        for solver in self.solvers or []:
            if solver not in SOLVERS:
                raise ConfigError(f"train.elastic.solvers: {SOLVERS.unknown_message(solver)}")
            cls = SOLVERS.component_class(solver)
            if not getattr(cls, "fixed_grid", True) or solver == "rk2_gated" \
                    or m.ode_solver == "rk2_gated":
                raise ConfigError(f"train.elastic.solvers may list fixed-grid solvers without "
                                  f"weights of their own (euler, midpoint, heun, rk4, ...), "
                                  f"and the model's own solver may not have weights either "
                                  f"(rk2_gated); got {solver!r} with model.ode_solver = "
                                  f"{m.ode_solver!r}.")
        # every solve a step may draw must suit the model's gradient mode (e.g. reversible
        # Heun's 'reversible' backward with rk4 drawn), or training would stop at its draw
        for solver, steps in itertools.product(dict.fromkeys(self.solvers or [m.ode_solver]),
                                               dict.fromkeys(self.steps or [m.ode_steps])):
            try:
                _check_selectors(dataclasses.replace(m, ode_solver=solver, ode_steps=steps))
            except ConfigError as e:
                raise ConfigError(
                    f"train.elastic.solvers / steps may draw ode_solver = {solver!r} with "
                    f"ode_steps = {steps}, which this model cannot take: {e}") from None


def solve_nfe(model_config, solver: str, steps: int) -> int:
    """Field evaluations of a fixed-grid solve with ``solver`` over ``steps`` steps."""
    per_step = SOLVERS[solver](model_config).evals_per_step
    if per_step is None:  # adaptive: no fixed count (elastic draws refuse them elsewhere)
        return 1 << 62
    return int(per_step) * steps


def solve_pairs(model_config, elastic: ElasticConfig) -> list[tuple[str, int]]:
    """The (solver, steps) pairs that elastic training may draw: every pair of the two lists,
    less those over ``max_nfe`` when it is set, in list order (an entry listed twice counts
    twice). ``elastic``: [train.elastic], or the TrainConfig holding it (as before)."""
    elastic = getattr(elastic, "elastic", elastic)
    solvers = list(elastic.solvers or [model_config.ode_solver])
    steps = list(elastic.steps or [model_config.ode_steps])
    return [(s, n) for s in solvers for n in steps
            if elastic.max_nfe is None or solve_nfe(model_config, s, n) <= elastic.max_nfe]
