"""Rotary position embeddings (RoPE), applied to queries and keys inside attention."""

from __future__ import annotations

import torch
import torch.nn as nn


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels (first half with second half) by position-dependent angles.

    The cos/sin tables grow on demand, so RoPE models run past ``max_seq_len``.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(max_seq_len)

    def _build(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        angles = torch.outer(t, self.inv_freq)  # (T, D/2)
        cos, sin = angles.cos(), angles.sin()
        # full-width tables: x * cos + swap_halves(x) * sin_signed rotates (x1, x2) into
        # (x1 cos - x2 sin, x2 cos + x1 sin) in three elementwise ops
        self.register_buffer("cos", torch.cat((cos, cos), -1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: (..., T, D) at absolute positions offset .. offset+T-1 (q and k may be stacked
        in the leading dimensions and rotated in one call)."""
        T = x.shape[-2]
        if offset + T > self.cos.shape[0]:
            self._build(max(offset + T, 2 * self.cos.shape[0]))
        cos, sin = self.cos[offset:offset + T], self.sin[offset:offset + T]
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def at(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., 1, D), one token at the position held in the (1,) tensor ``pos`` (the
        static decoding step: no Python value or table size depends on the position, so the
        angles are computed here rather than read from the tables)."""
        angles = pos.float()[:, None] * self.inv_freq                  # (1, D/2)
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat((cos, cos), -1).to(x.dtype), torch.cat((-sin, sin), -1).to(x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
