"""AdamW with decay on matrices only, and a linear-warmup + cosine learning-rate schedule,
with the warnings about schedules that do not do what their settings suggest."""

from __future__ import annotations

import copy
import math

import torch


def make_optimizer(model: torch.nn.Module, tcfg, device_type: str) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device_type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), **extra)


def lr_at(step: int, tcfg) -> float:
    """Learning rate for optimizer update number ``step`` (0-based)."""
    decay_steps = tcfg.lr_decay_steps or tcfg.max_steps
    if step < tcfg.warmup_steps:
        return tcfg.lr * (step + 1) / (tcfg.warmup_steps + 1)
    if step >= decay_steps:
        return tcfg.min_lr
    ratio = (step - tcfg.warmup_steps) / max(1, decay_steps - tcfg.warmup_steps)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (tcfg.lr - tcfg.min_lr)


def schedule_warnings(t) -> list[str]:
    """What is odd about [train]'s schedule, said at the start of a run, never refused: a
    min_lr above lr, or a warm-up that leaves no cosine decay."""
    out = []
    if t.min_lr > t.lr:
        out.append(f"warning: train.min_lr ({t.min_lr}) is larger than train.lr ({t.lr}), so "
                   f"the cosine schedule raises the learning rate from lr to min_lr instead of "
                   f"decaying it; set train.min_lr below lr (e.g. lr / 10) if that is not what "
                   f"you want.")
    horizon = t.lr_decay_steps or t.max_steps
    if 0 < min(horizon, t.max_steps) <= t.warmup_steps:
        end = (f"the end of the cosine decay (train."
               f"{'lr_decay_steps' if t.lr_decay_steps else 'max_steps'} = {horizon})"
               if horizon <= t.max_steps else f"train.max_steps ({t.max_steps})")
        out.append(f"warning: train.warmup_steps ({t.warmup_steps}) is not below {end}, so the "
                   f"learning rate only climbs toward train.lr, with no cosine decay; set "
                   f"train.warmup_steps to a fraction of the run (e.g. a tenth) if that is not "
                   f"what you want.")
    return out


def moved_horizon_warning(saved, t, step: int) -> str | None:
    """Without train.lr_decay_steps the cosine ends at max_steps: a resume at ``step`` that
    changes max_steps (``saved``: the run's [train] as saved, ``t``: as resumed) moves it, and
    the learning rate jumps. Said, never refused."""
    horizon = saved.lr_decay_steps or saved.max_steps
    if t.lr_decay_steps is not None or horizon == t.max_steps:
        return None
    before = copy.copy(t)  # the saved schedule, without validating the rest again
    object.__setattr__(before, "lr_decay_steps", horizon)
    return (f"warning: --resume with train.max_steps = {t.max_steps} and no "
            f"train.lr_decay_steps: the learning rate's cosine now ends at step {t.max_steps}, "
            f"not {horizon}, so at step {step} it jumps from {lr_at(step, before):.3g} to "
            f"{lr_at(step, t):.3g}. Set train.lr_decay_steps = {horizon} to keep the schedule.")
