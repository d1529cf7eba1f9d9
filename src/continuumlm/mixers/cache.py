"""Decoding caches of the built-in mixers, and the static one-token position they share.

A cache belongs to one mixer evaluation; the model's :class:`~continuumlm.model.cache.DecodeState`
keys them by where the evaluation sits in the network. These types sit below the model so that
a mixer (built-in or a plugin's) picks its cache without importing the model.

Two ways to extend a cache:

- the ordinary (eager) way, any number of tokens at a time: storage grows on demand and mixers
  read the position from Python integers;
- the *static* way, one token at a time after ``freeze``: every buffer has a fixed capacity and
  the position lives in tensors (:class:`StaticStep`). Nothing a step reads then changes its
  shape or a Python value, so one ``torch.compile`` graph serves every token.
"""

from __future__ import annotations

import torch


class StaticStep:
    """The position of the next token as tensors, shared by every cache of a frozen state.

    ``pos`` is a (1,) long tensor; ``mask`` a (1, capacity) bool tensor that is True for
    positions <= pos (what the token at ``pos`` may attend to). Both change in place.
    """

    def __init__(self, capacity: int, pos: int, device: torch.device) -> None:
        if pos >= capacity:
            raise ValueError(f"a static decoding state of capacity {capacity} is full at "
                             f"position {pos}.")
        self.capacity = capacity
        self.pos = torch.tensor([pos], device=device)
        self.mask = (torch.arange(capacity, device=device) <= pos)[None, :]
        # the capacity is symbolic in a compiled step from the first graph on: one graph for
        # every size the buffers grow to, not a static one first and a recompile at the first
        # doubling
        torch._dynamo.maybe_mark_dynamic(self.mask, 1)

    def advance(self, new_pos: int) -> None:
        """Move to ``new_pos`` (the caller's integer copy, so no device sync is needed)."""
        self.pos += 1
        if new_pos < self.capacity:
            self.mask.index_fill_(1, self.pos, True)


class SeqCache:
    """Per-token tensors of one mixer evaluation, (B, H, T, D) each, along dimension 2.

    Storage grows by doubling, so appending one token is amortized O(1) copies. After
    :meth:`freeze` the storage has a fixed capacity and :meth:`write` puts one token at the
    tensor position of the shared :class:`StaticStep`.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None
        self.length = 0
        self.static: StaticStep | None = None

    def append(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Add (B, H, t, D) tensors; return views of everything so far."""
        if self.static is not None:
            raise RuntimeError("this cache is frozen for one-token static steps; use write().")
        t = xs[0].shape[-2]
        needed = self.length + t
        if self.buffers is None or needed > self.buffers[0].shape[-2]:
            old = self.buffers[0].shape[-2] if self.buffers is not None else 0
            self._grow(xs, max(needed, 2 * old, 16))
        for buf, x in zip(self.buffers, xs):
            buf[..., self.length:needed, :] = x
        self.length = needed
        return tuple(buf[..., :needed, :] for buf in self.buffers)

    def _grow(self, like, capacity: int) -> None:
        # zeros, not empty: a static step multiplies the masked tail by zero weights, and
        # 0 * (uninitialized NaN) would be NaN
        new = [x.new_zeros(*x.shape[:-2], capacity, x.shape[-1]) for x in like]
        if self.buffers is not None:
            for n, b in zip(new, self.buffers):
                n[..., : self.length, :] = b[..., : self.length, :]
        self.buffers = new

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (B',) in that order: beam search's reordering and
        expansion, an index on the batch dimension."""
        if self.buffers is not None:
            self.buffers = [b.index_select(0, index.to(b.device)) for b in self.buffers]

    def freeze(self, step: StaticStep) -> None:
        if self.buffers is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        if self.buffers[0].shape[-2] != step.capacity:
            self._grow(self.buffers, step.capacity)
        for b in self.buffers:
            torch._dynamo.maybe_mark_dynamic(b, b.dim() - 2)  # as StaticStep.mask
        self.static = step

    def write(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Static step: store one token's (B, H, 1, D) tensors at ``static.pos``; return the
        whole fixed-capacity buffers (positions past ``pos`` hold zeros: mask them)."""
        for buf, x in zip(self.buffers, xs):
            buf[..., self.static.pos, :] = x  # index_put_: updated in place inside a graph
        return tuple(self.buffers)


class KVCache(SeqCache):
    """Keys and values of one attention evaluation (``append(k, v)``, ``write(k, v)``)."""
