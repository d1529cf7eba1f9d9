"""[train.any_depth]: one run that teaches its coarse solves from its own solve (AnyDepthConfig,
implemented by ``train/any_depth.AnyDepth``): in every optimizer step the model's own solve
(model.ode_solver x model.ode_steps, the one it is evaluated and deployed with) gives the
language-model loss, and its next-token distribution, with no gradient through it, is the
target of a KL term for coarse solves drawn from a list. No teacher from a second run.

A solve is spelled ``SOLVER:STEPS`` (``euler:1``, ``rk4:1``), as ``eval --agreement`` and
``generate --draft-solver/--draft-steps`` read it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from ..registry import SOLVERS
from .checks import _validate
from .regularize import check_step_states


def parse_solve(text: str, where: str) -> tuple[str, int]:
    """``"euler:2"`` -> ("euler", 2); a ConfigError naming ``where`` otherwise."""
    solver, sep, steps = str(text).partition(":")
    if not sep or not solver or not steps.strip().isdigit() or int(steps) < 1:
        raise ConfigError(f"{where}: {text!r} is not a solve; write SOLVER:STEPS with a positive "
                          f"step count, e.g. 'euler:1' or 'rk4:2'.")
    return solver.strip(), int(steps)


@dataclass
class AnyDepthConfig:
    """Self-distillation across depths: the coarse solves drawn, their weights."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    drafts: list[str] | None = None
    """ODE models: the coarse solves (SOLVER:STEPS, fixed-grid solvers without weights of
    their own) that learn from the model's own solve. Each micro-batch runs the own solve (the
    language-model loss) and then `draws` of these on the same batch, each adding `weight`
    times KL(own || coarse) of the next-token distributions, the own distribution detached."""
    draws: int = 1
    """How many of `drafts` each optimizer step trains (drawn without replacement from
    (train.seed, step), so a resumed run and every rank draw alike); at most len(drafts)."""
    weight: float = 1.0
    """The weight of each drawn coarse solve's KL term (logged as "any_depth_kl", the mean
    over the drawn solves)."""
    lm_weight: float = 0.0
    """The coarse solves also take the language-model loss (cross-entropy against the data)
    with this weight; 0: they learn from the own solve alone."""
    top1_weight: float = 0.0
    """A top-1-oriented term: this weight times the cross-entropy of each coarse solve
    against the own solve's greedy token (what speculative decoding needs to agree on)."""
    every: int = 1
    """Add the terms on every N-th optimizer step only (steps 0, N, 2N, ...)."""
    gate_weight: float = 0.0
    """Train the model's halting gate (model.exit_gate) with this weight: after each solver
    step but the last of the own solve, the gate reads the (detached) state and learns, by
    binary cross-entropy, whether its read-out's greedy token already equals the own solve's
    (the gate alone learns from it: the model is unchanged by it). Logged as
    "any_depth_gate"."""
    step_weight: float = 0.0
    """Teach the read-outs along the own solve too: this weight times the mean, over the states
    between the own solve's solver steps (every ODE block's), of KL(own || read-out), the
    read-out being the state through the final norm and head (what per-token exit reads when
    a token stops after that step), the own distribution detached. What an exit after an early
    step needs: states that already read as the own solve. Logged as "any_depth_step"."""
    backprop_steps: int | None = None
    """Truncated backpropagation through depth: each ODE block's solve runs its first
    n - backprop_steps solver steps without autograd and backpropagates through the last
    backprop_steps alone (all of them when the solve has no more). Composes with drawn step
    counts (train.elastic.steps) and with the drafts here. None: through every step."""
    backprop_skip: bool = False
    """With backprop_steps: the gradient that reaches the state after the untracked steps goes
    on to the block's input unchanged, as if those steps were the identity (Jacobian-free
    backpropagation's approximation, Fung et al. 2022), so that what comes before the block
    (the embeddings, earlier blocks) learns from the solve's tail too. The forward is the
    same. False: that state is detached, and nothing before it learns through this block."""

    @property
    def enabled(self) -> bool:
        return bool(self.drafts)

    def solves(self) -> list[tuple[str, int]]:
        return [parse_solve(d, "train.any_depth.drafts") for d in self.drafts or []]

    def __post_init__(self) -> None:
        _validate(self, "train.any_depth")
        if self.drafts is not None and not self.drafts:
            raise ConfigError("train.any_depth.drafts is empty; list at least one coarse solve "
                              "(e.g. ['euler:1', 'rk4:1']), or leave it out.")
        solves = self.solves()
        if len(set(solves)) != len(solves):
            raise ConfigError(f"train.any_depth.drafts lists a solve twice: {self.drafts}.")
        for name in ("weight", "lm_weight", "top1_weight", "gate_weight", "step_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train.any_depth.{name} must be >= 0, got "
                                  f"{getattr(self, name)}.")
        if not self.every >= 1:
            raise ConfigError(f"train.any_depth.every must be a positive integer (1: every "
                              f"step), got {self.every!r}.")
        if self.backprop_steps is not None and not (
                isinstance(self.backprop_steps, int) and self.backprop_steps >= 1):
            raise ConfigError(f"train.any_depth.backprop_steps must be a positive integer (or "
                              f"left out), got {self.backprop_steps!r}.")
        if self.backprop_skip and self.backprop_steps is None:
            raise ConfigError("train.any_depth.backprop_skip passes the gradient past the steps "
                              "that truncated backpropagation leaves out, and backprop_steps is "
                              "not set: set backprop_steps = N too, or leave backprop_skip out.")
        if self.enabled and not 1 <= self.draws <= len(solves):
            raise ConfigError(f"train.any_depth.draws must be between 1 and the number of "
                              f"drafts ({len(solves)}), got {self.draws!r}.")
        if self.enabled and not (self.weight or self.lm_weight or self.top1_weight):
            raise ConfigError("train.any_depth: weight, lm_weight and top1_weight are all 0, "
                              "so the drafts would learn nothing; set one above 0, or leave "
                              "out drafts.")

    def check_model(self, m, elastic=None) -> None:
        """What the coarse solves and the truncation ask of the model (``m``: the
        ModelConfig)."""
        if self.backprop_steps is not None:
            self._check_truncation(m, elastic)
        if self.gate_weight > 0 and not m.exit_gate:
            raise ConfigError("train.any_depth.gate_weight trains the model's halting gate, "
                              "and this model has none: set model.exit_gate = true, or leave "
                              "gate_weight out.")
        # the gate and the step read-outs read the states between the solver's steps
        if self.gate_weight > 0:
            check_step_states("train.any_depth.gate_weight", m, elastic, steps_needed=False)
        if self.step_weight > 0:
            check_step_states("train.any_depth.step_weight", m, elastic)
        if not self.enabled:
            return
        if m.depth != "ode":
            raise ConfigError(f"train.any_depth.drafts are coarse solves of an ODE model; "
                              f"model.depth = {m.depth!r} has none. Use depth = 'ode', or leave "
                              f"[train.any_depth] out.")
        if elastic is not None and elastic.enabled:
            raise ConfigError("train.any_depth and train.elastic.steps/solvers both change "
                              "the solve per step; the any-depth recipe trains the model's own "
                              "solve and the drafts together. Use one of them.")
        from .model import _check_selectors

        if m.ode_solver == "rk2_gated":
            raise ConfigError("train.any_depth: the model's own solver rk2_gated has weights "
                              "of its own, which a draft's solver would not have; use another "
                              "model.ode_solver.")
        for solver, steps in self.solves():
            if solver not in SOLVERS:
                raise ConfigError(f"train.any_depth.drafts: {SOLVERS.unknown_message(solver)}")
            cls = SOLVERS.component_class(solver)
            if not getattr(cls, "fixed_grid", True) or solver == "rk2_gated":
                raise ConfigError(f"train.any_depth.drafts may list fixed-grid solvers without "
                                  f"weights of their own (euler, midpoint, heun, rk4, ...); got "
                                  f"{solver!r}.")
            if (solver, steps) == (m.ode_solver, m.ode_steps):
                raise ConfigError(f"train.any_depth.drafts lists {solver}:{steps}, the model's "
                                  f"own solve; list coarser solves only.")
            try:
                _check_selectors(dataclasses.replace(m, ode_solver=solver, ode_steps=steps))
            except ConfigError as e:
                raise ConfigError(f"train.any_depth.drafts: {solver}:{steps} cannot be taken "
                                  f"by this model: {e}") from None

    def _check_truncation(self, m, elastic) -> None:
        if m.depth != "ode":
            raise ConfigError(f"train.any_depth.backprop_steps truncates an ODE model's "
                              f"solve; model.depth = {m.depth!r} has none. Leave it out.")
        solvers = {m.ode_solver, *((elastic.solvers or []) if elastic is not None else [])}
        for solver in solvers:
            cls = SOLVERS.component_class(solver) if solver in SOLVERS else None
            if cls is not None and (not getattr(cls, "fixed_grid", True)
                                    or getattr(cls, "reversible", False)):
                raise ConfigError(f"train.any_depth.backprop_steps cuts a fixed-grid solve "
                                  f"at a step; {solver!r} is "
                                  f"{'adaptive' if not getattr(cls, 'fixed_grid', True) else 'reversible'}"
                                  f". Use a fixed-grid, non-reversible solver, or leave it "
                                  f"out.")
