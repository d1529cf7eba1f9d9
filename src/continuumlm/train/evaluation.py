"""Validation during training: the mean loss over fixed windows of the validation split, and
when it is due."""

from __future__ import annotations

import torch

from ..data import eval_batches
from ..eval.perplexity import loss_sum
from ..model.lm import LanguageModel
from . import distributed as D


@torch.no_grad()
def evaluate_loss(model: LanguageModel, data: torch.Tensor, seq_len: int, batch_size: int,
                  max_windows: int | None, device: torch.device, amp=None,
                  dist_env: D.DistEnv | None = None) -> float:
    """Mean cross-entropy (nats/token) over fixed, non-overlapping windows. With ``dist_env``
    the batches are dealt round-robin to the ranks and the sums all-reduced."""
    was_training = model.training
    model.eval()
    rank, world = (dist_env.rank, dist_env.world_size) if dist_env else (0, 1)
    mine = (b for i, b in enumerate(eval_batches(data, seq_len, batch_size, max_windows))
            if i % world == rank)
    total, count = loss_sum(model, mine, device, amp)
    model.train(was_training)
    if dist_env is not None:
        total, count = dist_env.all_reduce_sum([total, count], device)
    return total / max(count, 1)


class Evaluator:
    """Scores the validation split every ``train.eval_interval`` steps and at the last one.
    DDP: each rank scores its share of the windows; FSDP: every forward is a collective, so
    every rank runs all of them."""

    def __init__(self, data: torch.Tensor, t, device: torch.device, amp, dist: D.DistEnv,
                 fsdp: bool):
        self.data, self.t, self.device, self.amp = data, t, device, amp
        self.dist = None if fsdp or not dist.enabled else dist

    def due(self, step: int) -> bool:
        return step % self.t.eval_interval == 0 or step >= self.t.max_steps

    def __call__(self, model: LanguageModel) -> float:
        t = self.t
        return evaluate_loss(model, self.data, t.seq_len, t.batch_size,
                             t.eval_iters * t.batch_size, self.device, self.amp, self.dist)
