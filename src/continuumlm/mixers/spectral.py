"""The numerics of continuous spectral attention (CAT), as functions of tensors: the basis, the
quadrature nodes (Gauss-Legendre, composite panels), where each node reads between two tokens,
the mixing matrix and the gathered mixture (also per row of a padded batch), the relative
kernel's prior, and the attention of the exact forms (SDPA over unequal widths, the Toeplitz
prior of consecutive queries). The layer
(``continuous.py``) owns the parameters and the projections and calls these; the tests read
the layer's thin wrappers of them (``phi``, ``quadrature``, ``mixing``, ``distance_prior``).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def basis(s: torch.Tensor, n_freq: int, kind: str) -> torch.Tensor:
    """Basis functions at positions s (any shape) -> (..., n_freq): Fourier cosines
    cos(pi f s), or Chebyshev polynomials T_f(2s - 1) with s clamped to [0, 1]."""
    f = torch.arange(n_freq, device=s.device, dtype=s.dtype)
    if kind == "fourier":
        return torch.cos(math.pi * s[..., None] * f)
    x = (2 * s.clamp(0.0, 1.0) - 1).clamp(-1.0, 1.0)
    return torch.cos(f * torch.arccos(x)[..., None])  # T_f(x) = cos(f arccos x)


def gauss_legendre(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` Gauss-Legendre nodes on [0, 1] and their log-weights, in float64."""
    x, w = np.polynomial.legendre.leggauss(n)
    return (x + 1) / 2, np.log(w / 2)


def sobolev_weights(n_freq: int, relative: bool) -> np.ndarray:
    """The biharmonic penalty's weights: (f^2 + g^2)^2 on the (F, F) kernel, f^4 on the
    relative kernel's one axis."""
    f = np.arange(n_freq, dtype=np.float64)
    return f ** 4 if relative else (f[:, None] ** 2 + f[None, :] ** 2) ** 2


def power_law_coefficients(heads: int, n_freq: int, kind: str, scale: float) -> torch.Tensor:
    """Coefficients of b_h(d) = -m_h log(1 + d) (up to a constant, which softmax ignores)
    for d <= ``scale``, with m_h from 1/4 to 4 geometrically over the heads: softmax weights
    proportional to (1 + d)^-m_h, from nearly flat to local, as ALiBi's per-head slopes
    are for linear distances. In u = log(1 + d) / log(1 + scale) the prior is -a_h u,
    a_h = m_h log(1 + scale): its cosine series has a_h 4 / (pi f)^2 at odd f (truncated
    at n_freq: at n_freq 32 the largest error up to ``scale`` is 0.27), its Chebyshev series
    -a_h / 2 at f = 1. With n_freq = 1 (a constant) the prior starts, and stays, flat."""
    m = torch.logspace(-2, 2, heads, base=2.0) if heads > 1 else torch.ones(1)
    a = m * math.log1p(scale)
    coef = torch.zeros(heads, n_freq)
    f = torch.arange(n_freq, dtype=torch.float64)
    if kind == "fourier":
        odd = (f % 2 == 1).double()
        coef = (a[:, None].double() * 4 / (math.pi * f.clamp(min=1)) ** 2 * odd).float()
    elif n_freq > 1:
        coef[:, 1] = -a / 2
    return coef


def composite_nodes(upper: torch.Tensor, width: float, nodes: torch.Tensor,
                    log_w: torch.Tensor, panels: int | None = None):
    """Composite Gauss-Legendre nodes on [0, upper] in panels of ``width`` (in s): (Tq, M*Q)
    nodes and log-weights (-inf on the panels a query does not reach); the panel count M
    is that of the furthest query, so nodes grow with the context. A frozen decoding step
    gives M (``panels``, from its buffer's capacity) instead: the furthest query's count
    is a device value, whose read on the host would tie the step's shape to the position
    (a recompile per panel under torch.compile, no CUDA-graph replay). Panels past a
    query's reach have zero width and weigh nothing (log-weight -inf), so a larger M
    gives the same mixture. ``nodes`` and ``log_w``: one panel's, in the working dtype."""
    dt = nodes.dtype
    if panels is None:
        count = torch.clamp(torch.ceil(upper / width), min=1)        # panels per query
        m = int(count.max())
    else:
        m = panels
    k = torch.arange(m, device=upper.device, dtype=dt)               # (M,)
    start = k[None, :] * width                                        # (Tq, M)
    end = torch.minimum(start + width, upper[:, None])
    size = (end - start).clamp(min=0)                                # 0 past the query
    w = log_w.exp()
    t = (start[..., None] + size[..., None] * nodes).flatten(1)      # (Tq, M*Q)
    weight = (size[..., None] * w).flatten(1)
    # a query at s = 0 has one panel of width 0: its nodes all sit at 0, equally weighted
    zero = (upper == 0)[:, None]
    out = torch.where(weight > 0, weight.clamp_min(torch.finfo(dt).tiny).log(),
                      torch.full_like(weight, float("-inf")))
    out = torch.where(zero & (torch.arange(t.shape[1], device=t.device) < len(nodes)),
                      torch.zeros_like(out), out)
    return t, out


def between_tokens(u: torch.Tensor, bound: torch.Tensor):
    """Where nodes at ``u`` (Tq, Q), in token units, read: tokens lo and hi = lo + 1 (both at
    most ``bound`` (Tq,), the query or the last key) and the weight alpha on hi."""
    u = torch.minimum(u, bound[:, None])                              # never past the query
    lo = u.floor()
    alpha = u - lo
    lo = lo.long()
    hi = torch.minimum(lo + 1, bound[:, None].long())
    return lo, hi, alpha


def mixing_matrix(p: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, alpha: torch.Tensor,
                  n_keys: int) -> torch.Tensor:
    """(H, Tq, n_keys) weights from node probabilities p (H, Tq, Q) read between tokens lo and
    hi: row i mixes the values of tokens 0..n_keys-1."""
    H = p.shape[0]
    M = p.new_zeros(H, p.shape[1], n_keys)
    idx = lambda i: i.expand(H, -1, -1)  # noqa: E731
    return M.scatter_add(2, idx(lo), p * (1 - alpha)).scatter_add(2, idx(hi), p * alpha)


def gathered(v: torch.Tensor, p: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
             alpha: torch.Tensor) -> torch.Tensor:
    """(B, H, Tq, D): the mixture at Tq queries from the 2 * Q values each reads of ``v``
    (B, H, n_keys, D): O(Tq * Q * D) per head, against the dense (Tq x n_keys) matrix."""
    w_lo, w_hi = (p * (1 - alpha)).to(v.dtype), (p * alpha).to(v.dtype)
    return (torch.einsum("hiq,bhiqd->bhid", w_lo, v[:, :, lo])
            + torch.einsum("hiq,bhiqd->bhid", w_hi, v[:, :, hi]))


def distance_prior(distance: torch.Tensor, coef: torch.Tensor, kind: str,
                   scale: float) -> torch.Tensor:
    """The relative kernel at integer distances (any shape, >= 0) -> (H, *shape):
    sum_f c_hf phi_f(u(d)), u(d) = min(1, log(1 + d) / log(1 + scale)), in ``coef``'s dtype
    (at least float32)."""
    dt = coef.dtype
    u = (torch.log1p(distance.to(dt)) / math.log1p(scale)).clamp(max=1.0)
    return torch.einsum("...f,hf->h...", basis(u, coef.shape[-1], kind), coef)


def padded_gathered(v: torch.Tensor, quadrature, positions: torch.Tensor, first: torch.Tensor,
                    chunk: int) -> torch.Tensor:
    """(B, H, T, D): the quadrature of a padded batch's queries at ``positions`` (B, T), each
    row's positions and nodes counted from its first real token ``first`` (B,), over the values
    ``v`` (B, H, L, D) of every token so far; ``quadrature(pos, n_keys)`` gives (p, lo, hi,
    alpha) for flat positions. ``chunk`` queries at a time bound the gathered (B, H, Tc, Q, D)."""
    B, H, L, D = v.shape
    outs = []
    for i in range(0, positions.shape[1], chunk):
        pos = positions[:, i:i + chunk]                                 # (B, Tc)
        Tc = pos.shape[1]
        p, lo, hi, alpha = quadrature(pos.reshape(-1), L)               # (H, B*Tc, Q), (B*Tc, Q)
        Q = p.shape[-1]
        p, alpha = p.view(H, B, Tc, Q), alpha.view(B, Tc, Q)
        at = (first[:, None, None] + torch.stack([lo, hi]).view(2, B, Tc, Q)).clamp(max=L - 1)
        w = torch.stack([p * (1 - alpha), p * alpha]).to(v.dtype)
        y = 0
        for j in range(2):  # the values each node reads, gathered per row
            idx = at[j].view(B, 1, Tc * Q, 1).expand(B, H, Tc * Q, D)
            vals = torch.gather(v, 2, idx).view(B, H, Tc, Q, D)
            y = y + torch.einsum("hbtq,bhtqd->bhtd", w[j], vals)
        outs.append(y)
    return torch.cat(outs, dim=2)


def sdpa_any_dims(q, k, v, mask, is_causal: bool) -> torch.Tensor:
    """Scaled-dot-product attention (scale 1) whose query/key width differs from the values'
    (the kernel's n_freq, or head_dim + n_freq in bias mode, against head_dim): the narrower
    side is zero-padded to the wider, which changes no product or sum, because the fused
    kernels need equal widths and the fallback forms the full T x T matrix (6x slower at 5000
    tokens on a CPU, measured)."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dq > dv:
        v = torch.nn.functional.pad(v, (0, dq - dv))
    elif dv > dq:
        q, k = (torch.nn.functional.pad(t, (0, dv - dq)) for t in (q, k))
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         is_causal=is_causal, scale=1.0)
    return y[..., :dv]


def toeplitz_sdpa(q, k, v, row: torch.Tensor, offset: int, chunk: int) -> torch.Tensor:
    """SDPA (scale 1) of queries at the consecutive positions offset..offset+Tq-1 with an
    additive prior that depends on the signed distance alone: ``row`` (H, offset + Tq + n - 1)
    holds it at the signed distances -(n - 1).. (n: the keys). The (Tq, n) bias is Toeplitz,
    a strided view of ``row`` against the keys in reverse order (SDPA does not depend on the
    keys' order), so no (H, Tq, n) index or gather is built (at 5,000 tokens that took 1.6 s
    of a 2 s call); ``chunk`` queries at a time bound what SDPA forms."""
    n, Tq = k.shape[2], q.shape[2]
    # against the reversed keys, query i (at offset + i) and reversed key r (key n - 1 - r)
    # read row[offset + i + r]
    row = row.contiguous()
    k, v = k.flip(2), v.flip(2)
    outs = []
    for i in range(0, Tq, chunk):
        c = min(chunk, Tq - i)
        bias = row.as_strided((1, row.shape[0], c, n), (0, row.shape[1], 1, 1),
                              row.storage_offset() + offset + i)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, i:i + c], k, v, attn_mask=bias, scale=1.0))
    return torch.cat(outs, dim=2)
