"""Depth: how the per-position state is transformed between the embedding and the head.

``discrete`` is an ordinary stack of ``num_layers`` distinct pre-norm blocks. Each depth
module takes ``(x, state=None)``, hands every mixer evaluation its own cache from the decoding
state, and reports ``last_nfe``: the number of block evaluations in its last forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..mixers import MIXERS
from ..nn import MLP, make_norm
from .cache import DecodeState


class TransformerBlock(nn.Module):
    """Pre-norm block: x = x + Mixer(Norm(x)); x = x + MLP(Norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = make_norm(cfg.hidden_size, cfg)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.norm2 = make_norm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class DiscreteStack(nn.Module):
    """``num_layers`` distinct blocks, each applied once."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.last_nfe = 0

    def forward(self, x: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            cache = None
            if state is not None:
                cache = state.cache(("layer", i), layer.mixer.cache_factory)
            x = layer(x, cache)
        self.last_nfe = len(self.layers)
        return x


DEPTHS = {
    "discrete": DiscreteStack,
}
