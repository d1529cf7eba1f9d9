"""A discrete stack's tokens in the fewest operations (eager, batch 1): plain decoding, the
verifying pass of self-speculative decoding, and drafts through its first layers
(``Draft(layers=n)``), written out op by op with caches of its own, as
:class:`.lean_draft.LeanDraft` does for ODE blocks.

Drafting and verifying share the caches (LayerSkip's reuse, as the decoding pass's shared
states do): a drafted token goes through the first ``n`` layers once, writing their caches
and keeping its output there (:meth:`LeanStack.draft`); the verifying pass runs the last
draft through those layers and every pending token through the later ones
(:meth:`LeanStack.resume`). Its logits equal the decoding pass's up to rounding
(tests/test_lean_stack.py holds them within 1e-10 in float64).

What it covers: :class:`~continuumlm.model.depth.DiscreteStack` of pre-norm
:class:`~continuumlm.model.depth.TransformerBlock` layers with causal softmax attention whose
projections are plain ``nn.Linear``, learned, rotary or no positions, inference, one sequence
(:func:`stack_refusal` names anything else). The norms, MLPs, output projections, final norm
and head are called as the functional calls their forwards make where they are plain modules
without hooks, as modules otherwise (lean_draft._direct).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.depth import DiscreteStack, TransformerBlock
from .lean_draft import LeanBase, _direct, attention_refusal, common_refusal


def stack_refusal(model) -> str | None:
    """Why :class:`LeanStack` cannot run ``model``, in one phrase; None when it can."""
    depth = model.depth
    if type(depth) is not DiscreteStack:
        return f"the depth {type(depth).__name__} is not a discrete stack of layers"
    layers = list(depth.layers)
    for layer in layers:
        if type(layer) is not TransformerBlock:
            return f"the layer {type(layer).__name__} is not the pre-norm TransformerBlock"
    why = common_refusal(model, [
        *layers, *(lay.mixer for lay in layers),
        *(m for lay in layers for m in (getattr(lay.mixer, "qkv", None),
                                        getattr(lay.mixer, "attn_drop", None),
                                        getattr(lay.mixer, "resid_dropout", None),
                                        lay.mlp.dropout))])
    if why is not None:
        return why
    if depth.record is not None:
        return "the stack records its layers' outputs"
    for layer in layers:
        why = attention_refusal(layer.mixer, model.config.mixer)
        if why is not None:
            return why
    return None


class LeanStack(LeanBase):
    """Tokens through ``model``'s discrete stack (see :func:`stack_refusal`), each layer's
    keys and values in buffers of its own; ``pos`` tokens through every layer, and the
    ``pending`` drafts after them through the first layers alone.
    :meth:`logits` extends by any number of tokens, :meth:`crop` cuts back."""

    def __init__(self, model):
        super().__init__(model)
        self.layers = []
        for i, layer in enumerate(model.depth.layers):
            att = layer.mixer
            self.layers.append(dict(
                key=("layer", i), att=att, w=att.qkv.weight, b=att.qkv.bias,
                heads=att.num_heads, head_dim=att.head_dim, rope=att.rope,
                norm1=_direct(layer.norm1), norm2=_direct(layer.norm2), mlp=_direct(layer.mlp),
                out=_direct(att.out_proj)))
        self.nfe = len(self.layers)
        self.pending: list[torch.Tensor] = []  # each draft's output of the first layers

    def crop(self, length: int) -> None:
        self.pending.clear()
        super().crop(length)

    def _run(self, x: torch.Tensor, mask, start: int, stop: int, pos: int) -> torch.Tensor:
        """Layers ``start``..``stop - 1`` over ``x`` (1, T, C), the tokens at ``pos``.."""
        for lay in self.layers[start:stop]:
            x = self._layer(lay, x, mask, pos)
        return x

    def _layer(self, lay: dict, x: torch.Tensor, mask, pos: int) -> torch.Tensor:
        """One pre-norm layer over ``x`` (1, T, C), the tokens at ``pos``.., writing its
        keys and values to the layer's cache."""
        B, T, C = x.shape
        qkv = F.linear(lay["norm1"](x), lay["w"], lay["b"]).view(B, T, 3, lay["heads"],
                                                                 lay["head_dim"])
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if lay["rope"] is not None:
            q = lay["rope"](q, pos)
        kv = self._write(lay["key"], lay["att"], k, v, pos)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask)
        x = x + lay["out"](y.transpose(1, 2).reshape(B, T, C))
        return x + lay["mlp"](lay["norm2"](x))

    def logits(self, tokens: list[int], every: bool = False) -> torch.Tensor:
        """The logits (V,) after ``tokens``, the tokens at positions pos.. through every
        layer (pos moves on by their number); ``every``: after each of them, (T, V)."""
        if self.pending:
            raise RuntimeError("LeanStack.logits with drafts pending: resume() or crop() "
                               "them first.")
        x, mask = self._embed(tokens, self.pos)
        x = self._run(x, mask, 0, len(self.layers), self.pos)
        self.pos += len(tokens)
        return self._read_out(x, every)

    def early(self, tokens: list[int], layers: int) -> torch.Tensor:
        """The logits (V,) after ``tokens`` (the tokens at positions pos.., pos moving on by
        their number) through the first ``layers`` layers, the final norm and the head
        (LayerSkip's early exit), the later layers' caches left as they are: a drafter of its
        own, with no verifier sharing its caches (``Draft(pipeline=True)``)."""
        if self.pending:
            raise RuntimeError("LeanStack.early with drafts pending: resume() or crop() "
                               "them first.")
        x, mask = self._embed(tokens, self.pos)
        x = self._run(x, mask, 0, layers, self.pos)
        self.pos += len(tokens)
        return self._read_out(x, False)

    def draft(self, token: int, layers: int) -> torch.Tensor:
        """The logits (V,) of the first ``layers`` layers after ``token``, the token after
        the pending ones, through the final norm and head (LayerSkip's early exit); its
        output there is kept for :meth:`resume`."""
        return self._read_out(self._first(token, layers), False)

    def _first(self, token: int, layers: int) -> torch.Tensor:
        """``token``, the token after the pending ones, through the first ``layers`` layers
        (1, 1, C), kept pending."""
        at = self.pos + len(self.pending)
        x, _ = self._embed([token], at)
        x = self._run(x, None, 0, layers, at)
        self.pending.append(x)
        return x

    def resume(self, token: int, layers: int) -> torch.Tensor:
        """The logits (T, V) after each pending token and ``token`` (the last draft, through
        the first ``layers`` layers first), the later layers over all of them at once: the
        verifying pass, from the states the drafts made."""
        self._first(token, layers)
        h = torch.cat(self.pending, dim=1)
        self.pending.clear()
        T = h.shape[1]
        x = self._run(h, self._mask(T, self.pos, h), layers, len(self.layers), self.pos)
        self.pos += T
        return self._read_out(x, True)
