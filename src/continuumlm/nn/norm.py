"""The one factory through which every normalization layer is built (``norm_type``)."""

from __future__ import annotations

import torch.nn as nn


def make_norm(dim: int, cfg) -> nn.Module:
    if cfg.norm_type == "layernorm":
        return nn.LayerNorm(dim, bias=cfg.bias)
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    raise ValueError(f"model.norm_type = {cfg.norm_type!r} is not one of layernorm, rmsnorm.")
