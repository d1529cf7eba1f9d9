"""AdamW with decay on matrices only, and a linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

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
