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

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn import SharedDropout, make_linear, make_norm


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


def fla_available() -> bool:
    try:
        import fla.ops.delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or broken (e.g. no triton): use our kernel
        return False
    return True


def _fla_chunkwise(q, k, v, beta, initial_state=None):
    """flash-linear-attention's fused chunk kernel (CUDA, Triton) in this module's conventions:
    fla takes (B, T, H, D) tensors, scales q by ``scale`` (1 here: q is given) and keeps the
    state as (B, H, Dk, Dv), the transpose of ours."""
    from fla.ops.delta_rule import chunk_delta_rule

    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    bt = beta.transpose(1, 2).contiguous()
    h0 = initial_state.transpose(-1, -2).contiguous() if initial_state is not None else None
    kwargs = dict(scale=1.0, initial_state=h0, output_final_state=True)
    try:
        o, S = chunk_delta_rule(qt, kt, vt, bt, head_first=False, **kwargs)
    except TypeError:  # releases without the head_first switch are (B, T, H, D) only
        o, S = chunk_delta_rule(qt, kt, vt, bt, **kwargs)
    return o.transpose(1, 2), S.transpose(-1, -2)


def delta_rule_chunkwise(q, k, v, beta, chunk_size: int = 64, initial_state=None,
                         backend: str = "auto"):
    """Chunkwise-parallel delta rule. ``backend``: "torch" (the code below), "fla" (the fused
    CUDA kernel of flash-linear-attention) or "auto" (fla for CUDA tensors when the package is
    installed, else torch)."""
    if backend == "fla" or (backend == "auto" and q.is_cuda and fla_available()):
        return _fla_chunkwise(q, k, v, beta, initial_state)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero rows with beta = 0 leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    beta = beta.reshape(B, H, N, C, 1)
    kb, vb = k * beta, v * beta
    # (I + A) with A the strictly lower part of diag(b) K K^T, for every chunk at once
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    A = (kb @ k.transpose(-1, -2)).tril(-1)
    WU = torch.linalg.solve_triangular(A + eye, torch.cat([kb, vb], dim=-1), upper=False,
                                       unitriangular=True)
    W, U = WU.split([Dk, Dv], dim=-1)  # split, not slices: slice backward fills zeros
    QK = (q @ k.transpose(-1, -2)).tril()  # causal, diagonal included
    S = initial_state if initial_state is not None else q.new_zeros(B, H, Dv, Dk)
    # Only the state carry is sequential: the loop does two small products per chunk and the
    # outputs are formed afterwards in two batched products over all chunks. Chunks are
    # unbound once (indexing inside the loop would make autograd allocate and fill a full-size
    # gradient per chunk, quadratic in T).
    Ks, Ws, Us = (x.unbind(2) for x in (k, W, U))
    states, corrected = [], []
    for n in range(N):
        states.append(S)
        Un = Us[n] - Ws[n] @ S.transpose(-1, -2)
        corrected.append(Un)
        S = S + Un.transpose(-1, -2) @ Ks[n]
    S_start = torch.stack(states, dim=2)                    # (B, H, N, Dv, Dk)
    U_corr = torch.stack(corrected, dim=2)                  # (B, H, N, C, Dv)
    o = q @ S_start.transpose(-1, -2) + QK @ U_corr         # (B, H, N, C, Dv)
    o = o.reshape(B, H, N * C, Dv)
    if pad:
        o = o[:, :, :T]
    return o, S


class DeltaNetCache:
    """Decoding state of one DeltaNet evaluation: the matrix state S and the short-convolution
    history. Its size does not grow with the number of tokens."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.length = 0
        self.static = None

    def freeze(self, step) -> None:
        """Static one-token steps update the state and history in place (fixed shapes)."""
        if self.state is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        self.conv = {n: h.clone() for n, h in self.conv.items()}  # own storage, updated in place
        self.static = step

    def update(self, state: torch.Tensor, T: int) -> None:
        if self.static is not None:
            self.state.copy_(state)
        else:
            self.state, self.length = state, self.length + T

    def update_conv(self, name: str, history: torch.Tensor) -> None:
        if self.static is not None:
            self.conv[name].copy_(history)
        else:
            self.conv[name] = history


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
        y = F.conv1d(xx.transpose(1, 2), self.weight, groups=C).transpose(1, 2)
        return y, xx[:, xx.shape[1] - (self.kernel - 1):]


class DeltaNetAttention(nn.Module):
    """The DeltaNet token mixer: projections, L2-normalized q/k, sigmoid write strength, the
    delta-rule kernel, a per-head norm on the readout, a SiLU output gate and the output
    projection. ``mode = "encoder"`` sums a left-to-right and a right-to-left scan."""

    cache_factory = DeltaNetCache
    chunk_size = 64

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
        self.beta_proj = nn.Linear(C, cfg.num_heads, bias=True)
        self.convs = None
        if cfg.deltanet_short_conv:
            self.convs = nn.ModuleDict({n: ShortConv(C, cfg.deltanet_short_conv) for n in "qkv"})
        self.norm = make_norm(cfg.head_dim, cfg)
        self.dropout = SharedDropout(cfg.dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: DeltaNetCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        if cache is not None and not self.causal:
            raise ValueError("incremental decoding needs mode = 'decoder'.")
        proj = {"q": self.q_proj(x), "k": self.k_proj(x), "v": self.v_proj(x)}
        if self.convs is not None:
            for name, conv in self.convs.items():
                hist = cache.conv.get(name) if cache is not None else None
                y, new_hist = conv(proj[name], hist)
                proj[name] = F.silu(y)
                if cache is not None:
                    cache.update_conv(name, new_hist)
        q = F.normalize(self._heads(proj["q"]), dim=-1)
        k = F.normalize(self._heads(proj["k"]), dim=-1)
        v = self._heads(proj["v"])
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)  # (B, H, T)
        if self.causal:
            init = cache.state if cache is not None else None
            o, state = self._kernel(q, k, v, beta, init)
            if cache is not None:
                cache.update(state, T)
        else:
            o, _ = self._kernel(q, k, v, beta)
            o_rev, _ = self._kernel(q.flip(2), k.flip(2), v.flip(2), beta.flip(2))
            o = o + o_rev.flip(2)
        o = self.norm(o).transpose(1, 2).reshape(B, T, C)
        o = o * F.silu(self.g_proj(x))
        return self.dropout(self.o_proj(o))

    def _kernel(self, q, k, v, beta, initial_state=None):
        if q.shape[2] <= 2:  # decoding steps: the token loop is cheapest
            return delta_rule_recurrent(q, k, v, beta, initial_state)
        return delta_rule_chunkwise(q, k, v, beta, self.chunk_size, initial_state)
