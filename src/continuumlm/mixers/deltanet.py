"""DeltaNet: linear attention whose matrix state is updated by the delta rule (Yang et al. 2024).

Per head, with L2-normalized keys and a write strength beta_t in (0, 1):

    S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T      (matrix products)
    o_t = S_t q_t

Two kernels compute this and are tested against each other:

- ``delta_rule_recurrent``: the token loop, the reference and the O(1)-per-token decoding path;
- ``delta_rule_chunkwise``: the chunkwise-parallel form (WY representation / UT transform) used
  for training. Written here because no CPU implementation exists in a library; on CUDA the
  ``fla`` package provides fused kernels for the same computation.

Shapes: q, k (B, H, T, Dk); v (B, H, T, Dv); beta (B, H, T); state (B, H, Dv, Dk).
The kernels take q, k, v and beta as given: normalization and scaling are the layer's job.
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
from .cache import FrozenCache, RewindLog
from .padding import mix


def delta_rule_recurrent(q, k, v, beta, initial_state=None):
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    S = (initial_state if initial_state is not None
         else q.new_zeros(B, H, Dv, Dk))
    outs = []
    for t in range(T):
        kt, vt = k[:, :, t], v[:, :, t]
        # S (I - b k k^T) + b v k^T  =  S + b (v - S k) k^T
        Sk = torch.einsum("bhvk,bhk->bhv", S, kt)
        S = S + (beta[:, :, t, None] * (vt - Sk))[..., :, None] * kt[..., None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, Dv)
    return o, S


def delta_rule_state(k, v, beta, initial_state=None):
    """The state after the tokens (k, v, beta) from ``initial_state`` (None: zeros), by the
    token recurrence in at least float32, as decoding runs it (cutting a cache back rebuilds
    its state with this)."""
    work = k.dtype if k.dtype == torch.float64 else torch.float32
    k, v, beta = k.to(work), v.to(work), beta.to(work)
    init = initial_state.to(work) if initial_state is not None else None
    return delta_rule_recurrent(k, k, v, beta, init)[1]


def delta_rule_step(q, k, v, beta, state):
    """One token of the delta rule: q, k (B, H, 1, Dk), v (B, H, 1, Dv), beta (B, H, 1) and
    the state (B, H, Dv, Dk) -> (o (B, H, 1, Dv), the new state). What
    ``delta_rule_recurrent`` computes for T = 1, as batched products of row vectors instead of
    its einsums, selections and stacking (decoding runs it once per field evaluation)."""
    u = (v - k @ state.mT) * beta.unsqueeze(-1)  # beta (v - S k), as a row
    S = state + u.mT @ k  # an outer product: one rounding per element, as the reference's
    return q @ S.mT, S


# flash-linear-attention: its first release (0.1.0) took head-first (B, H, T, D) tensors by
# default; the releases from 0.2 take (B, T, H, D) without being told, and from 0.5 passing
# ``head_first`` at all raises. The adapter calls the 0.2+ signature and refuses the 0.1 line
# by version (the package is published as flash-linear-attention, its kernels as fla-core).
FLA_MIN_VERSION = (0, 2)
_FLA_PROBE: tuple[bool, str] | None = None  # (usable, why not): probed once per process


def _version_tuple(text: str) -> tuple[int, ...]:
    """The leading numbers of a version: "0.5.2" -> (0, 5, 2), "0.1rc2" -> (0, 1)."""
    import re

    parts = []
    for piece in text.split(".")[:3]:
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() < len(piece):  # a pre-release tail ends the numbers
            break
    return tuple(parts)


def fla_status(refresh: bool = False) -> tuple[bool, str]:
    """Whether fla's delta-rule kernel can be used here, and if not why. Probed once per process
    (an absent package would otherwise be searched for on every DeltaNet forward, a fraction of
    a millisecond each and a graph break under torch.compile); ``refresh`` probes again."""
    global _FLA_PROBE
    if _FLA_PROBE is not None and not refresh:
        return _FLA_PROBE
    try:
        import fla
        import fla.ops.delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing, or broken (e.g. no triton): our kernel
        _FLA_PROBE = (False, f"the fla package (flash-linear-attention) is not importable here "
                             f"({type(e).__name__}: {e})")
        return _FLA_PROBE
    version = getattr(fla, "__version__", None)
    if not isinstance(version, str) or not _version_tuple(version):
        _FLA_PROBE = (False, f"the installed fla does not say its version ({version!r}), so its "
                             f"tensor layout cannot be told; install flash-linear-attention >= 0.2")
    elif _version_tuple(version) < FLA_MIN_VERSION:
        _FLA_PROBE = (False, f"fla {version} is too old: the 0.1 releases could take "
                             f"head-first tensors by default; install flash-linear-attention "
                             f">= 0.2")
    else:
        _FLA_PROBE = (True, "")
    return _FLA_PROBE


def fla_available() -> bool:
    return fla_status()[0]


_HALF = (torch.bfloat16, torch.float16)


def _half_dtype(*xs) -> torch.dtype | None:
    """The first half-precision dtype among the tensors (mixed-precision training hands q and k
    in float32 after their norm, v in bf16), or None when all are single or double precision."""
    return next((x.dtype for x in xs if x.dtype in _HALF), None)


def _fla_chunkwise(q, k, v, beta, initial_state=None):
    """flash-linear-attention's fused chunk kernel (CUDA, Triton) in this module's conventions:
    fla takes (B, T, H, D) tensors of one half-precision dtype (it refuses float32), scales q by
    ``scale`` (1 here: q is given) and keeps the state as (B, H, Dk, Dv), the transpose of ours.
    The output comes back in that half dtype and the state in float32, as on the torch path."""
    dt = _half_dtype(q, k, v)
    if dt is None:
        raise ValueError(f"backend='fla': flash-linear-attention's chunk kernel takes bfloat16 or "
                         f"float16 inputs, these are {q.dtype}; train in mixed precision "
                         f"(train.dtype = \"bf16\") or use backend='torch'.")
    usable, why = fla_status()
    if not usable:
        raise ValueError(f"backend='fla': {why}. Install flash-linear-attention (>= 0.2) on a "
                         f"CUDA machine, or use backend='torch'.")
    from fla.ops.delta_rule import chunk_delta_rule

    qt, kt, vt = (x.to(dt).transpose(1, 2).contiguous() for x in (q, k, v))
    bt = beta.to(dt).transpose(1, 2).contiguous()
    h0 = (initial_state.float().transpose(-1, -2).contiguous() if initial_state is not None
          else None)
    # (B, T, H, D) without a layout switch: the signature of every release from 0.2 on
    o, S = chunk_delta_rule(qt, kt, vt, bt, scale=1.0, initial_state=h0, output_final_state=True)
    return o.transpose(1, 2).to(dt), S.transpose(-1, -2).float()


def _chunk_forward(q, k, v, beta, S0):
    """The chunkwise forward on chunked tensors: q, k (G, N, C, Dk), v (G, N, C, Dv), beta
    (G, N, C, 1), S0 (G, Dv, Dk); G = batch x heads, N chunks of C rows. Returns the output
    and what the backward needs."""
    G, N, C, Dk = k.shape
    Dv = v.shape[-1]
    # X = [diag(b) K, diag(b) V]; L = I + A, A the strictly lower part of diag(b) K K^T (its
    # diagonal is never read: the solve is unit-triangular). (I + A)^-1 is formed once, by one
    # batched solve against the identity, so that forward and backward apply it as products:
    # solving for X and then for dY (128 right-hand sides each) took a third of the kernel's time.
    X = torch.cat([k * beta, v * beta], dim=-1)
    L = (X[..., :Dk] @ k.mT).tril_(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device).expand(G, N, C, C)
    Tinv = torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True)  # (I + A)^-1
    Y = Tinv @ X                                  # [W, U]
    W, U = Y[..., :Dk], Y[..., Dk:]
    # Only the state carry is sequential: two small products per chunk.
    Uc = torch.empty_like(U)                      # U' = U - W S^T, per chunk
    S_all = q.new_empty(G, N, Dv, Dk)             # the state entering each chunk
    S = S0
    for n in range(N):
        S_all[:, n] = S
        # an assignment, not out=Uc[:, n]: a non-contiguous out= tensor is a graph break under
        # torch.compile (one per chunk loop)
        Uc[:, n] = torch.baddbmm(U[:, n], W[:, n], S.mT, alpha=-1)
        S = torch.baddbmm(S, Uc[:, n].mT, k[:, n])
    QK = (q @ k.mT).tril_()                       # causal, diagonal included
    o = torch.matmul(q, S_all.mT).add_(QK @ Uc)
    return o, S, (Tinv, Y, Uc, S_all, QK)


def _chunk_backward(q, k, v, beta, saved, do, dS):
    """Gradients of _chunk_forward by hand, in the same chunked layout (the per-chunk equations
    are in delta_rule_chunkwise's docstring). The reverse carry of dS is the only sequential
    part, again two small products per chunk."""
    Tinv, Y, Uc, S_all, QK = saved
    N, Dk = k.shape[1], k.shape[-1]
    W = Y[..., :Dk]
    dq = do @ S_all
    dQK = (do @ Uc.mT).tril_()
    dq += dQK @ k
    dk = dQK.mT @ q
    dUc = QK.mT @ do                              # completed by the carry below
    R = do.mT @ q                                 # O's direct contribution to dS, per chunk
    D_all = torch.empty_like(S_all)               # gradient w.r.t. the state leaving each chunk
    for n in range(N - 1, -1, -1):
        D_all[:, n] = dS
        dUc[:, n].baddbmm_(k[:, n], dS.mT)
        dS = torch.baddbmm(dS + R[:, n], dUc[:, n].mT, W[:, n], alpha=-1)
    dk += Uc @ D_all
    dY = torch.cat([-(dUc @ S_all), dUc], dim=-1)  # [dW, dU]
    # Y = L^-1 X: dX = L^-T dY and dL = -dX Y^T, of which only the strict lower part lives.
    dX = Tinv.mT @ dY
    dA = (dX @ Y.mT).tril_(-1).neg_()
    dXk, dXv = dX[..., :Dk], dX[..., Dk:]
    dXk += dA @ k                                 # A = (b K) K^T
    dk += dA.mT @ (k * beta)
    dk += beta * dXk
    dv = beta * dXv
    dbeta = (dXk * k).sum(-1, keepdim=True) + (dXv * v).sum(-1, keepdim=True)
    return dq, dk, dv, dbeta, dS


class _DeltaRuleChunkwise(torch.autograd.Function):
    """The chunkwise kernel with a hand-written backward. Autograd through the forward would
    record a node per chunk and per product and allocate a gradient buffer for each; the
    backward below does the reverse state carry with the same two products per chunk and
    everything else batched over all chunks, which is what makes the kernel fast on CPU."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0):
        o, S, saved = _chunk_forward(q, k, v, beta, S0)
        ctx.save_for_backward(q, k, v, beta, *saved)
        return o, S

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        # an output that took no part in the loss arrives as zeros (materialized grads)
        q, k, v, beta, *saved = ctx.saved_tensors
        # Like the forward, in the saved tensors' precision with autocast off: a backward run
        # under autocast (reversible gradients re-enter the forward's autocast) would otherwise
        # compute some products in bf16 and mix them with float32 in place.
        with torch.autocast(q.device.type, enabled=False):
            return _chunk_backward(q, k, v, beta, saved, do.to(q.dtype).contiguous(),
                                   dS.to(q.dtype).contiguous())


def delta_rule_chunkwise(q, k, v, beta, chunk_size: int = 64, initial_state=None,
                         backend: str = "auto"):
    """Chunkwise-parallel delta rule. ``backend``: "torch" (the code above), "fla" (the fused
    CUDA kernel of flash-linear-attention, half precision only) or "auto" (fla for CUDA tensors
    in mixed or half precision when the package is installed, else torch; float32 inputs stay
    on the torch path, so float32 numbers are float32 numbers).

    Per chunk of C rows (K, Q: C x Dk; V: C x Dv; b the betas; S the incoming state):
    A = strictly lower part of diag(b) K K^T; W = (I + A)^-1 diag(b) K, U = (I + A)^-1 diag(b) V
    ((I + A)^-1 from one batched unit-triangular solve for all chunks); U' = U - W S^T;
    O = Q S^T + (Q K^T, causal with the diagonal) U'; S <- S + U'^T K.

    Half-precision inputs are computed in float32 (the state is an accumulator): the output is
    returned in the input dtype, the final state in float32, so that decoding, which carries it
    from call to call, keeps accumulating in float32."""
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'fla', got {backend!r}.")
    if backend == "fla" or (backend == "auto" and q.is_cuda and _half_dtype(q, k, v) is not None
                            and fla_available()):
        return _fla_chunkwise(q, k, v, beta, initial_state)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    out_dtype = q.dtype
    work = torch.promote_types(q.dtype, torch.float32)
    C = chunk_size
    pad = (-T) % C
    N = (T + pad) // C
    G = B * H

    def chunked(x):
        x = x.to(work)
        if pad:  # zero rows with beta = 0 leave the state unchanged
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(G, N, C, x.shape[-1])

    q, k, v, beta = (chunked(x) for x in (q, k, v, beta[..., None]))
    S0 = (initial_state.to(work).reshape(G, Dv, Dk) if initial_state is not None
          else q.new_zeros(G, Dv, Dk))
    with torch.autocast(q.device.type, enabled=False):
        o, S = _DeltaRuleChunkwise.apply(q, k, v, beta, S0)
    o = o.reshape(B, H, N * C, Dv)[:, :, :T]
    return o.to(out_dtype), S.reshape(B, H, Dv, Dk)


class DeltaNetCache:
    """Decoding state of one DeltaNet evaluation: the matrix state S and the short-convolution
    history. Its size does not grow with the number of tokens.

    Cutting back (:meth:`crop`): with ``keep_rewind(tokens)`` (``init_state(rewind=N)``), the
    state and history each of the latest extensions started from, and the keys, values, write
    strengths and convolution inputs it consumed, are kept for its last ``tokens`` tokens; the
    state at an earlier length is rebuilt from there by the token recurrence."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.length = 0
        self.log = RewindLog()
        # what the mixer keeps while it decodes (its stacked projection weights:
        # nn.stacked_linear); a decoding state gives all its caches its own one
        self.shared: dict = {}

    def keep_rewind(self, tokens: int) -> None:
        self.log = RewindLog(tokens)

    def start(self):
        """The state an extension starts from (for :meth:`record`), taken before it changes."""
        return (self.state, dict(self.conv)) if self.log.tokens else None

    def record(self, T: int, start, inputs: dict) -> None:
        """An extension of ``T`` tokens from ``start`` consumed ``inputs`` (for crop)."""
        if start is not None:
            self.log.add(self.length, T, start, inputs)

    def rewind_floor(self) -> int:
        return self.log.floor(self.length)

    def crop(self, length: int) -> None:
        """Cut back to the first ``length`` tokens (at least :meth:`rewind_floor`)."""
        if length == self.length:
            return
        (state, conv), inputs = self.log.cut(length)
        if inputs["k"].shape[2]:
            state = delta_rule_state(inputs["k"], inputs["v"], inputs["beta"], state)
        for name in [n for n in inputs if n.startswith("conv_")]:
            x, hist = inputs[name], conv.get(name[5:])
            if hist is None:  # the extension started the sequence: zeros before it
                hist = x.new_zeros(x.shape[0], self.conv[name[5:]].shape[1], x.shape[2])
            conv[name[5:]] = torch.cat([hist, x], dim=1)[:, x.shape[1]:].clone()
        self.state, self.conv, self.length = state, conv, length

    def freeze(self, step) -> FrozenDeltaNetCache:
        if self.state is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        frozen = FrozenDeltaNetCache(self.state, self.conv, self.length, step)
        frozen.shared = self.shared
        return frozen

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` in that order (beam search)."""
        if self.state is not None:
            self.state = self.state.index_select(0, index.to(self.state.device))
        self.conv = {n: h.index_select(0, index.to(h.device)) for n, h in self.conv.items()}
        self.log = RewindLog(self.log.tokens)  # its rows are the old ones: cut back no further

    def update(self, state: torch.Tensor, T: int) -> None:
        self.state, self.length = state, self.length + T

    def update_conv(self, name: str, history: torch.Tensor) -> None:
        # its own storage: a view would keep the whole prompt's activations alive
        self.conv[name] = history.clone()


class FrozenDeltaNetCache(FrozenCache):
    """A :class:`DeltaNetCache` for frozen one-token steps: the state and convolution history
    are updated in place (fixed shapes and addresses); nothing is logged for cutting back."""

    def __init__(self, state: torch.Tensor, conv: dict[str, torch.Tensor], length: int,
                 step) -> None:
        self.state = state
        self.conv = {n: h.clone() for n, h in conv.items()}  # own storage, updated in place
        self.length, self.static = length, step
        self.shared: dict = {}

    def freeze(self, step) -> FrozenDeltaNetCache:
        self.static = step  # no buffer grows with the capacity
        return self

    def start(self):
        return None

    def record(self, T: int, start, inputs: dict) -> None:
        pass

    def update(self, state: torch.Tensor, T: int) -> None:
        self.state.copy_(state)

    def update_conv(self, name: str, history: torch.Tensor) -> None:
        self.conv[name].copy_(history)


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
        if self.convs is not None:
            for name, conv in self.convs.items():
                hist = cache.conv.get(name) if cache is not None else None
                y, new_hist = conv(proj[name], hist)
                proj[name] = F.silu(y)
                if cache is not None:
                    cache.update_conv(name, new_hist)
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
