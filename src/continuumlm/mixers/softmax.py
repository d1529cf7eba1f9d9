"""Multi-head softmax self-attention with a fused QKV projection and a KV cache."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn import RotaryEmbedding, SharedDropout, linear_rows, make_linear
from ..registry import register_mixer
from .cache import FrozenCache, FrozenSeqCache, KVCache
from .padding import Padding, mix

# the last chunk mask made: (key, mask). A verifying pass of k + 1 drafted tokens asks every
# layer (discrete) or every field evaluation (ODE: 16 for RK4 x 4) for the same mask; making it
# costs two aranges, a comparison and, inside scaled_dot_product_attention, a boolean-to-
# additive conversion, about 7 us each time against about 120 us for a whole evaluation at
# batch 1. One entry: a stream asks for one mask per pass, and a swapped entry is atomic.
_chunk_memo: tuple | None = None


def chunk_mask(offset: int, T: int, L: int, like: torch.Tensor) -> torch.Tensor:
    """The additive mask (T, L) of ``T`` queries at positions ``offset``.. against ``L`` keys:
    0 where key j <= offset + i, -inf elsewhere (what a boolean mask means to
    scaled_dot_product_attention, which converts one to this), in ``like``'s dtype and
    device. Remembered for the next call with the same sizes, mode and dtype; made anew
    while torch.compile traces or CUDA records a graph."""
    global _chunk_memo
    # neither read nor kept while torch.compile traces (a kept tensor would be an input the
    # graph guards on) or while CUDA records a graph (the mask's memory holds its values
    # only when the graph replays)
    fresh = torch.compiler.is_compiling() or (
        like.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    key = (offset, T, L, like.dtype, like.device, torch.is_inference_mode_enabled())
    memo = _chunk_memo
    if not fresh and memo is not None and memo[0] == key:
        return memo[1]
    q_pos = torch.arange(offset, offset + T, device=like.device)[:, None]
    seen = torch.arange(L, device=like.device)[None, :] <= q_pos
    mask = torch.zeros(T, L, dtype=like.dtype, device=like.device).masked_fill(
        ~seen, float("-inf"))
    if not fresh:
        _chunk_memo = (key, mask)
    return mask


@register_mixer("softmax")
class SoftmaxAttention(nn.Module):
    """Causal (decoder) or bidirectional (encoder) scaled dot-product attention."""

    cache_factory = KVCache
    supports_padding = True  # pad keys masked, positions counted per row (mixers/padding.py)

    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.causal = cfg.mode == "decoder"
        self.qkv = make_linear(cfg.hidden_size, 3 * cfg.hidden_size, cfg)
        self.out_proj = make_linear(cfg.hidden_size, cfg.hidden_size, cfg)
        self.out_proj.residual_proj = True
        self.attn_drop = SharedDropout(cfg.dropout)  # on the attention weights
        self.resid_dropout = SharedDropout(cfg.dropout)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len) if cfg.position == "rope" else None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                padding: Padding | None = None) -> torch.Tensor:
        """The whole sequence ``x`` (B, T, C); with a cache, :meth:`extend` or
        :meth:`extend_frozen` by its layout."""
        if cache is not None:
            return mix(self, x, cache, padding)
        return self._attend(x, None, padding)

    def extend(self, x: torch.Tensor, cache: KVCache,
               padding: Padding | None = None) -> torch.Tensor:
        """Extend the cache by ``x``'s k >= 1 tokens and attend from them to every token so
        far: a prompt, a decoded token, or drafted tokens verified in one pass."""
        if not self.causal:
            raise ValueError("incremental decoding needs mode = 'decoder'; an encoder "
                             "attends to future tokens, which do not exist yet.")
        return self._attend(x, cache, padding)

    def _attend(self, x: torch.Tensor, cache: KVCache | None,
                padding: Padding | None) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        offset = cache.length if cache is not None else 0
        if self.rope is not None and padding is not None:  # each row from its first token
            q, k = self.rope.rows(qkv[:2], padding.positions, padding.keys.shape[1]).unbind(0)
            v = qkv[2]
        elif self.rope is not None:  # q and k rotated in one call
            q, k = self.rope(qkv[:2], offset).unbind(0)
            v = qkv[2]
        else:
            q, k, v = qkv.unbind(0)
        if cache is not None:
            k, v = cache.append(k, v)
        return self._attention(x, q, k, v, offset, padding)

    def _attention(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   offset: int, padding: Padding | None) -> torch.Tensor:
        """Queries ``q`` (B, H, T, D) of the tokens at ``offset``.. against keys and values
        (B, H, L, D) of every token so far, through the output projection."""
        B, T, C = x.shape
        mask, is_causal = None, False
        if padding is not None:
            mask = padding.attention_mask(self.causal)
        elif self.causal:
            if offset == 0:
                is_causal = T > 1
            elif T > 1:  # a chunk after cached tokens: query i sees keys <= offset + i
                mask = chunk_mask(offset, T, k.shape[-2], q)
        if self.attn_drop.active() and self.attn_drop.frozen:
            y = self._attend_frozen_dropout(q, k, v, mask, is_causal)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal,
                dropout_p=self.attn_drop.p if self.attn_drop.active() else 0.0)
        y = self.out_proj(y.transpose(1, 2).reshape(B, T, C))
        return self.resid_dropout(y) if self.resid_dropout.p else y

    def write(self, x: torch.Tensor, cache: KVCache, padding: Padding | None = None) -> None:
        """Extend the cache with the keys and values of ``x`` without attending: what a token
        that stopped integrating early (per-token exit) leaves for later tokens to read, and
        the memory of a solver step or block (``model.ode_kv``; :meth:`read` attends to it)."""
        B, T, C = x.shape
        # the keys' and values' rows of the fused projection alone (no queries are asked for)
        kv = linear_rows(self.qkv, x, C, 3 * C).view(B, T, 2, self.num_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        if isinstance(cache, FrozenCache):
            if self.rope is not None:
                k = self.rope.at(k, cache.static.pos)
            cache.write(k, v)
            return
        if self.rope is not None:
            k = (self.rope(k, cache.length) if padding is None
                 else self.rope.rows(k, padding.positions, padding.keys.shape[1]))
        cache.append(k, v)

    def read(self, x: torch.Tensor, cache: KVCache,
             padding: Padding | None = None) -> torch.Tensor:
        """Attend from ``x``'s T tokens, with queries from ``x``, to the keys and values in
        ``cache``, whose last T are these tokens' own (put there by :meth:`write` from the
        memory input: ``model.ode_kv = "step"`` or ``"block"``). Writes nothing; the frozen
        layout (one token, its position a tensor) too."""
        B, T, C = x.shape
        q = linear_rows(self.qkv, x, 0, C).view(B, T, self.num_heads, self.head_dim)
        q = q.transpose(1, 2)
        if isinstance(cache, FrozenCache):
            st = cache.static
            if self.rope is not None:
                q = self.rope.at(q, st.pos)
            k, v = cache.buffers
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=st.mask)
            return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))
        k, v = cache.contents()
        offset = cache.length - T
        if self.rope is not None:
            q = (self.rope(q, offset) if padding is None
                 else self.rope.rows(q, padding.positions, padding.keys.shape[1]))
        return self._attention(x, q, k, v, offset, padding)

    def extend_frozen(self, x: torch.Tensor, cache: FrozenSeqCache) -> torch.Tensor:
        """One token against a fixed-capacity cache, its position a tensor (see cache.py)."""
        B, T, C = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = self.qkv(x).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        st = cache.static
        if self.rope is not None:
            q, k = self.rope.at(qkv[:2], st.pos).unbind(0)
            v = qkv[2]
        else:
            q, k, v = qkv.unbind(0)
        k, v = cache.write(k, v)
        # the fused kernel, inside a compiled step too: over a buffer of hundreds of positions
        # it decoded faster on CPU than matmul-mask-softmax-matmul fused by inductor
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=st.mask)
        return self.resid_dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, H * D)))

    def _attend_frozen_dropout(self, q, k, v, mask, is_causal):
        # scaled_dot_product_attention draws its own dropout mask on every call; inside an ODE
        # field the mask must stay fixed for the whole solve, so the weights are formed here.
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        if is_causal:
            T = q.shape[-2]
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:  # additive (chunk_mask)
            scores = scores + mask
        return self.attn_drop(torch.softmax(scores, dim=-1)) @ v
