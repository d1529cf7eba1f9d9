"""Any-depth training ([train.any_depth], config/any_depth.py): the model's own solve gives the
language-model loss, and its next-token distribution (detached) teaches coarse solves of the
same weights, drawn per optimizer step, on the same batch: a KL term toward it, optionally the
language-model loss and a cross-entropy against its greedy token. One run, no teacher.

The draw is a function of (train.seed, step) only, as elastic depth's is, so a resumed run
draws what the uninterrupted one drew. A coarse solve runs with ``LanguageModel.set_solver``
switched for its forward and switched back after it: evaluation and checkpoints see the
model's own solve."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .elastic import ElasticDepth


class AnyDepth:
    def __init__(self, model, t):
        self.model = model
        cfg = t.any_depth
        self.enabled = cfg.enabled
        self.solves = cfg.solves()
        self.draws, self.every, self.seed = int(cfg.draws), int(cfg.every), int(t.seed)
        self.weight, self.lm_weight = float(cfg.weight), float(cfg.lm_weight)
        self.top1_weight = float(cfg.top1_weight)
        self.gate_weight = float(cfg.gate_weight)
        self.step_weight = float(cfg.step_weight)
        if self.enabled and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # DDP reduces gradients for one forward per backward; a coarse solve's forward
            # through the same wrapped module before the backward is not that
            raise ConfigError("train.any_depth runs several forwards of the model per "
                              "backward, which the multi-process (DDP/FSDP) trainer does not "
                              "reduce; train it in one process, or leave [train.any_depth] "
                              "out.")

    def drawn(self, step: int) -> list[tuple[str, int]]:
        """The coarse solves optimizer step ``step`` trains (none off the `every` grid)."""
        if not self.enabled or step % self.every != 0:
            return []
        rng = np.random.default_rng([self.seed, step, 0xA11D])
        pick = rng.choice(len(self.solves), size=self.draws, replace=False)
        return [self.solves[int(i)] for i in sorted(pick)]

    def terms(self, logits_of, own_logits: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        """The step's terms, unweighted and averaged over the drawn solves: "kl" (KL(own ||
        coarse) per position), "lm" (the coarse solves' own loss) and "top1" (cross-entropy
        against the own solve's greedy token); ``logits_of()``: (logits, loss) of the batch
        as the task computes them, with the model's solve as it is set."""
        solves = self.drawn(step)
        if not solves:
            return {}
        target = F.log_softmax(own_logits.detach().float(), -1)
        greedy = target.argmax(-1)
        base = (self.model.config.ode_solver, self.model.config.ode_steps)
        own_nfe = self.model.depth.last_nfe
        kl = lm = top1 = 0.0
        for solver, steps in solves:
            self.model.set_solver(solver, steps)
            try:
                logits, loss = logits_of()
            finally:
                self.model.set_solver(*base)
            logp = F.log_softmax(logits.float(), -1)
            kl = kl + ElasticDepth.consistency(logits, target)
            lm = lm + loss
            if self.top1_weight > 0:
                top1 = top1 + F.nll_loss(logp.reshape(-1, logp.shape[-1]), greedy.reshape(-1))
        # the step's logged NFE stays the own solve's (the drafts are named in the log)
        self.model.depth.last_nfe = own_nfe
        n = len(solves)
        out = {"kl": kl / n, "lm": lm / n}
        if self.top1_weight > 0:
            out["top1"] = top1 / n
        return out

    @staticmethod
    def _positions(states: list[torch.Tensor], own_logits: torch.Tensor,
                   targets: torch.Tensor | None) -> list[torch.Tensor]:
        """The states at the positions ``own_logits`` has: all of them (B, T, C), or, from a
        task that reads the head at its targets only (MQAR: own_logits (N, V)), those with a
        target (N, C), in the same order."""
        if own_logits.dim() == states[0].dim():
            return states
        if targets is None:
            raise ValueError("the own solve's logits are at its targets only: pass the targets "
                             "to read the states at the same positions.")
        keep = targets >= 0
        return [h[keep] for h in states]

    def gate_loss(self, own_logits: torch.Tensor,
                  targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """The halting gate's binary cross-entropy over the own solve's states between steps
        (``model.depth.last_step_states``, read before any draft's forward replaces them): the
        label is whether the state's greedy token already equals the own solve's. The gate
        reads detached normalized states, so only its own weights learn from this."""
        if self.gate_weight <= 0:
            return None
        model = self.model
        states = model.depth.last_step_states
        if not states:  # a one-step solve has no state between steps
            return model.exit_gate.weight.new_zeros(())
        final = own_logits.detach().argmax(-1)
        losses = []
        states = self._positions(states, own_logits, targets)
        with torch.no_grad():
            feats = [model.norm_f(h.detach()) for h in states]
            labels = [(model.lm_head(f).argmax(-1) == final).float() for f in feats]
        for f, label in zip(feats, labels):
            logit = model.exit_gate(f).squeeze(-1).float()
            losses.append(F.binary_cross_entropy_with_logits(logit, label))
        return torch.stack(losses).mean()

    def step_loss(self, own_logits: torch.Tensor,
                  targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """The mean, over the own solve's states between steps (``last_step_states``, read
        before any draft's forward replaces them), of KL(own || the state's read-out through
        the final norm and head), the own distribution and the read-out's weights detached.
        Each read-out is recomputed in the backward pass rather than kept (a vocabulary-sized
        tensor per state)."""
        if self.step_weight <= 0:
            return None
        model = self.model
        states = model.depth.last_step_states
        if not states:  # a one-step solve (an elastic draw) has none
            return model.tok_emb.weight.new_zeros(())
        states = self._positions(states, own_logits, targets)
        if torch.is_grad_enabled() and any(h.requires_grad for h in states):
            # truncated backpropagation (backprop_steps): the states of the steps run without
            # autograd teach nothing, and would only dilute the mean
            states = [h for h in states if h.requires_grad]
        target = F.log_softmax(own_logits.detach().float(), -1)
        # the read-out's weights (final norm, head) as constants here: the term moves the
        # states toward what the read-out makes of the own solve's. Through them it would
        # reach the one head every state shares, and a head that reads every state alike
        # (the unigram distribution) zeroes the term: a way out of learning at all
        norm = {n: p.detach() for n, p in model.norm_f.named_parameters()}
        head = {n: p.detach() for n, p in model.lm_head.named_parameters()}

        def readout_kl(h: torch.Tensor) -> torch.Tensor:
            normed = torch.func.functional_call(model.norm_f, norm, (h,))
            return ElasticDepth.consistency(
                torch.func.functional_call(model.lm_head, head, (normed,)), target)

        losses = [checkpoint(readout_kl, h, use_reentrant=False) if torch.is_grad_enabled()
                  else readout_kl(h) for h in states]
        return torch.stack(losses).mean()

    def objective(self, terms: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.weight * terms["kl"] + self.lm_weight * terms["lm"]
                + self.top1_weight * terms.get("top1", 0.0))
