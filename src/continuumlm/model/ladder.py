"""Per-token exit across solves (a solve ladder): each token is integrated with the coarsest
solve first, and with the next finer one only while the criterion says it has not settled.

    model.set_exit(0.1, "confidence", ladder=["euler:1", "rk4:1"])

A token takes Euler x 1 (1 field evaluation); when the read-out of that state is not confident
enough, RK4 x 1 from the block's input (4 more); when neither is, the model's own solve (16
more for RK4 x 4). Its output is the first settled rung's state, its cost every rung it tried.

Exact only where every solve reads the same memory: a one-block model whose mixer's memory is
written from the block's input (``model.ode_kv = "block"``). Then a token's keys and values do
not depend on the solve that integrated it, so later tokens read the same memory whichever
rung each earlier token stopped at, and cached decoding equals recomputing the context with
the same rule. With per-evaluation memory (the default), a token stopped at Euler x 1 would
leave nothing at the other solves' evaluations: refused.

The coarse solves agree with the own solve as far as training taught them to
(``train.any_depth``); the criterion tells the tokens where they do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

LADDER_CRITERIA = ("confidence", "gate")


@dataclass(frozen=True)
class Rung:
    """One solve of the ladder: the block's solver module and config for it, its name
    ("euler:1") and its field evaluations."""

    name: str
    solver: torch.nn.Module
    cfg: object
    nfe: int


@dataclass(frozen=True)
class SolveLadder:
    """The coarse rungs, coarse to fine, then the model's own solve (taken from the block
    when the ladder runs, so a later ``set_solver`` is the last rung); a token stops at the
    first rung whose ``criterion`` falls below ``threshold``:

    - ``"confidence"``: 1 - the largest next-token probability read out (final norm and head)
      from the rung's state: CALM's softmax confidence; one read-out per rung and token;
    - ``"gate"``: 1 - sigmoid(gate(h)), the model's learned halting gate (model.exit_gate).
    """

    rungs: tuple[Rung, ...]
    threshold: float
    criterion: str
    readout: Callable[[torch.Tensor], torch.Tensor] | None = None
    gate: Callable[[torch.Tensor], torch.Tensor] | None = None

    def settled(self, h: torch.Tensor) -> torch.Tensor:
        """bool (B, T): the criterion of states ``h`` is below the threshold."""
        if self.criterion == "gate":
            crit = 1 - torch.sigmoid(self.gate(h).float())
        else:
            crit = 1 - torch.softmax(self.readout(h).float(), dim=-1).amax(-1)
        return crit < self.threshold


def parse_rung(text: str) -> tuple[str, int]:
    """"SOLVER:STEPS" -> (solver, steps), refused by name when malformed."""
    solver, sep, steps = str(text).partition(":")
    if not sep or not solver or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"exit ladder: {text!r} is not SOLVER:STEPS (e.g. euler:1, rk4:1).")
    return solver, int(steps)


def build(model, rungs: list[str], threshold: float, criterion: str, readout,
          gate) -> SolveLadder:
    """The ladder of ``rungs`` (coarse solves, "SOLVER:STEPS") and the model's own solve,
    refused by name where it would not be exact."""
    from ..registry import SOLVERS

    cfg = model.config
    if not (isinstance(threshold, (int, float)) and threshold >= 0
            and not math.isnan(threshold)):
        raise ValueError(f"the exit threshold must be a number >= 0 (0: never exit; inf: "
                         f"every token at the first rung), got {threshold!r}.")
    if criterion not in LADDER_CRITERIA:
        raise ValueError(f"exit ladder: criterion {criterion!r} is not one of "
                         f"{', '.join(LADDER_CRITERIA)} (a ladder's rungs are whole solves: "
                         f"there is no step between them for 'state' or 'kl' to measure).")
    if cfg.depth != "ode" or cfg.num_layers != 1 or cfg.ode_kv != "block":
        raise ValueError(
            f"exit ladder: the solves of a ladder read one memory only in a one-block ODE "
            f"model whose memory is written from the block's input (model.ode_kv = 'block'); "
            f"this model has depth = {cfg.depth!r}, num_layers = {cfg.num_layers}, ode_kv = "
            f"{getattr(cfg, 'ode_kv', None)!r}. Train one with --set model.ode_kv=block (one "
            f"block), or use per-step exit (no ladder).")
    if cfg.ode_dt_embedding:
        raise ValueError("exit ladder: this model's field reads the step size "
                         "(model.ode_dt_embedding), so the memory each solve writes from the "
                         "block's input depends on the solve; a ladder needs one memory for "
                         "every solve.")
    if cfg.mixer != "softmax":
        raise ValueError(f"exit ladder: a token's next rung starts from the memory before it, "
                         f"which the ladder cuts back; this version does so for the softmax "
                         f"mixer's growing cache, not for {cfg.mixer!r}.")
    if not rungs:
        raise ValueError("exit ladder: give at least one coarse solve (e.g. euler:1).")
    own = (cfg.ode_solver, cfg.ode_steps)
    block = model.depth.blocks[0]
    own_rung(block)  # the own solve must be a fixed grid too
    out = []
    for text in rungs:
        solver, steps = parse_rung(text)
        if (solver, steps) == own:
            raise ValueError(f"exit ladder: {text} is the model's own solve, which is always "
                             f"the last rung; list the coarser solves only.")
        if solver not in SOLVERS:
            raise ValueError(f"exit ladder: unknown solver {solver!r}.")
        rcfg = dataclasses.replace(cfg, ode_solver=solver, ode_steps=steps, ode_grad="direct")
        module = SOLVERS[rcfg.ode_solver](rcfg)
        if not getattr(module, "fixed_grid", True) or any(True for _ in module.parameters()):
            raise ValueError(f"exit ladder: {text} must be a fixed-grid solver without "
                             f"weights of its own (euler, midpoint, rk4, ...).")
        out.append(Rung(f"{solver}:{steps}", module, rcfg, steps * int(module.evals_per_step)))
    check_coarser(out, own_rung(block))
    if criterion == "gate" and gate is None:
        raise ValueError("exit ladder: the 'gate' criterion reads the model's halting gate, "
                         "and this model has none; use criterion 'confidence'.")
    return SolveLadder(tuple(out), float(threshold), criterion, readout, gate)


def own_rung(block) -> Rung:
    """The block's solve now (the model's own, whatever set_solver made it) as the last
    rung; an adaptive one is refused by name."""
    cfg = block.cfg
    if not getattr(block.solver, "fixed_grid", True) or block.solver.evals_per_step is None:
        raise ValueError(f"exit ladder: the model's own solver {cfg.ode_solver!r} chooses its "
                         f"own steps; a ladder ends with a fixed-grid solve (euler, rk4, ...).")
    return Rung(f"{cfg.ode_solver}:{cfg.ode_steps}", block.solver, cfg,
                cfg.ode_steps * int(block.solver.evals_per_step))


def check_coarser(coarse: list[Rung], own: Rung) -> None:
    if any(a.nfe >= own.nfe for a in coarse):
        raise ValueError(f"exit ladder: every coarse solve must take fewer field evaluations "
                         f"than the own solve ({own.name}, {own.nfe}); got "
                         f"{', '.join(f'{r.name} ({r.nfe})' for r in coarse)}.")


def run(stack, ladder: SolveLadder, x: torch.Tensor, state, padding,
        evaluate) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output for ``x`` (B, T, C) under the ladder, and each token's field
    evaluations (B, T). Every rung runs over the call's tokens while any of them is still
    integrating (a token that settled keeps its state; in decoding, one token a call, the
    later rungs are skipped); with a decoding ``state``, the memory this call's tokens wrote
    is cut back before each next rung writes it again (the same keys and values: they come
    from the block's input)."""
    if state is not None and state.static is not None:
        raise ValueError("the exit ladder decodes eagerly (it cuts the memory back between "
                         "rungs and switches solves); leave compile and cuda_graph off, or "
                         "call model.set_exit(None).")
    block = stack.blocks[0]
    own = (block.solver, block.cfg)
    last = own_rung(block)
    check_coarser(list(ladder.rungs), last)
    rungs = (*ladder.rungs, last)
    B, T = x.shape[:2]
    start = state.pos if state is not None else 0  # the caller moves pos on after the depth
    out = x
    nfe = torch.zeros(B, T, dtype=torch.long, device=x.device)
    todo = torch.ones(B, T, dtype=torch.bool, device=x.device)
    spent = 0
    try:
        for i, rung in enumerate(rungs):
            if i and state is not None:
                state.pos = start + T
                state.crop(start)
            block.solver, block.cfg = rung.solver, rung.cfg  # as set_solver, without checks
            h = block(x, state, None, None, padding, evaluate)
            spent += rung.nfe
            nfe = torch.where(todo, spent, nfe)
            stop = todo if i == len(rungs) - 1 else todo & ladder.settled(h)
            out = torch.where(stop[..., None], h, out)
            todo = todo & ~stop
            if not bool(todo.any()):
                break
    finally:
        block.solver, block.cfg = own
    block.last_nfe = spent
    return out, nfe
