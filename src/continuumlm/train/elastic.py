"""Elastic depth ([train.elastic], config/elastic.py): an ODE model trained with a solver and
step count drawn per optimizer step, and the shortcut-consistency term that pulls the drawn
solve's next-token distribution toward a finer solve of the same batch. Also the solve's
regularizers and STEER's drawn end time ([train.regularize], config/regularize.py):
:class:`SolveRegularizers`.

The draw is a function of (train.seed, step) only, so a resumed run draws what the
uninterrupted one drew and every rank of a job draws alike, with no state to save. The model
is switched with ``LanguageModel.set_solver`` for the step and switched back after it:
evaluation and checkpoints see model.ode_solver and model.ode_steps.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config.elastic import solve_nfe, solve_pairs


class ElasticDepth:
    def __init__(self, model, t):
        self.model = model
        self.steps = list(t.elastic.steps or [])
        self.solvers = list(t.elastic.solvers or [])
        self.weight = float(t.elastic.consistency_weight)
        self.every = int(t.elastic.consistency_every)
        self.start = int(t.elastic.start)
        self.seed = int(t.seed)
        self.base = (model.config.ode_solver, model.config.ode_steps)
        self.enabled = bool(self.steps or self.solvers)
        self.cap = t.elastic.max_nfe
        # the consistency term's finer solve (no gradient) may go beyond the draws' cap
        fine = t.elastic.consistency_max_nfe
        self.finer_cap = fine if fine is not None else self.cap
        # with a cap, (solver, steps) is drawn as a pair from the allowed ones
        self.pairs = solve_pairs(model.config, t.elastic) if self.cap is not None else None

    def draw(self, step: int) -> tuple[str, int]:
        """(solver, steps) of optimizer step ``step`` (counted from 0); the model's own before
        ``train.elastic.start``."""
        if step < self.start:
            return self.base
        rng = np.random.default_rng([self.seed, step, 0xE1A5])
        if self.pairs is not None:
            return self.pairs[int(rng.integers(len(self.pairs)))]
        steps = self.steps[int(rng.integers(len(self.steps)))] if self.steps else self.base[1]
        solver = (self.solvers[int(rng.integers(len(self.solvers)))] if self.solvers
                  else self.base[0])
        return solver, steps

    def finer(self, steps: int, solver: str | None = None) -> int | None:
        """The next larger step count of the choices (within consistency_max_nfe, else
        max_nfe, for ``solver``)."""
        larger = sorted(n for n in set(self.steps) if n > steps)
        if self.finer_cap is not None and solver is not None:
            larger = [n for n in larger
                      if solve_nfe(self.model.config, solver, n) <= self.finer_cap]
        return larger[0] if larger else None

    @contextlib.contextmanager
    def at(self, solver: str, steps: int):
        self.model.set_solver(solver, steps)
        try:
            yield
        finally:
            self.model.set_solver(*self.base)

    def finer_at(self, step: int, solver: str, steps: int) -> int | None:
        """The step count of the consistency term's finer solve at optimizer step ``step``
        (drawn as ``(solver, steps)``), or None where that step has no such term."""
        if self.weight <= 0 or step < self.start or step % self.every != 0:
            return None
        return self.finer(steps, solver)

    def target(self, logits_of, solver: str, steps: int, step: int) -> torch.Tensor | None:
        """Next-token log-probabilities of the finer solve (``logits_of()``: the batch's
        logits as the task's objective computes them; no gradient, dropout off), or None
        when there is no consistency term, none at optimizer step ``step`` (counted from 0;
        ``train.elastic.consistency_every``) or no finer step count than ``steps``."""
        fine = self.finer_at(step, solver, steps)
        if fine is None:
            return None
        was = self.model.training
        self.model.set_solver(solver, fine)
        self.model.eval()
        try:
            with torch.no_grad():
                logits = logits_of()
        finally:
            self.model.train(was)
            self.model.set_solver(solver, steps)
        return F.log_softmax(logits.float(), -1)

    @staticmethod
    def consistency(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """KL(finer || drawn) per position, averaged."""
        logp = F.log_softmax(logits.float(), -1)
        return (target.exp() * (target - logp)).sum(-1).mean()


class SolveRegularizers:
    """What the trainer adds to an ODE model's solves in training: the kinetic and Jacobian
    integrals (computed by the model along the solve, ``model.depth.extras``) with their
    weights, and STEER's end time, drawn like the elastic draws from (seed, step)."""

    def __init__(self, model, t):
        self.model = model
        r = t.regularize
        self.kinetic, self.jacobian = float(r.kinetic_weight), float(r.jacobian_weight)
        self.readout = float(r.step_readout_weight)
        self.steer, self.seed = float(r.steer), int(t.seed)
        self.backprop_steps = t.any_depth.backprop_steps  # truncated backprop through depth
        self.backprop_skip = t.any_depth.backprop_skip
        # the states between steps: the step read-outs' (regularize's and any_depth's) and
        # the halting gate's (any_depth)
        self.keep_states = (self.readout > 0 or t.any_depth.gate_weight > 0
                            or t.any_depth.step_weight > 0)
        self.enabled = bool(self.kinetic or self.jacobian or self.steer or self.keep_states
                            or self.backprop_steps)

    def end_time(self, step: int) -> float | None:
        if not self.steer:
            return None
        rng = np.random.default_rng([self.seed, step, 0x57EE])
        return self.model.config.ode_t1 + float(rng.uniform(-self.steer, self.steer))

    @contextlib.contextmanager
    def at(self, step: int):
        """The model's solves regularized as step ``step`` asks, for the step only."""
        if not self.enabled:
            yield
            return
        from ..model.extras import SolveExtras

        self.model.depth.extras = SolveExtras(kinetic=self.kinetic > 0,
                                              jacobian=self.jacobian > 0,
                                              t1=self.end_time(step), readout=self.keep_states,
                                              backprop_steps=self.backprop_steps,
                                              backprop_skip=self.backprop_skip)
        try:
            yield
        finally:
            self.model.depth.extras = None
            getattr(self.model.depth, "clear_step_states", lambda: None)()  # the graph goes

    def terms(self, targets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The terms of the last forward, by name, unweighted (the trainer adds each times its
        weight to the objective); ``targets``: the batch's, for the step read-outs."""
        regs = self.model.last_regularizers
        out = {}
        for name, weight in (("kinetic", self.kinetic), ("jacobian", self.jacobian)):
            if weight > 0:
                out[name] = regs[name]
        if self.readout > 0:
            out["step_readout"] = step_readout_loss(self.model, targets)
        return out

    def weight(self, name: str) -> float:
        return {"kinetic": self.kinetic, "jacobian": self.jacobian,
                "step_readout": self.readout}[name]


def step_readout_loss(model, targets: torch.Tensor) -> torch.Tensor:
    """The mean, over the states between solver steps of the last forward (every block's),
    of the cross-entropy of their read-out (final norm + head) against ``targets`` (-1:
    ignored, as in the model's own loss). The head runs at the positions with a target only,
    and each read-out is recomputed in the backward pass rather than kept (a vocabulary-sized
    tensor per state would undo what ode_grad = "checkpoint" saves)."""
    states = model.depth.last_step_states
    if not states:  # a one-step solve (an elastic draw) has none
        return model.tok_emb.weight.new_zeros(())
    keep = targets >= 0
    wanted = targets[keep]

    def readout(h: torch.Tensor) -> torch.Tensor:
        logits = model.lm_head(model.norm_f(h[keep]))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits, wanted)

    losses = [checkpoint(readout, h, use_reentrant=False) if torch.is_grad_enabled()
              else readout(h) for h in states]
    return torch.stack(losses).mean()
