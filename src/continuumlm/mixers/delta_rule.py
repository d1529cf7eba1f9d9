"""The delta rule's kernels: DeltaNet's matrix state updated by the delta rule (Yang et al. 2024).
The layer, its decoding cache and its short convolution are in deltanet.py.

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

import torch
import torch.nn.functional as F


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


def autocast_off(device_type: str):
    """A context with autocast off on ``device_type`` when it is on (a no-op context else):
    the delta rule's state is an accumulator, kept in at least float32."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def delta_rule_state(k, v, beta, initial_state=None):
    """The state after the tokens (k, v, beta) from ``initial_state`` (None: zeros), by the
    token recurrence in at least float32 with autocast off, as decoding runs it (cutting a
    cache back rebuilds its state with this)."""
    work = k.dtype if k.dtype == torch.float64 else torch.float32
    k, v, beta = k.to(work), v.to(work), beta.to(work)
    init = initial_state.to(work) if initial_state is not None else None
    with autocast_off(k.device.type):
        return delta_rule_recurrent(k, k, v, beta, init)[1]


def delta_rule_step(q, k, v, beta, state):
    """One token of the delta rule: q, k (B, H, 1, Dk), v (B, H, 1, Dv), beta (B, H, 1) and
    the state (B, H, Dv, Dk) -> (o (B, H, 1, Dv), the new state). What
    ``delta_rule_recurrent`` computes for T = 1, as batched products of row vectors instead of
    its einsums, selections and stacking (decoding runs it once per field evaluation)."""
    u = (v - k @ state.mT) * beta.unsqueeze(-1)  # beta (v - S k), as a row
    S = state + u.mT @ k  # an outer product: one rounding per element, as the reference's
    return q @ S.mT, S


def delta_rule_token_states(q, k, v, beta, state):
    """The token recurrence from ``state`` (B, H, Dv, Dk) over T tokens, keeping every
    state: (o (B, H, T, Dv), the states after each token (B, H, T, Dv, Dk)). What a frozen
    state's step over a block of tokens needs to be cut back inside it."""
    outs, states = [], []
    for t in range(k.shape[2]):
        o, state = delta_rule_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                   beta[:, :, t:t + 1], state)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=2), torch.stack(states, dim=2)


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
