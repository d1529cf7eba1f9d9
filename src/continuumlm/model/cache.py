"""Decoding state: the caches that make incremental generation equal to full recompute.

A :class:`DecodeState` holds one cache object per mixer evaluation, keyed by where that
evaluation sits in the network (for a discrete stack, the layer index). The mixer owns the
contents of its cache; the depth module only hands the right cache to the right evaluation.

Two ways to extend a state:

- the ordinary (eager) way, any number of tokens at a time: caches grow on demand and mixers
  read the position from Python integers;
- the *static* way, one token at a time after :meth:`DecodeState.freeze`: every buffer has a
  fixed capacity and the position lives in tensors (:class:`StaticStep`). Nothing a step reads
  then changes its shape or a Python value, so one ``torch.compile`` graph serves every token
  (see ``LanguageModel.generate(..., compile=True)``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

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

    def freeze(self, step: StaticStep) -> None:
        if self.buffers is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        if self.buffers[0].shape[-2] != step.capacity:
            self._grow(self.buffers, step.capacity)
        self.static = step

    def write(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Static step: store one token's (B, H, 1, D) tensors at ``static.pos``; return the
        whole fixed-capacity buffers (positions past ``pos`` hold zeros: mask them)."""
        for buf, x in zip(self.buffers, xs):
            buf[..., self.static.pos, :] = x  # index_put_: updated in place inside a graph
        return tuple(self.buffers)


class KVCache(SeqCache):
    """Keys and values of one attention evaluation (``append(k, v)``, ``write(k, v)``)."""


class DecodeState:
    """Everything a model needs to extend a sequence by more tokens.

    ``pos`` is the number of tokens consumed so far (the absolute position of the next one).
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pos = 0
        self.static: StaticStep | None = None
        self._caches: dict[Hashable, Any] = {}

    def cache(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        if key not in self._caches:
            if self.static is not None:
                raise RuntimeError(f"a frozen decoding state has no cache for {key!r}; it "
                                   f"was frozen before that evaluation ever ran.")
            self._caches[key] = factory()
        return self._caches[key]

    def freeze(self, capacity: int, device: torch.device) -> None:
        """Switch to static one-token steps with room for ``capacity`` tokens in all."""
        if self.pos == 0:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        self.static = StaticStep(capacity, self.pos, device)
        for c in self._caches.values():
            c.freeze(self.static)

    def advance(self) -> None:
        """After a static step: move every cache (and the position) on by one token."""
        self.pos += 1
        for c in self._caches.values():
            c.length += 1
        self.static.advance(self.pos)

    def __len__(self) -> int:
        return len(self._caches)
