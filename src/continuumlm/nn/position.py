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
        self.head_dim, self.base = head_dim, base
        self._build(max_seq_len)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The rotation frequencies, always computed in float32: a buffer would be rounded by
        ``model.to(torch.bfloat16)`` (0.3162 -> 0.3164), turning position 1500's angles by a
        quarter radian."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        return 1.0 / (self.base ** (exponents / self.head_dim))

    def _build(self, length: int) -> None:
        device = self.cos.device if hasattr(self, "cos") else None
        t = torch.arange(length, dtype=torch.float32, device=device)
        cos, sin = _full_width(torch.outer(t, self.inv_freq(device)))  # angles (T, D/2)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x: (..., T, D) at absolute positions offset .. offset+T-1 (q and k may be stacked
        in the leading dimensions and rotated in one call)."""
        T = x.shape[-2]
        if offset + T > self.cos.shape[0]:
            self._build(max(offset + T, 2 * self.cos.shape[0]))
        return _rotate(x, self.cos[offset:offset + T], self.sin[offset:offset + T])

    def rows(self, x: torch.Tensor, positions: torch.Tensor, limit: int) -> torch.Tensor:
        """x: (..., B, H, T, D) with each row's own positions (B, T), all below ``limit`` (a
        padded batch, whose rows count from their first real token)."""
        if not torch.compiler.is_compiling() and positions.numel():
            limit = max(limit, int(positions.max()) + 1)  # position_ids past the key count
        if limit > self.cos.shape[0]:
            self._build(max(limit, 2 * self.cos.shape[0]))
        return _rotate(x, self.cos[positions][:, None], self.sin[positions][:, None])

    def at(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: (..., 1, D), one token at the position held in the (1,) tensor ``pos`` (the
        static decoding step: no Python value or table size depends on the position, so the
        angles are computed here rather than read from the tables)."""
        return _rotate(x, *_full_width(pos.float()[:, None] * self.inv_freq(x.device)))


def _full_width(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) of angles (..., D/2), each widened to D: x * cos + swap_halves(x) * sin
    rotates (x1, x2) into (x1 cos - x2 sin, x2 cos + x1 sin) in three elementwise ops."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
