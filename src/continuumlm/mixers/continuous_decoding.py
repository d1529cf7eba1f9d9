"""Continuous attention's padded batches and its decoding, apart from the layer
(``mixers/continuous.py``): mixins of :class:`~continuumlm.mixers.continuous.ContinuousAttention`
that read its projections, kernel and quadrature through ``self``.

- :class:`ContinuousPadded`: a padded batch, each row's positions counted from its first real
  token (the quadrature's nodes and the exact forms' keys are those of the row alone).
- :class:`ContinuousDecoding`: one token through the frozen (fixed-capacity) cache layout, and
  the memory of ``model.ode_kv`` (``write`` at a solver step's or block's start, ``read`` by
  every evaluation of it).
"""

from __future__ import annotations

import torch

from . import spectral
from .cache import FrozenCache, FrozenSeqCache
from .padding import Padding


class ContinuousPadded:
    def _padded(self, x: torch.Tensor, cache, padding: Padding) -> torch.Tensor:
        """A padded batch: each row's positions count from its first real token, so a row's
        kernel, quadrature nodes and values are those of the row alone. The exact forms mask
        pad keys; the quadrature reads the values at (first real token + node position), which
        needs each row's real tokens to be contiguous (left or right padding, and decoding
        after a left-padded prompt)."""
        self._check_padding(padding)
        if self.exact:
            return self._padded_exact(x, cache, padding)
        B, T, C = x.shape
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            (v,) = cache.append(v)
        return self._padded_quadrature(x, v, padding)

    def _check_padding(self, padding: Padding) -> None:
        if not self.causal:
            raise ValueError("continuous attention takes padded batches in decoder mode only "
                             "(an encoder's quadrature spans the whole window).")
        keys = padding.keys
        padding.require_one_stretch("continuous attention")
        if not padding.derived and not torch.compiler.is_compiling():
            own = Padding.from_mask(keys, padding.positions.shape[1]).positions
            real = padding.valid  # what a pad's position is does not matter
            if not torch.equal(own[real], padding.positions[real]):
                raise ValueError("continuous attention places its kernel at each token's "
                                 "position counted from its row's first real token; "
                                 "position_ids that differ from those would make it read "
                                 "other tokens than the positions say. Leave position_ids "
                                 "out.")

    def _padded_quadrature(self, x: torch.Tensor, v: torch.Tensor,
                           padding: Padding) -> torch.Tensor:
        """The quadrature of a padded batch's queries over the values ``v`` of every token so
        far, each row's nodes counted from its first real token."""
        B, T, C = x.shape
        first = padding.keys.long().argmax(1)                           # (B,) first real token
        y = spectral.padded_gathered(v, self.quadrature, padding.positions, first,
                                     self.query_chunk)
        return self.dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))

    def _padded_exact(self, x: torch.Tensor, cache, padding: Padding) -> torch.Tensor:
        B, T, C = x.shape
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        pos = padding.positions
        q, k = self._keys(x, pos, pos, dt)
        if cache is not None:
            k, v = cache.append(k, v.to(dt))
        return self._padded_exact_attend(x, q, k, v, padding)

    def _padded_exact_attend(self, x, q, k, v, padding: Padding) -> torch.Tensor:
        B, T, C = x.shape
        dt, pos = q.dtype, padding.positions
        mask = padding.attention_mask(causal=True)                      # (B, 1, T, L)
        with torch.autocast(x.device.type, enabled=False):
            if self.relative:
                k_pos = (padding.keys.long().cumsum(1) - 1).clamp_min(0)  # (B, L)
                d = (pos[:, :, None] - k_pos[:, None, :]).abs()          # (B, T, L)
                bias = self.distance_prior(d).to(dt).transpose(0, 1)     # (B, H, T, L)
                y = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v.to(dt), attn_mask=bias.masked_fill(~mask, float("-inf")),
                    scale=1.0)
            else:
                y = spectral.sdpa_any_dims(q, k, v.to(dt), mask, False)
        y = y.to(x.dtype).transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.out_proj(y))



class ContinuousDecoding:
    def extend_frozen(self, x: torch.Tensor, cache: FrozenSeqCache) -> torch.Tensor:
        """One token through a fixed-capacity cache, its position a tensor (the range
        warning is the eager passes' alone: a compiled step reads no Python value)."""
        B, T, C = x.shape
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        q_pos = cache.static.pos
        if self.exact:
            dt = torch.promote_types(self.coef.dtype, torch.float32)
            q, k = self._keys(x, q_pos, q_pos, dt)
            k, v = cache.write(k, v.to(dt))
            return self._exact_out(x, q, k, v, q_pos, cache.static.mask, False, None)
        # causal quadrature reads only tokens <= pos, so the unwritten tail of the buffer is
        # never touched
        (v,) = cache.write(v)
        return self._frozen_quadrature_out(x, v, q_pos)

    def _frozen_quadrature_out(self, x, v, q_pos) -> torch.Tensor:
        B, T, C = x.shape
        # composite quadrature: enough panels for any position the buffer holds (one more
        # than its last position needs, for a count that float rounding lifts) (integer
        # arithmetic: the capacity is symbolic in a compiled step)
        panels = -(-(v.shape[2] - 1) // self.panel) + 1
        y = self._gathered(v, q_pos, panels)
        return self.dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))

    # ------------------------------------------------------------------ memory (ode_kv)

    def write(self, m: torch.Tensor, cache, padding: Padding | None = None) -> None:
        """Put the memory of ``m``'s T tokens into ``cache`` (``model.ode_kv = "step"`` or
        ``"block"``): their values, and with the exact forms their keys (positional, plus
        the content keys in bias mode); the frozen layout one token at its tensor position."""
        if not self.causal:
            raise ValueError("continuous attention takes its memory from a separate input in "
                             "decoder mode only; use model.ode_kv = 'evaluation' with mode = "
                             "'encoder'.")
        B, T, C = m.shape
        v = self.v_proj(m).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        frozen = isinstance(cache, FrozenCache)
        if padding is not None:
            self._check_padding(padding)
        if not self.exact:
            cache.write(v) if frozen else cache.append(v)
            return
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        if frozen:
            pos = cache.static.pos
        elif padding is not None:
            pos = padding.positions
        else:
            pos = torch.arange(cache.length, cache.length + T, device=m.device)
        k = self._keys(m, pos, pos, dt, "k")[1]
        cache.write(k, v.to(dt)) if frozen else cache.append(k, v.to(dt))

    def read(self, x: torch.Tensor, cache, padding: Padding | None = None) -> torch.Tensor:
        """Mix the memory in ``cache`` (every token so far, the last T ``x``'s own, put there
        by :meth:`write`) into ``x``'s T tokens: the kernel's quadrature over the values, or
        with the exact forms queries from ``x`` (their content part in bias mode) against the
        written keys. Writes nothing."""
        B, T, C = x.shape
        if isinstance(cache, FrozenCache):
            q_pos = cache.static.pos
            if not self.exact:
                return self._frozen_quadrature_out(x, cache.buffers[0], q_pos)
            dt = torch.promote_types(self.coef.dtype, torch.float32)
            q = self._keys(x, q_pos, q_pos, dt, "q")[0]
            k, v = cache.buffers
            return self._exact_out(x, q, k, v, q_pos, cache.static.mask, False, None)
        offset = cache.length - T
        self._check_range(cache.length)
        if padding is not None:
            if not self.exact:
                return self._padded_quadrature(x, cache.contents()[0], padding)
            dt = torch.promote_types(self.coef.dtype, torch.float32)
            q = self._keys(x, padding.positions, padding.positions, dt, "q")[0]
            return self._padded_exact_attend(x, q, *cache.contents(), padding)
        if not self.exact:
            return self._quadrature_out(x, cache.contents()[0], offset)
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        q_pos = torch.arange(offset, offset + T, device=x.device)
        q = self._keys(x, q_pos, q_pos, dt, "q")[0]
        k, v = cache.contents()
        return self._exact_attend(x, q, k, v, q_pos, offset)
