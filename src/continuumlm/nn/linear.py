"""The one factory through which every projection is built, so ``use_bitnet`` reaches all of them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BitLinear(nn.Linear):
    """BitNet b1.58 linear layer: ternary weights {-1, 0, +1} scaled by mean |W|, activations
    normalized over the feature dimension (RMS, no parameters) and quantized to 8 bits per token
    (absmax). Full-precision latent weights are trained through a straight-through estimator,
    so the optimizer sees ordinary gradients. Every statistic is per token: nothing mixes
    positions, so a causal model stays causal."""

    eps = 1e-5

    def quantized_weight(self) -> torch.Tensor:
        w = self.weight
        scale = w.abs().mean().clamp(min=self.eps)
        return (w / scale).round().clamp(-1, 1) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight + (self.quantized_weight() - self.weight).detach()
        x = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=self.eps)
        xq = (x * scale).round().clamp(-128, 127) / scale
        x = x + (xq - x).detach()
        return F.linear(x, w, self.bias)


def ternary_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Inference export: for every BitLinear, its weight as int8 in {-1, 0, 1} (``NAME.weight``)
    and the float scale (``NAME.weight_scale``); other tensors are left out. Save the result
    with ``safetensors.torch.save_file``."""
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, BitLinear):
            with torch.no_grad():
                scale = m.weight.abs().mean().clamp(min=m.eps)
                out[f"{name}.weight"] = (m.weight / scale).round().clamp(-1, 1).to(torch.int8)
                out[f"{name}.weight_scale"] = scale.reshape(1).float()
    return out


def make_linear(in_features: int, out_features: int, cfg, bias: bool | None = None) -> nn.Linear:
    """A linear layer honoring ``cfg.use_bitnet`` and ``cfg.bias``."""
    bias = cfg.bias if bias is None else bias
    klass = BitLinear if cfg.use_bitnet else nn.Linear
    return klass(in_features, out_features, bias=bias)
