from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dropout import SharedDropout
from .linear import make_linear


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear -> dropout."""

    def __init__(self, cfg):
        super().__init__()
        self.fc = make_linear(cfg.hidden_size, cfg.ffn_hidden_size, cfg)
        self.proj = make_linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg)
        self.proj.residual_proj = True  # scaled init, see LanguageModel._init_weights
        self.dropout = SharedDropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        return self.dropout(y) if self.dropout.p else y
