"""DeltaNet, the layer: projections, the short convolution, the delta rule (delta_rule.py's
kernels), the output norm and gate; its decoding caches are in deltanet_cache.py
(importable from here as before).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import setting
from ..nn import Float32RMSNorm, SharedDropout, make_linear, make_norm, stacked_linear, twice
from ..registry import register_mixer
from .delta_rule import (  # noqa: F401 - the kernels, importable from here as before
    autocast_off,
    delta_rule_chunkwise,
    delta_rule_recurrent,
    delta_rule_state,
    delta_rule_step,
    delta_rule_token_states,
    fla_available,
    fla_status,
)
from .deltanet_cache import DeltaMemory, DeltaNetCache, FrozenDeltaNetCache  # noqa: F401
from .padding import mix


class ShortConv(nn.Module):
    """Causal depthwise convolution over time (kernel K), with a cache of the last K-1 inputs."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))
        with torch.no_grad():
            self.weight[:, 0, -1] = 1.0  # starts as the identity

    def forward(self, x: torch.Tensor, history: torch.Tensor | None = None):
        """x (B, T, C) -> (y (B, T, C), the last K-1 inputs for the next call)."""
        B, T, C = x.shape
        if history is None:
            history = x.new_zeros(B, self.kernel - 1, C)
        xx = torch.cat([history, x], dim=1)
        # K multiply-adds in the (B, T, C) layout rather than F.conv1d on (B, C, T): conv1d's
        # output comes back transposed, and every later op on it (SiLU, normalize, the head
        # reshapes, the kernel's matmuls) then ran on strided memory (bench/mixer_step.py times
        # DeltaNet with and without the convolution).
        w = self.weight[:, 0, :]  # (C, K): y[t] = sum_j w[:, j] * xx[t + j], as conv1d computes
        y = xx[:, :T] * w[:, 0]
        for j in range(1, self.kernel):
            y = y + xx[:, j:j + T] * w[:, j]
        # in x's dtype, as conv1d under autocast returns it: bf16 projections give bf16 q, k, v
        # (float32 ones would keep the delta rule off its half-precision GPU kernel)
        return y.to(x.dtype), xx[:, xx.shape[1] - (self.kernel - 1):]

    def current(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """The convolution at each of ``x``'s T tokens with the token itself read from ``x``
        and the K-1 before it from ``window`` (B, K-1+T, C): the earlier tokens' inputs from
        the memory (``model.ode_kv``), the token's own from the evaluation."""
        T = x.shape[1]
        w = self.weight[:, 0, :]
        taps = [window[:, j:j + T] for j in range(self.kernel - 1)] + [x]
        y = taps[0] * w[:, 0]  # summed in forward's order: the same roundings
        for j in range(1, self.kernel):
            y = y + taps[j] * w[:, j]
        return y.to(x.dtype)


@register_mixer("deltanet")
class DeltaNetAttention(nn.Module):
    """The DeltaNet token mixer: projections, SiLU (after the short convolution when there is
    one), L2-normalized q/k, sigmoid write strength, the delta-rule kernel, a per-head
    RMSNorm on the readout, a SiLU output gate and the output projection, as
    flash-linear-attention's DeltaNet layer with use_gate = True (the differences that remain
    are listed in docs/continuous_depth.md, Mixers). ``mode = "encoder"`` sums a left-to-right and a
    right-to-left scan."""

    @dataclass
    class Config:
        """[model.deltanet]"""

        short_conv: int = setting(0, ge=0)
        """Kernel size of the causal depthwise convolution on q, k and v (0 = off)."""
        activation: str = setting("silu", choices=("silu", "none"))
        """Without the short convolution: "silu" applies SiLU to q, k and v before the delta
        rule, as flash-linear-attention's DeltaNet layer does (its qk_activation = "silu");
        "none" feeds the projections as they are (q and k only L2-normalized), the map of
        earlier versions. With the convolution SiLU follows it either way."""
        beta_bias: bool = setting(False)
        """A bias on the write-strength (beta) projection; fla's b_proj has none."""
        head_norm: str = setting("rms", choices=("rms", "model"))
        """The per-head norm of the readout: "rms" is RMSNorm (eps 1e-5) as fla's o_norm;
        "model" is model.norm_type (LayerNorm by default), as earlier versions."""

        # what a run saved before these keys existed did: read back, it builds that model
        saved_defaults: ClassVar[dict] = {"activation": "none", "beta_bias": True,
                                          "head_norm": "model"}

    cache_factory = DeltaNetCache
    chunk_size = 64
    supports_padding = True  # a pad writes nothing: beta 0, zeros into the short convolution

    def __init__(self, cfg):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size ({cfg.hidden_size}) must be divisible by num_heads "
                             f"({cfg.num_heads}).")
        C, self.num_heads, self.head_dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.causal = cfg.mode == "decoder"
        self.q_proj = make_linear(C, C, cfg)
        self.k_proj = make_linear(C, C, cfg)
        self.v_proj = make_linear(C, C, cfg)
        self.g_proj = make_linear(C, C, cfg)
        self.o_proj = make_linear(C, C, cfg)
        self.o_proj.residual_proj = True
        own = cfg.component("deltanet")
        self.beta_proj = nn.Linear(C, cfg.num_heads, bias=own.beta_bias)
        self.convs = None
        if own.short_conv:
            self.convs = nn.ModuleDict({n: ShortConv(C, own.short_conv) for n in "qkv"})
        self.silu_qkv = own.activation == "silu"
        self.norm = (Float32RMSNorm(cfg.head_dim, eps=1e-5) if own.head_norm == "rms"
                     else make_norm(cfg.head_dim, cfg))
        self.dropout = SharedDropout(cfg.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: DeltaNetCache | None = None,
                padding=None) -> torch.Tensor:
        """The whole sequence ``x`` (B, T, C); with a cache, :meth:`extend` or
        :meth:`extend_frozen` by its layout."""
        if cache is not None:
            return mix(self, x, cache, padding)
        return self._mix(x, None, padding)

    def extend(self, x: torch.Tensor, cache: DeltaNetCache, padding=None) -> torch.Tensor:
        """Extend the state by ``x``'s k >= 1 tokens (the token recurrence for k <= 2, the
        chunkwise kernel beyond) and read it at each."""
        if not self.causal:
            raise ValueError("incremental decoding needs mode = 'decoder'.")
        return self._mix(x, cache, padding)

    def extend_frozen(self, x: torch.Tensor, cache: FrozenDeltaNetCache) -> torch.Tensor:
        """One token, the state and history updated in place (the cache type's)."""
        return self._mix(x, cache, None)

    def _mix(self, x: torch.Tensor, cache, padding) -> torch.Tensor:
        B, T, C = x.shape
        projs = (self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.beta_proj)
        # a decoded token (autograd off): one stacked product (nn.stacked_linear); a longer
        # input keeps the projections apart (their products are long enough, and no copy of
        # the weights is kept for a model that is only evaluated, sharded or not)
        q, k, v, g, b = (stacked_linear(self, x, projs, cache.shared)
                         if T == 1 and cache is not None
                         else (m(x) for m in projs))
        proj = {"q": q, "k": k, "v": v}
        real = padding.valid[..., None] if padding is not None else None
        if real is not None:  # the row alone has no input there: zeros (its conv history)
            if self.convs is not None:  # the history holds the last inputs by index
                padding.require_one_stretch("DeltaNet's short convolution")
            proj = {name: p.masked_fill(~real, 0.0) for name, p in proj.items()}
        conv_inputs = ({f"conv_{n}": (p, 1) for n, p in proj.items()}
                       if self.convs is not None else {})
        start = cache.start() if cache is not None else None
        # a frozen state's step over several tokens (speculative decoding's verifying pass):
        # every token's state and history is kept, so the state can be cut back inside it
        many = T > 1 and isinstance(cache, FrozenDeltaNetCache)
        if self.convs is not None:
            for name, conv in self.convs.items():
                hist = cache.conv.get(name) if cache is not None else None
                y, new_hist = conv(proj[name], hist)
                if many:
                    cache.update_conv(name, new_hist, torch.cat([hist, proj[name]], dim=1))
                elif cache is not None:
                    cache.update_conv(name, new_hist)
                proj[name] = F.silu(y)
        elif self.silu_qkv:
            proj = {name: F.silu(p) for name, p in proj.items()}
        q = F.normalize(self._heads(proj["q"]), dim=-1)
        k = F.normalize(self._heads(proj["k"]), dim=-1)
        v = self._heads(proj["v"])
        beta = torch.sigmoid(b).transpose(1, 2)  # (B, H, T)
        if real is not None:  # a pad leaves the state as it is
            beta = beta.masked_fill(~real.transpose(1, 2), 0.0)
        if self.causal:
            init = cache.state if cache is not None else None
            if cache is not None:
                cache.record(T, start, {"k": (k, 2), "v": (v, 2), "beta": (beta, 2),
                                        **conv_inputs})
            if many:
                o, states = self._token_states(q, k, v, beta, init)
                cache.update_tokens(states)
            else:
                o, state = self._kernel(q, k, v, beta, init)
                if cache is not None:
                    cache.update(state, T)
        else:
            o, _ = self._kernel(q, k, v, beta)
            o_rev, _ = self._kernel(q.flip(2), k.flip(2), v.flip(2), beta.flip(2))
            o = o + o_rev.flip(2)
        o = self.norm(o).transpose(1, 2).reshape(B, T, C)
        o = o * F.silu(g)
        return self.dropout(self.o_proj(o))

    def write(self, m: torch.Tensor, cache: DeltaNetCache, padding=None) -> None:
        """Put the memory of ``m``'s T tokens into ``cache`` (``model.ode_kv = "step"`` or
        ``"block"``): their keys, values and write strengths, through the short convolution
        with its history, and the q convolution's inputs; a single token updates the state
        at once, several leave it to the first :meth:`read`'s kernel."""
        if not self.causal:
            raise ValueError("DeltaNet takes its memory from a separate input in decoder mode "
                             "only (an encoder's backward scan reads later tokens); use "
                             "model.ode_kv = 'evaluation' with mode = 'encoder'.")
        B, T, C = m.shape
        projs = (self.k_proj, self.v_proj, self.beta_proj)
        if self.convs is not None:  # later tokens' q convolution reads these tokens' inputs
            projs = projs + (self.q_proj,)
        outs = (stacked_linear(self.k_proj, m, projs, cache.shared) if T == 1
                else tuple(p(m) for p in projs))
        proj = {"k": outs[0], "v": outs[1]}
        b = outs[2]
        if self.convs is not None:
            proj["q"] = outs[3]
        real = padding.valid[..., None] if padding is not None else None
        if real is not None:
            if self.convs is not None:
                padding.require_one_stretch("DeltaNet's short convolution")
            proj = {name: p.masked_fill(~real, 0.0) for name, p in proj.items()}
        conv_inputs = ({f"conv_{n}": (p, 1) for n, p in proj.items()}
                       if self.convs is not None else {})
        start = cache.start()  # settles the state of the previous write
        q_window = None
        many = T > 1 and isinstance(cache, FrozenDeltaNetCache)  # as in _mix
        if self.convs is not None:
            for name in ("k", "v"):
                hist = cache.conv.get(name)
                y, new_hist = self.convs[name](proj[name], hist)
                if many:
                    cache.update_conv(name, new_hist, torch.cat([hist, proj[name]], dim=1))
                else:
                    cache.update_conv(name, new_hist)
                proj[name] = F.silu(y)
            conv = self.convs["q"]
            hist = cache.conv.get("q")
            if hist is None:
                hist = m.new_zeros(B, conv.kernel - 1, C).to(proj["q"].dtype)
            q_window = torch.cat([hist, proj["q"]], dim=1)
            cache.update_conv("q", q_window[:, q_window.shape[1] - (conv.kernel - 1):],
                              *((q_window,) if many else ()))
        elif self.silu_qkv:
            proj = {name: F.silu(p) for name, p in proj.items()}
        k = F.normalize(self._heads(proj["k"]), dim=-1)
        v = self._heads(proj["v"])
        beta = torch.sigmoid(b).transpose(1, 2)
        if real is not None:
            beta = beta.masked_fill(~real.transpose(1, 2), 0.0)
        cache.record(T, start, {"k": (k, 2), "v": (v, 2), "beta": (beta, 2), **conv_inputs})
        init = cache.state
        if T == 1:  # one token: its state now (from zeros for a first token), each read a product
            # in at least float32 with autocast off, as _kernel's token path: an accumulator
            work = k.dtype if k.dtype == torch.float64 else torch.float32
            if init is None:
                init = k.new_zeros(B, self.num_heads, v.shape[-1], k.shape[-1], dtype=work)
            with autocast_off(k.device.type):
                _, state = delta_rule_step(k.to(work), k.to(work), v.to(work), beta.to(work),
                                           init.to(work))
            cache.update(state, 1)
            cache.memory = DeltaMemory(k, v, beta, None, q_window)
        elif isinstance(cache, FrozenDeltaNetCache):  # a frozen step over several tokens:
            # every token's state now (the cache's state is updated in place, so the reads
            # start from a copy of the state before them)
            start = init.clone()
            cache.update_tokens(self._token_states(k, k, v, beta, init)[1])
            cache.memory = DeltaMemory(k, v, beta, start, q_window)
        else:
            cache.length += T
            cache.memory = DeltaMemory(k, v, beta, init, q_window, pending=True)

    def read(self, x: torch.Tensor, cache: DeltaNetCache, padding=None) -> torch.Tensor:
        """Read the memory the latest :meth:`write` put into ``cache`` with queries (and the
        output gate) from ``x``: the delta rule over the written tokens from the state before
        them, or, for a single token, the state after it. Writes nothing but that state,
        which the first read of several tokens computes."""
        mem = cache.memory
        if mem is None:
            raise RuntimeError("this DeltaNet cache holds no written memory: write before "
                               "reading it.")
        B, T, C = x.shape
        q, g = (stacked_linear(self.g_proj, x, (self.q_proj, self.g_proj), cache.shared)
                if T == 1 else (self.q_proj(x), self.g_proj(x)))
        if padding is not None:
            q = q.masked_fill(~padding.valid[..., None], 0.0)
        if self.convs is not None:
            q = F.silu(self.convs["q"].current(q, mem.q_window))
        elif self.silu_qkv:
            q = F.silu(q)
        q = F.normalize(self._heads(q), dim=-1)
        if T == 1:  # the state after the token: one product (the branch is T's alone, so a
            # step recomputed in a backward pass takes the one its forward took)
            S = cache.state
            work = S.dtype if q.dtype != torch.float64 else torch.float64
            with autocast_off(q.device.type):
                o = (q.to(work) @ S.to(work).mT).to(q.dtype)
        else:
            o, S = self._kernel(q, mem.k, mem.v, mem.beta, mem.start)
            if mem.pending:
                cache.state, mem.pending = S, False
        o = self.norm(o).transpose(1, 2).reshape(B, T, C)
        o = o * F.silu(g)
        return self.dropout(self.o_proj(o))

    def _token_states(self, q, k, v, beta, initial_state):
        """(o, the state after each token) by the token recurrence, in at least float32
        with autocast off, as :meth:`_kernel`'s token path."""
        work = q.dtype if q.dtype == torch.float64 else torch.float32
        with autocast_off(q.device.type):
            o, states = delta_rule_token_states(q.to(work), k.to(work), v.to(work),
                                                beta.to(work), initial_state.to(work))
        return o.to(q.dtype), states

    def _kernel(self, q, k, v, beta, initial_state=None):
        out_dtype = q.dtype
        # decoding steps: the token loop is cheapest; it is also plain autograd, differentiable
        # twice (the chunkwise kernel's backward is hand-written, once-differentiable)
        if q.shape[2] <= 2 or twice.needed():
            # in at least float32, like the chunkwise kernel: the state is an accumulator. With
            # autocast off too, or its products run in bf16 (cached decoding then drifts from
            # the full forward: 4.5e-3 relative after 300 tokens)
            # (dtype checks in Python: each no-op .to() is still a dispatched operation, and
            # decoding runs this once per field evaluation)
            work = q.dtype if q.dtype == torch.float64 else torch.float32
            q, k, v, beta = (t if t.dtype == work else t.to(work) for t in (q, k, v, beta))
            init = initial_state
            if init is not None and init.dtype != work:
                init = init.to(work)
            with (torch.autocast(q.device.type, enabled=False)
                  if torch.is_autocast_enabled(q.device.type) else contextlib.nullcontext()):
                if q.shape[2] == 1 and init is not None:  # a decoded token
                    o, S = delta_rule_step(q, k, v, beta, init)
                else:
                    o, S = delta_rule_recurrent(q, k, v, beta, init)
            return (o if o.dtype == out_dtype else o.to(out_dtype)), S
        return delta_rule_chunkwise(q, k, v, beta, self.chunk_size, initial_state)
