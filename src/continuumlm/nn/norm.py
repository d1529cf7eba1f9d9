"""The one factory through which every normalization layer is built (``norm_type``)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Float32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 whatever the input (as flash-linear-attention keeps
    DeltaNet's o_norm, and as autocast runs LayerNorm); under autocast the output stays
    float32 like LayerNorm's, otherwise it takes the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != torch.float32:
            weight = weight.float()
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return torch.nn.functional.rms_norm(x.float(), self.normalized_shape, weight,
                                                    self.eps)
        # no autocast: float32 in and out, without the no-op conversions (each one a
        # dispatched operation, and a decoded DeltaNet token runs this once per evaluation)
        xf = x if x.dtype == torch.float32 else x.float()
        y = torch.nn.functional.rms_norm(xf, self.normalized_shape, weight, self.eps)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class DynamicTanh(nn.Module):
    """Dynamic Tanh (DyT; Zhu et al. 2025, "Transformers without Normalization"):
    y = gamma * tanh(alpha * x) + beta, a learned scalar alpha (0.5 at first) and per-channel
    gamma and beta; no statistics over the features, so each token's output depends on its own
    values only. Written here: torch has no DyT layer."""

    def __init__(self, dim: int, alpha: float = 0.5, bias: bool = True):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), alpha))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha * x) * self.weight
        return y + self.bias if self.bias is not None else y


def make_norm(dim: int, cfg) -> nn.Module:
    if cfg.norm_type == "layernorm":
        return nn.LayerNorm(dim, bias=cfg.bias)
    if cfg.norm_type == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    if cfg.norm_type == "dyt":
        return DynamicTanh(dim, bias=cfg.bias)
    raise ValueError(f"model.norm_type = {cfg.norm_type!r} is not one of layernorm, rmsnorm, "
                     f"dyt.")
