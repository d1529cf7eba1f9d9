"""A training step's objective and the terms it logs: the task's loss, the model's own penalty
(the continuous mixer's Sobolev term, annealed), and the optional terms of [train.elastic] (the
consistency KL toward a finer solve), [train.any_depth] (coarse solves taught by the own
solve), [train.distill] (the KL toward a teacher) and
[train.regularize] (the solve's integrals, and STEER's end time) and [train.layer_skip] (a
discrete stack's early exits), each summed over the step's
micro-batches on the device, all-reduced under torchrun, and read once per step."""

from __future__ import annotations

import contextlib
import math

import torch

from . import distributed as D
from .any_depth import AnyDepth
from .distill import Teacher
from .elastic import ElasticDepth, SolveRegularizers
from .layer_skip import LayerSkip

REGULARIZERS = ("kinetic", "jacobian", "step_readout")
ANY_DEPTH = ("kl", "lm", "top1", "gate", "step")  # [train.any_depth]'s terms, logged as any_depth_NAME


class StepObjective:
    """What each micro-batch of a step adds to the loss, and what the step logs of it."""

    def __init__(self, model, t, tokenizer, device: torch.device, state: dict | None):
        self.model = model
        self.elastic = ElasticDepth(model, t)
        self.teacher = Teacher(t, tokenizer, device, state)
        self.solve_reg = SolveRegularizers(model, t)
        self.any_depth = AnyDepth(model, t)
        self.layer_skip = LayerSkip(model, t)
        self.device = device
        # float64 (not on MPS, which lacks it), so the sums are the ones Python floats gave
        self.acc = torch.float32 if device.type == "mps" else torch.float64
        # the last step's (solver, steps) drawn, its terms as logged and its penalty
        self.draw: tuple[str, int] | None = None
        self.consistency: float | None = math.nan
        self.distill: float | None = None
        self.regularizers: dict[str, float] = {}
        self.any_depth_terms: dict[str, float] = {}
        self.exit_loss: float | None = None
        self.exit_kl: float | None = None
        self.penalty = math.nan

    def state(self) -> dict:
        """What a checkpoint keeps of it (the teacher's digest)."""
        return self.teacher.state()

    @contextlib.contextmanager
    def at(self, step: int):
        """The model solving as optimizer step ``step`` draws and regularizes it, for the step
        only; yields the draw (None for a run that does not draw)."""
        with self.solve_reg.at(step):
            if not self.elastic.enabled:
                yield None
                return
            self.draw = self.elastic.draw(step)
            with self.elastic.at(*self.draw):
                yield self.draw

    def begin(self) -> None:
        """Zero the step's sums (on the device: no wait for the host until :meth:`read`)."""
        zero = torch.zeros((), dtype=self.acc, device=self.device)
        self.total, self.kl, self.kd = zero, zero.clone(), zero.clone()
        self.exits = zero.clone()  # [train.layer_skip]'s early-exit loss
        self.exit_kls = zero.clone()  # and its KL toward the stack
        self.reg_sums = torch.zeros(len(REGULARIZERS), dtype=self.acc, device=self.device)
        self.any_sums = torch.zeros(len(ANY_DEPTH), dtype=self.acc, device=self.device)
        self.compared = False  # whether this step has a consistency term
        self.taught_drafts = False  # whether this step trained coarse solves (any_depth)
        self.gated = False  # whether this step trained the halting gate (any_depth)

    def micro_batch(self, task, forward, x, y, draw, step: int, anneal: float):
        """One micro-batch's (loss, penalty, objective), its terms added to the step's sums."""
        target = (self.elastic.target(lambda: task.forward(forward, x, y)[0], *draw, step)
                  if draw else None)
        self.compared = self.compared or target is not None
        taught = self.teacher.target(task, x, y) if self.teacher.enabled else None
        with self.layer_skip.recording() as outputs:
            logits, loss = task.forward(forward, x, y)
        penalty = self.model.penalty()
        objective = loss + anneal * penalty
        exits = self.layer_skip.exit_loss(outputs, y)
        if exits is not None:
            objective = objective + self.layer_skip.weight * exits
            self.exits += exits.detach().to(self.acc)
        exit_kl = self.layer_skip.exit_kl(outputs, logits, y)
        if exit_kl is not None:
            objective = objective + self.layer_skip.kl_weight * exit_kl
            self.exit_kls += exit_kl.detach().to(self.acc)
        if target is not None:
            kl = self.elastic.consistency(logits, target)
            objective = objective + self.elastic.weight * kl
            self.kl += kl.detach().to(self.acc)
        if taught is not None:  # the same KL, toward the teacher
            kd = self.elastic.consistency(logits, taught)
            objective = objective + self.teacher.weight * kd
            self.kd += kd.detach().to(self.acc)
        for name, term in self.solve_reg.terms(y).items():
            objective = objective + self.solve_reg.weight(name) * term
            self.reg_sums[REGULARIZERS.index(name)] += term.detach().to(self.acc)
        self.step_index = step
        gate = self.any_depth.gate_loss(logits, y)  # the own solve's states, before any draft's
        if gate is not None:
            objective = objective + self.any_depth.gate_weight * gate
            self.any_sums[ANY_DEPTH.index("gate")] += gate.detach().to(self.acc)
            self.gated = True
        steps = self.any_depth.step_loss(logits, y)  # also the own solve's states
        if steps is not None:
            objective = objective + self.any_depth.step_weight * steps
            self.any_sums[ANY_DEPTH.index("step")] += steps.detach().to(self.acc)
        if self.any_depth.enabled:  # after the own solve: its logits are the target
            drafts = self.any_depth.terms(lambda: task.forward(forward, x, y), logits, step)
            if drafts:
                self.taught_drafts = True
                objective = objective + self.any_depth.objective(drafts)
                for name, term in drafts.items():
                    self.any_sums[ANY_DEPTH.index(name)] += term.detach().to(self.acc)
        return loss, penalty, objective

    def add_loss(self, loss: torch.Tensor) -> None:
        self.total += loss.detach().to(self.acc)

    def failed(self) -> None:
        """The step's loss is not a number (an adaptive solve gave up)."""
        self.total = torch.full((), math.nan, dtype=self.acc, device=self.device)

    def all_reduce(self, dist) -> None:
        """The logged terms of the global batch, as the loss is (the elastic draw, and so
        whether a consistency term ran, is the same on every rank)."""
        stats = torch.cat([torch.stack([self.total, self.kl, self.kd, self.exits,
                                        self.exit_kls]), self.reg_sums])
        D.dist.all_reduce(stats, op=D.dist.ReduceOp.SUM)
        stats = stats / dist.world_size
        self.total, self.kl, self.kd, self.exits, self.exit_kls = stats[:5]
        self.reg_sums = stats[5:]
        # (the any_depth sums stay this rank's: its drafts refuse several processes, and its
        # gate and step terms are logged as rank 0 computed them; their gradients are reduced
        # as any other)

    def read(self, penalty: torch.Tensor | None, grad_norm: torch.Tensor,
             grad_accum: int) -> tuple[float, float]:
        """The step's one host synchronisation: (mean loss, gradient norm) as floats, the
        logged terms kept (``penalty`` None: the step failed before it had one)."""
        nan = torch.full((), math.nan, dtype=self.acc, device=self.device)
        penalty = nan if penalty is None else penalty.detach().to(self.acc)
        summed, self.penalty, norm, kl, kd, exits, exit_kls, *rest = torch.cat(
            [torch.stack([self.total, penalty,
                          grad_norm.detach().to(device=self.device, dtype=self.acc),
                          self.kl, self.kd, self.exits, self.exit_kls]), self.reg_sums,
             self.any_sums]).tolist()
        self.exit_loss = exits / grad_accum if self.layer_skip.exits else None
        self.exit_kl = (exit_kls / grad_accum if self.layer_skip.exits
                        and self.layer_skip.kl_weight > 0 else None)
        regs, drafts = rest[:len(REGULARIZERS)], rest[len(REGULARIZERS):]
        logged = {"top1": self.taught_drafts and self.any_depth.top1_weight > 0,
                  "gate": self.gated, "kl": self.taught_drafts, "lm": self.taught_drafts,
                  "step": self.any_depth.step_weight > 0}
        self.any_depth_terms = {f"any_depth_{n}": v / grad_accum
                                for n, v in zip(ANY_DEPTH, drafts) if logged[n]}
        if self.taught_drafts:
            self.any_depth_terms["any_depth_drafts"] = [f"{a}:{b}" for a, b in
                                                        self.any_depth.drawn(self.step_index)]
        self.consistency = kl / grad_accum if self.compared else None
        self.distill = kd / grad_accum if self.teacher.enabled else None
        self.regularizers = {n: v / grad_accum for n, v in zip(REGULARIZERS, regs)
                             if self.solve_reg.weight(n) > 0}
        return summed / grad_accum, norm

    def fields(self, step: int) -> dict:
        """What a step's log line holds of it: a regularized run's regularizers (unweighted),
        distillation's term and STEER's end time; an elastic run's solver and step count, and
        its consistency term on the steps that have it. ``step``: the steps taken."""
        out: dict = {**self.regularizers, **self.any_depth_terms}
        if self.distill is not None:
            out["distill"] = self.distill
        if self.exit_loss is not None:
            out["exit_loss"] = self.exit_loss
        if self.exit_kl is not None:
            out["exit_kl"] = self.exit_kl
        if self.solve_reg.steer:
            out["ode_t1"] = self.solve_reg.end_time(step - 1)
        if self.draw is None:
            return out
        out.update({"ode_solver": self.draw[0], "ode_steps": self.draw[1]})
        if self.elastic.weight > 0 and self.consistency is not None:
            out["consistency"] = self.consistency
        return out
