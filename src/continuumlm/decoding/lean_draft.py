"""A solve's tokens in the fewest operations (eager, batch 1): a coarse solve's drafts for
self-speculative decoding, and the model's own solve for plain decoding and verification.

A token through the library's decoding pass goes through the decoding state, the solve's
machinery (gradient modes, regularizers, exits, compiled steps, padding) and module dispatch,
and on a small model most of its time is there rather than in the field's products. The lean
step writes the solve out op by op, with caches of its own: the speculative loop
(``speculative.py``) drafts through it, and plain decoding (``stream.py``) and the verifying
pass run the model's own solve through it (``lean.own_step`` decides: :func:`refusal` for
ODE blocks, ``lean_stack.stack_refusal`` for a discrete stack, which runs as
``lean_stack.LeanStack``), through the decoding pass otherwise (the decoder and the stream's
stats say which, and why). Measured on the Shakespeare any-depth models (bench/speculative.py,
bench/draft_cost.py), a drafted Euler x 1 token costs about a third of its decoding pass and
a plain token under half.

What it covers: ODE blocks with the sequential or parallel field and softmax attention whose
projections are plain ``nn.Linear`` (bias or not), every ``model.ode_kv`` layout, any fixed-
grid Runge-Kutta tableau, learned, rotary or no positions, time and step-size embeddings,
inference (no dropout, no gradient, no per-token exit), one sequence. Its logits equal the
decoding pass's of the same solve up to rounding (the queries and the memory may be one
product or two, either way; tests/test_lean_draft.py holds them within 1e-10 in float64 on
each of these). It calls the field's norms and MLP, the output projection, the time
embeddings, the final norm and the head: as the functional calls their forwards make where
they are plain modules without hooks (bound when the step is made, for one stream), as
modules otherwise; the modules it does not call (the embeddings, the depth, the blocks, the
field, the fused projection) must carry no hooks and no replaced ``forward``, which it would
skip. A draft only proposes: the model's own solve verifies every token, so a draft's rounding
could change which drafts are kept, never the tokens decoded; the own solve's rounding may
differ from the decoding pass's in the last bits, as two cached passes over different token
blocks already do.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as _module

from ..mixers.softmax import SoftmaxAttention
from ..model.fields import ParallelField, SequentialField
from ..nn import MLP
from ..ode.solvers import FixedGridSolver, combine, grid


def _plus(x: torch.Tensor, te) -> torch.Tensor:
    return x if te is None else x + te


def common_refusal(model, skipped: list) -> str | None:
    """What no lean step runs (an ODE model's or a discrete stack's), in one phrase, or None;
    ``skipped``: the modules besides the embeddings the step would not call."""
    if model.training or torch.is_grad_enabled():
        return "it runs in inference alone (eval mode, no gradient)"
    if type(model.tok_emb) is not nn.Embedding or (
            model.pos_emb is not None and type(model.pos_emb) is not nn.Embedding):
        return "the embeddings are not plain nn.Embedding"
    if any(e is not None and e.max_norm is not None for e in (model.tok_emb, model.pos_emb)):
        return "an embedding renormalizes its rows (max_norm)"
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return "a global module hook is registered (the step calls few modules)"
    for m in [model.tok_emb, model.pos_emb, model.drop, model.depth, *skipped]:
        # the step computes the attention itself: a mixer's replaced methods are skipped too
        replaced = ({"forward", "extend", "read", "write", "_layer", "_attend", "_attention",
                     "cache_factory"} & set(vars(m)) if m is not None else ())
        if m is not None and (m._forward_hooks or m._forward_pre_hooks or replaced):
            return (f"{type(m).__name__} has hooks or a replaced forward (or attention "
                    f"method), which the step would not call")
    return None


def attention_refusal(mixer, name: str) -> str | None:
    """Why the lean step cannot compute ``mixer`` itself (causal softmax attention with plain
    projections and no active dropout), or None; ``name``: the config's mixer."""
    if type(mixer) is not SoftmaxAttention or not mixer.causal:
        return f"the mixer {name!r} is not causal softmax attention"
    for lin in (mixer.qkv, mixer.out_proj):
        if type(lin) is not nn.Linear or lin._forward_hooks or lin._forward_pre_hooks:
            return "the attention's projections are not plain nn.Linear without hooks"
    if mixer.attn_drop.active() or mixer.resid_dropout.active():
        return "dropout is active"
    return None


def refusal(model, blocks) -> str | None:
    """Why :class:`LeanDraft` cannot run ``model`` with the solve ``blocks`` (per block:
    (solver, config): speculative._Solves' snapshot of a draft, or :func:`own_solve`), in one
    phrase; None when it can."""
    cfg = model.config
    if cfg.depth != "ode":
        return "the model's depth is not ODE blocks"
    depth = model.depth
    # inference and exits named first (common_refusal checks inference again, for stacks)
    if model.training or torch.is_grad_enabled():
        return "it runs in inference alone (eval mode, no gradient)"
    if (getattr(depth, "exit", None) is not None or getattr(depth, "ladder", None) is not None
            or getattr(depth, "extras", None) is not None
            or getattr(depth, "record", None) is not None):
        return "the model exits per token, records states or runs regularizers"
    why = common_refusal(model, [
        *depth.blocks, *(b.field for b in depth.blocks),
        *(b.field.mixer for b in depth.blocks if hasattr(b.field, "mixer")),
        *(b.field.mixer.qkv for b in depth.blocks
          if hasattr(b.field, "mixer") and hasattr(b.field.mixer, "qkv")),
        *(d for b in depth.blocks for d in getattr(b, "_dropouts", ()))])
    if why is not None:
        return why
    for block, (solver, _) in zip(depth.blocks, blocks):
        f = block.field
        if type(f) not in (SequentialField, ParallelField) or block.field.post_mlp:
            return f"the field {cfg.field!r} is not the sequential or parallel one"
        why = attention_refusal(f.mixer, cfg.mixer)
        if why is not None:
            return why
        if any(d.active() for d in block._dropouts):
            return "dropout is active"
        if (not isinstance(solver, FixedGridSolver) or type(solver).step is not
                FixedGridSolver.step or getattr(solver, "reversible", False)):
            return f"the draft solver {type(solver).__name__} is not a fixed-grid tableau"
    return None


def _direct(m: nn.Module):
    """``m``'s forward as the functional call it makes, bound to its tensors (a module call's
    dispatch and attribute look-ups cost about as much as a one-token product): for a plain
    ``nn.Linear``, ``nn.LayerNorm``, ``nn.RMSNorm`` or :class:`~continuumlm.nn.MLP` of plain
    linears, none with hooks or a replaced forward; any other module is returned as itself, to
    be called as a module. Bound for one stream, whose weights do not change (inference)."""
    if m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m):
        return m
    kind = type(m)
    if kind is nn.Linear:
        w, b = m.weight, m.bias
        return lambda x: F.linear(x, w, b)
    if kind is nn.LayerNorm:
        shape, w, b, eps = m.normalized_shape, m.weight, m.bias, m.eps
        return lambda x: F.layer_norm(x, shape, w, b, eps)
    if kind is nn.RMSNorm:
        shape, w, eps = m.normalized_shape, m.weight, m.eps
        return lambda x: F.rms_norm(x, shape, w, eps)
    if kind is MLP and not m.dropout.active():
        fc, proj = _direct(m.fc), _direct(m.proj)
        if fc is not m.fc and proj is not m.proj:
            return lambda x: proj(F.gelu(fc(x)))
    return m


def own_solve(model) -> list[tuple]:
    """The model's own solve per block, (solver, config), as :class:`LeanDraft` takes a
    draft's: the lean step of the model's own solve (plain decoding, and verification)."""
    return [(b.solver, b.cfg) for b in getattr(model.depth, "blocks", ())]


class LeanBase:
    """What every lean step shares: the embeddings, final norm and head bound once, the
    memory's buffers (keys and values per cache, written at a position), ``pos`` tokens so
    far. :class:`LeanDraft` (ODE blocks) and :class:`.lean_stack.LeanStack` (a discrete
    stack) run the depth between."""

    def __init__(self, model):
        self.model, self.pos = model, 0
        # what each token reads, bound once (module attribute look-ups cost microseconds)
        self.emb = model.tok_emb.weight
        self.pos_table = None if model.pos_emb is None else model.pos_emb.weight
        self.max_len = model.config.max_seq_len
        self.head = _direct(model.lm_head)
        self.norm_f = _direct(model.norm_f)
        self._buffers: dict[tuple, list[torch.Tensor]] = {}

    def crop(self, length: int) -> None:
        self.pos = min(self.pos, length)

    def _write(self, where: tuple, att: SoftmaxAttention, k: torch.Tensor,
               v: torch.Tensor, pos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Put keys and values (1, H, T, D) of the tokens at ``pos``.. (default: self.pos)
        into the cache ``where`` (doubling its capacity as needed); every token's so far."""
        pos = self.pos if pos is None else pos
        T = k.shape[-2]
        if att.rope is not None:
            k = att.rope(k, pos)
        bufs = self._buffers.get(where)
        if bufs is None or bufs[0].shape[-2] < pos + T:
            size = max(pos + T, 16, 2 * bufs[0].shape[-2] if bufs else 0)
            new = [k.new_zeros(*k.shape[:-2], size, k.shape[-1]) for _ in range(2)]
            if bufs:
                for n, o in zip(new, bufs):
                    n[..., :pos, :] = o[..., :pos, :]
            self._buffers[where] = bufs = new
        bufs[0][..., pos:pos + T, :] = k
        bufs[1][..., pos:pos + T, :] = v
        return bufs[0][..., :pos + T, :], bufs[1][..., :pos + T, :]

    def _embed(self, tokens: list[int], pos: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the embedded ``tokens`` at positions pos.., (1, T, C); the additive mask of their
        queries against every key so far, None for one token)."""
        T = len(tokens)
        # one token by an integer index (a view), several by a gather
        x = self.emb[tokens[0]][None, None] if T == 1 else self.emb[tokens][None]
        if self.pos_table is not None:
            if pos + T > self.max_len:
                raise ValueError(f"sequence of {pos + T} tokens is longer than max_seq_len = "
                                 f"{self.max_len}, the size of this model's learned position "
                                 f"table.")
            x = x + self.pos_table[pos:pos + T]
        return x, self._mask(T, pos, x)

    def _read_out(self, x: torch.Tensor, every: bool) -> torch.Tensor:
        """The logits after every row of ``x`` (1, T, C), (T, V), or after its last, (V,):
        the head sees rows (N, C), as from ``model.step`` (a head called as a module)."""
        out = self.head(self.norm_f(x[0] if every else x[0, -1:]))
        return out if every else out[0]

    @staticmethod
    def _mask(T: int, pos: int, like: torch.Tensor) -> torch.Tensor | None:
        """The queries of the T tokens at pos.. against every key so far: key j is seen by
        query i when j <= pos + i; None for one token. Additive, made once per call: a
        boolean mask is converted by every attention, about a third of its time at a few
        tokens."""
        return None if T == 1 else torch.full((T, pos + T), float("-inf"), dtype=like.dtype,
                                              device=like.device).triu(pos + 1)


class LeanDraft(LeanBase):
    """Tokens through ``model``'s blocks integrated with the solve ``blocks`` (a draft's, or
    the model's own: :func:`own_solve`; see :func:`refusal`), each block's memory in buffers
    of its own; ``pos`` tokens so far.
    :meth:`logits` extends by any number of tokens, :meth:`crop` cuts back."""

    def __init__(self, model, blocks):
        super().__init__(model)
        self.blocks = []
        for block, (solver, cfg) in zip(model.depth.blocks, blocks):
            att = block.field.mixer
            C = cfg.hidden_size
            w, b = att.qkv.weight, att.qkv.bias
            dt = (cfg.ode_t1 - cfg.ode_t0) / cfg.ode_steps
            f = block.field
            self.blocks.append(dict(
                field=f, att=att, key=block.index, tab=solver.tableau, cfg=cfg,
                norm1=_direct(f.norm1), norm2=_direct(f.norm2), mlp=_direct(f.mlp),
                out=_direct(att.out_proj), sequential=type(f) is SequentialField,
                heads=att.num_heads, head_dim=att.head_dim, rope=att.rope,
                w=w, b=b, wq=w[:C], bq=None if b is None else b[:C],
                wkv=w[C:], bkv=None if b is None else b[C:], dt=dt,
                field_dt=dt / solver.tableau.stages if cfg.ode_dt_embedding_reads ==
                "evaluation" else dt, times=grid(cfg.ode_t0, cfg.ode_t1, cfg.ode_steps)))
        self.nfe = sum(len(b["times"]) * b["tab"].stages for b in self.blocks)
        # the time (and step-size) embeddings by (block, t, dtype): in inference they depend on
        # nothing else while a stream runs, and a draft evaluates few distinct times
        self._temb: dict[tuple, torch.Tensor | None] = {}

    def _te(self, b: dict, t: float, like: torch.Tensor):
        key = (b["key"], t, like.dtype)
        if key not in self._temb:
            self._temb[key] = b["field"].temb(t, like)
        return self._temb[key]

    def _mixer_input(self, b: dict, t: float, h: torch.Tensor) -> torch.Tensor:
        return _plus(b["norm1"](h), self._te(b, t, h))

    def _memory(self, b: dict, where: tuple, m: torch.Tensor) -> tuple:
        B, T, C = m.shape
        kv = F.linear(m, b["wkv"], b["bkv"]).view(B, T, 2, b["heads"], b["head_dim"])
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)
        return self._write(where, b["att"], k, v)

    def _field(self, b: dict, t: float, h: torch.Tensor, kv: tuple | None, where: tuple,
               mask, m: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """(the field at (t, h), the keys and values it read): kv, the memory it reads (ode_kv
        step or block), or None (the evaluation's own keys and values, written to ``where``);
        ``m``: the memory's input when it is this evaluation's mixer input too (a step's first
        stage), whose keys and values are then written to ``where`` with the queries in one
        product."""
        B, T, C = h.shape
        te = self._te(b, t, h)
        if kv is None or m is not None:
            m = _plus(b["norm1"](h), te) if m is None else m
            qkv = F.linear(m, b["w"], b["b"]).view(B, T, 3, b["heads"], b["head_dim"])
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            kv = self._write(where, b["att"], k, v)
        else:
            m = _plus(b["norm1"](h), te)
            q = F.linear(m, b["wq"], b["bq"]).view(B, T, b["heads"], b["head_dim"])
            q = q.transpose(1, 2)
        if b["rope"] is not None:
            q = b["rope"](q, self.pos)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
        a = b["out"](y.transpose(1, 2).reshape(B, T, C))
        if b["sequential"]:
            return a + b["mlp"](_plus(b["norm2"](h + a), te)), kv
        return a + b["mlp"](_plus(b["norm2"](h), te)), kv

    def logits(self, tokens: list[int], every: bool = False) -> torch.Tensor:
        """The logits (V,) after ``tokens``, the tokens at positions pos.. (pos moves on by
        their number); ``every``: after each of them, (len(tokens), V)."""
        pos, T = self.pos, len(tokens)
        x, mask = self._embed(tokens, pos)
        for b in self.blocks:
            cfg, tab, dt, f = b["cfg"], b["tab"], b["dt"], b["field"]
            if f.dt != b["field_dt"]:
                f.dt = b["field_dt"]  # what a step-size embedding reads (as the solve sets it)
            kv = None
            for s, t in enumerate(b["times"]):
                # a step's first stage reads the memory's input (ode_kv block: the first
                # step's; step: every step's): one product makes its queries, keys and values
                m, where = None, None
                if cfg.ode_kv == "step" or (cfg.ode_kv == "block" and s == 0):
                    where = (b["key"], "step", s) if cfg.ode_kv == "step" else (b["key"],
                                                                                "block")
                    m = self._mixer_input(b, t, x)
                    if tab.c[0] != 0.0:  # a tableau whose first stage is not at the step's t
                        kv, m = self._memory(b, where, m), None
                ks: list[torch.Tensor] = []
                for i in range(tab.stages):
                    hi = combine(x, dt, tab.a[i], ks) if i else x
                    first = i == 0 and m is not None
                    k_i, read = self._field(b, t + tab.c[i] * dt, hi, kv,
                                            where if first else (b["key"], s * tab.stages + i),
                                            mask, m if first else None)
                    ks.append(k_i)
                    if first:
                        kv = read  # the memory the step's later stages read
                x = combine(x, dt, tab.b, ks)
        self.pos += T
        return self._read_out(x, every)
