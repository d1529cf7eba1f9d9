"""A plugin mixer of the shape the registry allows with no decoding cache at all:
``cache_factory = None`` and ``forward(x, cache=None)`` that refuses a cache. It trains and
evaluates; generation recomputes the context (``--no-cache``), and cached generation is refused
by name. The tests hold this shape beside the example plugin's cached mixer."""

from __future__ import annotations

import torch
import torch.nn as nn

import continuumlm


@continuumlm.register_mixer("running_mean")
class RunningMeanMixer(nn.Module):
    """Each position mixes the mean of the values at positions <= its own (exactly causal)."""

    cache_factory = None  # decodes only by recomputing the context

    def __init__(self, cfg) -> None:
        super().__init__()
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        if cache is not None:
            raise TypeError("running_mean keeps no decoding cache")
        v = self.value(x)
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return self.out(v.cumsum(dim=1) / counts[:, None])
