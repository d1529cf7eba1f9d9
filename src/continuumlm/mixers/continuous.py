"""Continuous spectral attention (CAT), made causal.

Per head, a kernel over continuous positions W(s, t) = phi(s)^T C phi(t) with a truncated basis
phi (Fourier cosines cos(pi f s) or Chebyshev polynomials T_f(2s - 1), f < ``n_freq``).
The output at position s is a quadrature of the integral of softmax_t W(s, t) times v(t), with
v the token values linearly interpolated between positions:

    y(s) = sum_j p_j(s) v(t_j),   p(s) = softmax_j(W(s, t_j) + log w_j)

over ``n_quad`` Gauss-Legendre nodes t_j with weights w_j. Choices that differ from CAT:

- Causal in decoder mode: the integral for a query at s runs over [0, s] only, so nodes lie in
  [0, s] and the interpolation reads tokens at positions <= s. Encoder mode integrates over the
  whole window.
- Positions map to s by a fixed scale (token i is at s = i / ``length``), never by the
  current sequence length, so a token's output does not depend on how many tokens follow it.
  Past the scale, Fourier features continue periodically and Chebyshev arguments are clamped.
  So with the Fourier basis cos(pi f s), which is even about s = 1 and periodic with period 2,
  a key at position length + k gets the kernel value of the key at length - k (and of every
  position 2 * length apart from either): only positions 0..length are told apart (with
  Chebyshev, every position past ``length`` is alike). Evaluating past that range (a one-time
  warning says so) needs a ``length`` that covers the longest context; ``mode = "bias"`` keeps
  the content term, which can tell tokens apart.
- Normalization: the softmax runs over the quadrature nodes with the log weights added, so p
  is a proper discrete distribution and y a convex combination of values (CAT's rows sum to
  about 1e-3, which damps the signal).

The kernel depends on positions only, so one (H, T, T) mixing matrix serves the whole batch.
Decoding stores the token values; one new token costs O(n_quad * head_dim) per head.

``quadrature`` chooses the nodes: "gauss" (CAT's: ``n_quad`` Gauss-Legendre nodes on [0, s],
so a query at position 4999 reads 64 of 5000 tokens), "composite" (Gauss-Legendre on panels of
``panel`` tokens: the node count grows with the context), or "exact" (every earlier token is a
node with equal weight: softmax_j(W(s_i, t_j)) v_j, which is scaled-dot-product attention with
queries C^T phi(s_i) and keys phi(t_j): one SDPA call, exact at every length).

``mode = "bias"`` makes the kernel a learned positional prior of ordinary attention:
softmax_j(q_i k_j / sqrt(d) + W(s_i, t_j)) over every earlier token, as one SDPA call on
queries [q / sqrt(d), C^T phi(s)] and keys [k, phi(t)]; the Sobolev penalty still acts on C.
A Sobolev (biharmonic) penalty sum (f^2 + g^2)^2 C_fg^2, times ``sob_lambda``, is exposed
through ``penalty()`` and added to the loss by the trainer.

``kernel = "relative"`` (bias mode only) makes the prior a function of the distance alone,
b_h(i, j) = sum_f c_hf phi_f(u(|i - j|)), u(d) = min(1, log(1 + d) / log(1 + length)): the
same spectral basis and Sobolev penalty (sum f^4 c_f^2) on a log-warped distance, so near
tokens are told apart finely and far ones coarsely, and every distance past ``length`` shares
the value at ``length`` (as T5's relative buckets do past their largest; FIRE, Li et al. 2023,
warps distances the same way). Queries and keys are then the content ones, the prior enters
SDPA as an additive mask, and queries are processed in chunks of ``query_chunk`` to bound the
(H, chunk, T) bias. Unlike the absolute kernel it never reflects or repeats past ``length``.
It starts as a power law per head, b_h(d) = -m_h log(1 + d) with m_h from 1/4 to 4 (ALiBi's
per-head slopes, on the log distance), rather than near zero.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import setting
from ..errors import ConfigError
from ..nn import SharedDropout, linear_rows, make_linear
from ..registry import register_mixer
from . import spectral
from .cache import KVCache, SeqCache
from .continuous_decoding import ContinuousDecoding, ContinuousPadded
from .padding import Padding, mix


class ValueCache(SeqCache):
    """The projected values of every token so far, (B, H, T, D)."""


@register_mixer("continuous")
class ContinuousAttention(ContinuousPadded, ContinuousDecoding, nn.Module):
    @dataclass
    class Config:
        """[model.continuous]: CAT's kernel and quadrature."""

        basis: str = setting("fourier", choices=("fourier", "cheb"))
        """Basis of the kernel: "fourier" cosines or "cheb" Chebyshev polynomials."""
        # Gauss-Legendre nodes come from the eigenvalues of an n x n companion matrix (0.1 s at
        # 1024 nodes, 7 s at 4096) and every query reads every node, so larger counts are
        # refused rather than left to stall.
        n_freq: int = setting(32, gt=0, le=1024)
        """Basis functions per axis of the kernel."""
        n_quad: int = setting(32, gt=0, le=1024)
        """Gauss-Legendre nodes of the quadrature."""
        sob_lambda: float = setting(1e-6, ge=0)
        """Weight of the Sobolev (biharmonic) penalty on the kernel coefficients."""
        length: int = setting(0, ge=0)
        """Positions per unit of continuous position s (0 = max_seq_len)."""
        quadrature: str = setting("gauss", choices=("gauss", "composite", "exact"))
        """Nodes of the integral over [0, s]: "gauss" (n_quad Gauss-Legendre nodes, CAT's),
        "composite" (n_quad nodes per panel of `panel` tokens), "exact" (every token)."""
        panel: int = setting(256, gt=0)
        """Tokens per panel of the composite Gauss-Legendre quadrature."""
        mode: str = setting("kernel", choices=("kernel", "bias"))
        """"kernel": attention weights from the continuous kernel alone (CAT); "bias": the
        kernel added to q.k / sqrt(d) of ordinary attention over every token (a learned
        positional prior; the quadrature setting is not used)."""
        kernel: str = setting("absolute", choices=("absolute", "relative"))
        """"absolute": W(s, t) = phi(s)^T C phi(t) of the two positions (CAT's); "relative"
        (mode = "bias" only): a function of the log-warped distance, constant past `length`."""

        def validate(self) -> None:
            if self.kernel == "relative" and self.mode != "bias":
                raise ConfigError(
                    "model.continuous.kernel = 'relative' is a positional prior added to q.k of "
                    "ordinary attention: it needs model.continuous.mode = 'bias' (the kernel "
                    f"mode reads values at quadrature nodes of absolute positions), got mode "
                    f"= {self.mode!r}. Set mode = 'bias' or kernel = 'absolute'.")

    cache_factory = ValueCache
    # per row: positions from the row's first real token, pads never read (_padded_*)
    supports_padding = True
    query_chunk = 512  # queries per block (bounds memory at long contexts)
    dense_limit = 1024  # above this many keys the gather path is cheaper than a dense matrix

    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.causal = cfg.mode == "decoder"
        own = cfg.component("continuous")
        self.basis = own.basis
        self.n_freq = own.n_freq
        self.scale = float(own.length or cfg.max_seq_len)
        self.sob_lambda = own.sob_lambda
        self.v_proj = make_linear(cfg.hidden_size, cfg.hidden_size, cfg)
        self.out_proj = make_linear(cfg.hidden_size, cfg.hidden_size, cfg)
        self.out_proj.residual_proj = True
        self.relative = own.kernel == "relative"
        if self.relative:  # one function of the distance per head: (H, F)
            self.coef = nn.Parameter(spectral.power_law_coefficients(
                cfg.num_heads, own.n_freq, own.basis, self.scale))
        else:  # a smooth kernel at init: coefficients decay with frequency
            f = torch.arange(own.n_freq, dtype=torch.float32)
            decay = 1.0 / (1.0 + f[:, None] ** 2 + f[None, :] ** 2)
            self.coef = nn.Parameter(
                torch.randn(cfg.num_heads, own.n_freq, own.n_freq) * 0.02 * decay)
        self.n_quad = own.n_quad
        self.quadrature_kind, self.panel, self.mode = own.quadrature, own.panel, own.mode
        self.exact = own.mode == "bias" or own.quadrature == "exact"
        if own.mode == "bias":
            self.qk = make_linear(cfg.hidden_size, 2 * cfg.hidden_size, cfg)
        if self.exact:  # keys (and values) per token, as softmax attention keeps them
            self.cache_factory = KVCache
        self._build_constants(None, torch.float32)
        self.dropout = SharedDropout(cfg.dropout)

    def _build_constants(self, device, dtype) -> None:
        """Gauss-Legendre nodes and log-weights on [0, 1] and the Sobolev weights (f^2+g^2)^2
        (f^4 for the relative kernel's one axis), computed in float64 and stored in ``dtype``
        (float32 or wider)."""
        nodes, log_w = spectral.gauss_legendre(self.n_quad)
        sob = spectral.sobolev_weights(self.n_freq, self.relative)
        for name, value in (("nodes", nodes), ("log_w", log_w), ("sob_weight", sob)):
            self.register_buffer(name, torch.tensor(value, dtype=dtype, device=device),
                                 persistent=False)

    def _apply(self, fn, recurse=True):
        # A cast such as model.to(torch.bfloat16) would round these constants like any buffer:
        # bf16 nodes put a query at position 4000 up to 8 tokens off. They are rebuilt after
        # every move or cast, on the new device, in float32 (float64 for a float64 model).
        out = super()._apply(fn, recurse)
        self._build_constants(self.nodes.device, torch.promote_types(self.coef.dtype,
                                                                     torch.float32))
        return out

    # ------------------------------------------------------------------ kernel

    def phi(self, s: torch.Tensor) -> torch.Tensor:
        """Basis functions at positions s (any shape) -> (..., n_freq)."""
        return spectral.basis(s, self.n_freq, self.basis)

    def quadrature(self, q_pos: torch.Tensor, n_keys: int, panels: int | None = None):
        """Node probabilities p (H, Tq, Q) and the interpolation of each node between tokens
        lo and hi (Tq, Q) with weight alpha on hi, for queries at absolute positions q_pos.

        At least float32, whatever the model's dtype or autocast (float64 stays float64): bf16
        holds integers exactly only up to 256, so positions, nodes and the kernel would lose
        their place in a long context. Callers cast p to the values' dtype. ``panels``
        (composite): the panel count to lay out, at least the furthest query's (see
        spectral.composite_nodes)."""
        with torch.autocast(q_pos.device.type, enabled=False):
            return self._quadrature(q_pos, n_keys, panels)

    def _quadrature(self, q_pos: torch.Tensor, n_keys: int, panels: int | None = None):
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        s = q_pos.to(dt) / self.scale                                   # (Tq,)
        upper = s if self.causal else torch.full_like(s, (n_keys - 1) / self.scale)
        if self.quadrature_kind == "composite":
            t, log_w = spectral.composite_nodes(upper, self.panel / self.scale,
                                                self.nodes.to(dt), self.log_w.to(dt), panels)
        else:
            t = upper[:, None] * self.nodes.to(dt)[None, :]             # (Tq, Q) nodes in [0, upper]
            log_w = self.log_w.to(dt)
        a = torch.einsum("if,hfg->hig", self.phi(s), self.coef.to(dt))  # (H, Tq, F)
        scores = torch.einsum("hig,iqg->hiq", a, self.phi(t)) + log_w
        p = torch.softmax(scores, dim=-1)                               # (H, Tq, Q)
        u = t * self.scale                                              # node in token units
        bound = (q_pos if self.causal else torch.full_like(q_pos, n_keys - 1)).to(u.dtype)
        return (p, *spectral.between_tokens(u, bound))

    def mixing(self, q_pos: torch.Tensor, n_keys: int) -> torch.Tensor:
        """(H, Tq, n_keys) weights: row i mixes the values of tokens 0..n_keys-1."""
        return spectral.mixing_matrix(*self.quadrature(q_pos, n_keys), n_keys)

    def penalty(self) -> torch.Tensor:
        coef = self.coef
        if hasattr(coef, "full_tensor"):
            # Sharded by FSDP (a DTensor) outside forward: gather it. Every rank computes the
            # same penalty, so the gradient's local shard needs no reduction.
            coef = coef.full_tensor()
        # squared in float32 at least: small coefficients squared underflow in float16
        coef = coef.to(torch.promote_types(coef.dtype, torch.float32))
        return self.sob_lambda * (self.sob_weight * coef ** 2).sum()

    # ------------------------------------------------------------------ forward

    def distance_prior(self, distance: torch.Tensor) -> torch.Tensor:
        """The relative kernel at integer distances (any shape, >= 0) -> (H, *shape):
        sum_f c_hf phi_f(u(d)), u(d) = min(1, log(1 + d) / log(1 + length))."""
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        with torch.autocast(distance.device.type, enabled=False):
            return spectral.distance_prior(distance, self.coef.to(dt), self.basis, self.scale)

    def _relative_bias(self, q_pos: torch.Tensor, n_keys: int, dt) -> torch.Tensor:
        """(1, H, Tq, n_keys) additive mask for queries at any positions (the static decoding
        step): the prior at |i - j|, -inf where j is after i (decoder mode)."""
        k_pos = torch.arange(n_keys, device=q_pos.device)
        d = q_pos[:, None] - k_pos[None, :]                                # (Tq, n_keys)
        bias = self.distance_prior(d.abs()).to(dt)
        if self.causal:
            bias = bias.masked_fill(d < 0, float("-inf"))
        return bias.unsqueeze(0)

    def _keys(self, x: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dt,
              part: str = "qk"):
        """Queries and keys of the exact (SDPA) forms, (B, H, T, F [+ D]) in ``dt`` (the
        content ones alone, (B, H, T, D), with the relative kernel). ``part`` "q" or "k"
        computes that one alone and gives None for the other: a memory read needs the queries
        only, a write the keys only (in bias mode, their rows of the fused projection)."""
        B, T, _ = x.shape
        q = k = cq = ck = None
        if self.mode == "bias":  # the content part, from the fused projection (queries first)
            if part == "qk":
                qk = self.qk(x).view(B, T, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
                cq, ck = qk[0].to(dt) * self.head_dim ** -0.5, qk[1].to(dt)
            else:  # one half: its rows of the projection alone
                C, i = self.num_heads * self.head_dim, "qk".index(part)
                c = linear_rows(self.qk, x, i * C, (i + 1) * C).view(
                    B, T, self.num_heads, self.head_dim).transpose(1, 2).to(dt)
                cq, ck = (c * self.head_dim ** -0.5, None) if part == "q" else (None, c)
        if self.relative:
            return cq, ck
        with torch.autocast(x.device.type, enabled=False):
            if q_pos.dim() == 2:  # each row its own positions (B, T): a padded batch
                if "q" in part:
                    q = torch.einsum("btf,hfg->bhtg", self.phi(q_pos.to(dt) / self.scale),
                                     self.coef.to(dt))                  # (B, H, Tq, F)
                if "k" in part:
                    k = self.phi(k_pos.to(dt) / self.scale)[:, None].expand(
                        -1, self.num_heads, -1, -1)                      # (B, H, Tk, F)
            else:
                if "q" in part:
                    a = torch.einsum("if,hfg->hig", self.phi(q_pos.to(dt) / self.scale),
                                     self.coef.to(dt))                  # (H, Tq, F)
                    q = a.unsqueeze(0).expand(B, -1, -1, -1)
                if "k" in part:
                    k = self.phi(k_pos.to(dt) / self.scale).expand(B, self.num_heads, -1, -1)
        if self.mode == "bias":
            q = torch.cat([cq, q], -1) if q is not None else None
            k = torch.cat([ck, k], -1) if k is not None else None
        return q, k

    def _exact(self, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """The exact forms (quadrature "exact", mode "bias"): one SDPA over every earlier token,
        in float32 at least (the kernel reads positions)."""
        B, T, C = x.shape
        dt = torch.promote_types(self.coef.dtype, torch.float32)
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        offset = cache.length if cache is not None else 0
        q_pos = torch.arange(offset, offset + T, device=x.device)
        q, k = self._keys(x, q_pos, q_pos, dt)
        if cache is not None:
            k, v = cache.append(k, v.to(dt))
        return self._exact_attend(x, q, k, v, q_pos, offset)

    def _exact_attend(self, x, q, k, v, q_pos, offset: int) -> torch.Tensor:
        """The exact forms from queries at ``offset``.. to every key so far."""
        T = x.shape[1]
        mask, is_causal = None, False
        if self.causal and offset == 0:
            is_causal = T > 1
        elif self.causal and T > 1:  # a chunk after cached tokens
            rows = torch.arange(offset, offset + T, device=x.device)[:, None]
            mask = torch.arange(k.shape[-2], device=x.device)[None, :] <= rows
        return self._exact_out(x, q, k, v, q_pos, mask, is_causal, offset)

    def _exact_out(self, x, q, k, v, q_pos, mask, is_causal: bool,
                   offset: int | None) -> torch.Tensor:
        """The exact forms' attention and output projection (``offset`` None: the queries'
        positions are a tensor, a frozen step's)."""
        B, T, C = x.shape
        with torch.autocast(x.device.type, enabled=False):  # autocast would make it bf16
            if self.relative:
                y = self._relative_sdpa(q, k, v.to(q.dtype), q_pos, mask, offset)
            else:
                y = spectral.sdpa_any_dims(q, k, v.to(q.dtype), mask, is_causal)
        y = y.to(x.dtype).transpose(1, 2).reshape(B, T, C)
        return self.dropout(self.out_proj(y))

    def _relative_sdpa(self, q, k, v, q_pos, mask, offset: int | None) -> torch.Tensor:
        """SDPA with the relative prior as an additive mask: for queries at consecutive
        positions a Toeplitz view of one row of priors (spectral.toeplitz_sdpa); the static
        decoding step (a position tensor, a fixed buffer with ``mask``) gathers."""
        if offset is None:
            bias = self._relative_bias(q_pos, k.shape[2], q.dtype)
            if mask is not None:
                bias = bias.masked_fill(~mask, float("-inf"))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                                    scale=1.0)
        # the prior at the signed distances -(n - 1)..: row[m] is the one at m - (n - 1)
        n, Tq = k.shape[2], q.shape[2]
        signed = torch.arange(offset + Tq + n - 1, device=q.device) - (n - 1)
        row = self.distance_prior(signed.abs()).to(q.dtype)
        if self.causal:
            row = row.masked_fill(signed < 0, float("-inf"))
        return spectral.toeplitz_sdpa(q, k, v, row, offset, self.query_chunk)

    def unique_range(self) -> int:
        """Tokens over which the kernel's positions are distinct: positions 0..length (past
        it Fourier features reflect, cos(pi f (2 - s)) = cos(pi f s), and Chebyshev's clamp)."""
        return int(self.scale) + 1

    def _check_range(self, n_tokens: int) -> None:
        # the relative kernel is constant past `length` by design (its documented far value)
        if not self.relative and n_tokens > self.unique_range() and not getattr(self, "_range_warned", False) \
                and not torch.compiler.is_compiling():
            self._range_warned = True
            what = ("reflect and repeat" if self.basis == "fourier" else "are all alike")
            advice = ("the content term still tells tokens apart, the positional prior does "
                      "not" if self.mode == "bias" else "train with model.continuous.length "
                      "covering the longest context (or mode = 'bias') to evaluate there")
            warnings.warn(
                f"continuous attention reads {n_tokens} tokens, but its kernel positions "
                f"{what} past token {int(self.scale)} (model.continuous.length = "
                f"{int(self.scale)}, basis {self.basis!r}): keys at different positions get "
                f"the same kernel value there; {advice}.", stacklevel=2)

    def forward(self, x: torch.Tensor, cache: ValueCache | None = None,
                padding: Padding | None = None) -> torch.Tensor:
        """The whole sequence ``x`` (B, T, C); with a cache, :meth:`extend` or
        :meth:`extend_frozen` by its layout."""
        if cache is not None:
            return mix(self, x, cache, padding)
        return self._mix(x, None, padding)

    def extend(self, x: torch.Tensor, cache: ValueCache,
               padding: Padding | None = None) -> torch.Tensor:
        """Extend the cache by ``x``'s k >= 1 tokens and mix every token so far into them."""
        if not self.causal:
            raise ValueError("incremental decoding needs mode = 'decoder'.")
        return self._mix(x, cache, padding)

    def _mix(self, x: torch.Tensor, cache: ValueCache | None,
             padding: Padding | None) -> torch.Tensor:
        self._check_range(x.shape[1] + (cache.length if cache is not None else 0))
        if padding is not None:
            return self._padded(x, cache, padding)
        if self.exact:
            return self._exact(x, cache)
        B, T, C = x.shape
        v = self.v_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        offset = 0
        if cache is not None:
            offset = cache.length
            (v,) = cache.append(v)
        return self._quadrature_out(x, v, offset)

    def _quadrature_out(self, x: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
        """The quadrature of queries at ``offset``.. over the values ``v`` of every token so
        far, through the output projection."""
        B, T, C = x.shape
        q_pos = torch.arange(offset, offset + T, device=x.device)
        n_keys = v.shape[2]
        if T <= 4 or n_keys > self.dense_limit:
            # gather the 2 * n_quad values each query reads: O(T * n_quad * D) per head, which
            # beats the dense (T x n_keys) mixing matrix for decoding and long contexts
            y = self._gathered(v, q_pos)
        else:  # training lengths: one dense mixing matrix per chunk, shared by the batch
            outs = []
            for i in range(0, T, self.query_chunk):
                M = self.mixing(q_pos[i:i + self.query_chunk], n_keys).to(v.dtype)
                outs.append(M @ v)                                      # (B, H, Tc, D)
            y = torch.cat(outs, dim=2)
        return self.dropout(self.out_proj(y.transpose(1, 2).reshape(B, T, C)))

    def _gathered(self, v: torch.Tensor, q_pos: torch.Tensor,
                  panels: int | None = None) -> torch.Tensor:
        """(B, H, Tq, D): the quadrature at the queries ``q_pos``, from the 2 * n_quad values
        each reads of ``v`` (B, H, n_keys, D)."""
        outs = []
        for i in range(0, q_pos.shape[0], self.query_chunk):
            outs.append(spectral.gathered(
                v, *self.quadrature(q_pos[i:i + self.query_chunk], v.shape[2], panels)))
        return torch.cat(outs, dim=2)
