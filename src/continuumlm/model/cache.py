"""Decoding state: the caches that make incremental generation equal to full recompute.

A :class:`DecodeState` holds one cache object per mixer evaluation, keyed by where that
evaluation sits in the network (for a discrete stack, the layer index). The mixer owns the
contents of its cache; the depth module only hands the right cache to the right evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch


class KVCache:
    """Keys and values of one attention evaluation, (B, H, T, D) each.

    Storage grows by doubling so appending one token is amortized O(1) copies.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add (B, H, t, D) keys/values; return views of all keys/values so far."""
        t = k.shape[-2]
        needed = self.length + t
        if self.k is None or needed > self.k.shape[-2]:
            capacity = max(needed, 2 * (self.k.shape[-2] if self.k is not None else 0), 16)
            new_k = k.new_empty(*k.shape[:-2], capacity, k.shape[-1])
            new_v = v.new_empty(*v.shape[:-2], capacity, v.shape[-1])
            if self.k is not None:
                new_k[..., : self.length, :] = self.k[..., : self.length, :]
                new_v[..., : self.length, :] = self.v[..., : self.length, :]
            self.k, self.v = new_k, new_v
        self.k[..., self.length:needed, :] = k
        self.v[..., self.length:needed, :] = v
        self.length = needed
        return self.k[..., :needed, :], self.v[..., :needed, :]


class DecodeState:
    """Everything a model needs to extend a sequence by more tokens.

    ``pos`` is the number of tokens consumed so far (the absolute position of the next one).
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.pos = 0
        self._caches: dict[Hashable, Any] = {}

    def cache(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        if key not in self._caches:
            self._caches[key] = factory()
        return self._caches[key]

    def __len__(self) -> int:
        return len(self._caches)
