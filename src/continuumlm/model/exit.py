"""Per-token exit from an ODE block's fixed-grid solve: the rule (``LanguageModel.set_exit``),
the solvers it works with, and the solve that applies it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ode.solvers import grid

EXIT_CRITERIA = ("state", "kl", "gate", "confidence")


@dataclass(frozen=True)
class ExitRule:
    """Per-token early exit from every ODE block's fixed-grid solve.

    After solver step n (of N) of a block, a token still integrating is frozen for the rest of
    that block when its ``criterion`` falls below ``threshold``:

    - ``"state"``: the relative change of its state over the step, ||h_(n+1) - h_n|| / ||h_n||;
    - ``"kl"``: KL(p_(n+1) || p_n) between the next-token distributions read out (final norm and
      head) from its states before and after the step; costs one read-out per step and token;
    - ``"gate"``: 1 - sigmoid(gate(h_(n+1))), the model's learned halting gate's probability
      that the token's greedy prediction would still change (``model.exit_gate``, trained by
      ``train.any_depth.gate_weight``); costs one linear read per step and token;
    - ``"confidence"``: 1 - the largest next-token probability read out from h_(n+1) (CALM's
      softmax confidence); costs one read-out per step and token.

    A criterion reads only the token's own state, which depends only on its prefix, so the
    decoder stays exactly causal and cached decoding equals recompute at the same threshold.
    ``readout`` (h -> logits) is given by ``LanguageModel.set_exit``.
    """

    threshold: float
    criterion: str = "state"
    readout: Callable[[torch.Tensor], torch.Tensor] | None = None
    gate: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.criterion not in EXIT_CRITERIA:
            raise ValueError(f"exit criterion {self.criterion!r} is not one of "
                             f"{', '.join(EXIT_CRITERIA)}.")
        if not (isinstance(self.threshold, (int, float)) and self.threshold >= 0
                and not math.isnan(self.threshold)):
            raise ValueError(f"the exit threshold must be a number >= 0 (0: never exit; inf: "
                             f"every token after its first step), got {self.threshold!r}.")
        if self.criterion in ("kl", "confidence") and self.readout is None:
            raise ValueError(f"the {self.criterion!r} exit criterion needs a read-out "
                             f"(h -> logits).")
        if self.criterion == "gate" and self.gate is None:
            raise ValueError("the 'gate' exit criterion needs the model's halting gate "
                             "(model.exit_gate).")

    def settled(self, h_old: torch.Tensor, h_new: torch.Tensor, old_logp):
        """(bool (B, T): the criterion is below the threshold, the read-out of h_new or None)."""
        if self.criterion == "state":
            change = (h_new - h_old).float().norm(dim=-1)
            crit = change / h_old.float().norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
            return crit < self.threshold, None
        if self.criterion == "gate":
            crit = 1 - torch.sigmoid(self.gate(h_new).float())
            return crit < self.threshold, None
        if self.criterion == "confidence":
            crit = 1 - torch.softmax(self.readout(h_new).float(), dim=-1).amax(-1)
            return crit < self.threshold, None
        logp = self.log_probs(h_new)
        crit = (logp.exp() * (logp - old_logp)).sum(-1)
        return crit < self.threshold, logp

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.readout(h).float(), dim=-1)


def check_exit_solver(solver, name: str) -> None:
    """Early exit needs a fixed-grid explicit step h_(n+1) = h_n + dt * (stage combination):
    zeroing a token's stage derivatives then leaves its state exactly as it was."""
    if not getattr(solver, "fixed_grid", True) or not hasattr(solver, "step"):
        raise ValueError(f"per-token exit needs a fixed-grid solver; {name!r} chooses its own "
                         f"steps (use euler, midpoint, heun, rk4, ...).")
    if getattr(solver, "reversible", False):
        raise ValueError(f"per-token exit is not defined for the reversible solver {name!r} "
                         f"(its two coupled states do not stay put when the field is zero); "
                         f"use a fixed-grid Runge-Kutta solver such as rk4 or heun.")


def solve_with_exit(cfg, solver, f, write, x: torch.Tensor, rule: ExitRule, cached: bool,
                    at_step=None):
    """The fixed-grid solve with per-token exit; returns (h(t1), field evaluations per
    token (B, T)).

    A frozen token's stage derivatives are zero, so its stage inputs and its state stay
    exactly its frozen state: what later tokens read from it at the stages it skips (keys
    and values, DeltaNet writes, CAT values) is computed from that state, in a full
    forward and in cached decoding alike. When every token in ``x`` is frozen, the rest
    of the solve only writes what later tokens read (``field.write``: the mixers' cache
    writes, no MLP, no attention read), or stops when nothing is cached: that is where
    the time is saved. Under ``torch.compile`` every stage is evaluated (masked), which
    gives the same numbers without a data-dependent branch.

    With the mixers' memory written per step or block (``model.ode_kv``), ``at_step(t, h,
    dt)`` writes a step's memory from its start, a frozen token's from its frozen state, and
    ``write`` is None: the stages write nothing, so a step in which every token is frozen
    only writes its memory.
    """
    dt = (cfg.ode_t1 - cfg.ode_t0) / cfg.ode_steps
    active = torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)
    evals = torch.zeros(x.shape[:-1], dtype=torch.int32, device=x.device)
    per_step = int(solver.evals_per_step)
    logp = rule.log_probs(x) if rule.criterion == "kl" else None
    branch = not torch.compiler.is_compiling()
    h = x
    times = grid(cfg.ode_t0, cfg.ode_t1, cfg.ode_steps)
    for n, t in enumerate(times):
        if branch and not bool(active.any()):
            if not cached:
                break  # nobody reads the stages left
            if at_step is not None:
                at_step(t, h, dt)  # the step's memory, from the frozen states
            elif write is not None:
                h = solver.step(write, t, h, dt)  # h stays h: every derivative is zero
            continue
        if at_step is not None:
            at_step(t, h, dt)
        keep = active.unsqueeze(-1)

        def masked(tt: float, hh: torch.Tensor, keep=keep) -> torch.Tensor:
            return torch.where(keep, f(tt, hh), 0.0)  # where, not *: 0 * inf is nan

        h_new = solver.step(masked, t, h, dt)
        evals += active.to(evals.dtype) * per_step
        if n + 1 < len(times):
            settled, logp = rule.settled(h, h_new, logp)
            active = active & ~settled
        h = h_new
    return h, evals
