"""Decoding state: the caches that make incremental generation equal to full recompute.

A :class:`DecodeState` holds one cache object per mixer evaluation, keyed by where that
evaluation sits in the network (for a discrete stack, the layer index). The mixer owns the
contents of its cache; the depth module only hands the right cache to the right evaluation.

A state can be cut back to an earlier length (:meth:`DecodeState.crop`) and extended again.

Two ways to extend a state:

- the ordinary (eager) way, any number of tokens at a time (``LanguageModel.step``): caches
  grow on demand and mixers read the position from Python integers;
- the *frozen* way, one token at a time after :meth:`DecodeState.freeze`, which replaces each
  cache by its fixed-capacity layout (``continuumlm.mixers.cache.FrozenCache``) with the
  position in tensors (:class:`StaticStep`). Nothing a step reads then depends on the
  position as a Python value, so one ``torch.compile`` graph of one solver step (or layer)
  serves every step of every token (see :mod:`continuumlm.decoding.frozen`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..mixers.cache import FrozenCache, KVCache, SeqCache, StaticStep

__all__ = ["CacheMemory", "DecodeState", "KVCache", "SeqCache", "StaticStep"]


class DecodeState:
    """Everything a model needs to extend a sequence by more tokens.

    ``pos`` is the number of tokens consumed so far (the absolute position of the next one).
    ``rewind``: how many of the latest tokens :meth:`crop` must be able to cut back (caches
    that grow with the sequence can always be cut back; a cache of fixed size, a DeltaNet
    state, keeps what its last ``rewind`` tokens need: 0, the default, keeps nothing).
    """

    def __init__(self, batch_size: int, rewind: int = 0) -> None:
        self.batch_size = batch_size
        self.rewind = rewind
        self.pos = 0
        self.solve: tuple[str, int] | None = None  # (ode_solver, ode_steps) that built the caches
        self.static: StaticStep | None = None
        self._caches: dict[Hashable, Any] = {}
        # what the mixers keep for as long as this state decodes (DeltaNet's stacked
        # projection weights), handed to every cache that has a ``shared`` dict
        self.shared: dict = {}
        # (B, pos) bool, which consumed tokens are real, once a padded batch came through;
        # None while every token so far was real
        self.keys: torch.Tensor | None = None

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (B',) in that order, in every cache: what beam search
        does between steps (and how it expands a batch). Every decoding state is batch-first,
        so this is an index on the batch dimension; a cache type without ``reorder(index)`` (a
        plugin's) is refused by name."""
        if self.static is not None:
            raise ValueError("a frozen (static) decoding state cannot be reordered.")
        self._require("reorder", "reorder(index)", "its batch rows cannot be reordered (beam "
                      "search)", "give the cache type a reorder method that indexes its batch "
                      "dimension")
        for c in self._caches.values():
            c.reorder(index)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
        self.batch_size = int(index.shape[0])

    @classmethod
    def regroup(cls, parts: list[tuple[DecodeState, torch.Tensor | None]]) -> DecodeState:
        """One state holding, part after part, the rows ``index`` of each part's state (None:
        all of them; an index may repeat a row), each row padded on the left to the longest
        row's tokens and positions that are pads in every row left out: how requests join and
        leave a running batch (continuous batching, :mod:`continuumlm.serve`), in one copy of
        the caches. The padding mask marks the pads, so every row decodes on as it would
        alone. The parts must come from the same solve and hold the same caches, eager (not
        frozen); what a state keeps for cutting back is not carried over."""
        first = parts[0][0]
        for s, _ in parts:
            if s.static is not None:
                raise ValueError("a frozen (static) decoding state cannot be regrouped.")
            if s.solve != first.solve or s._caches.keys() != first._caches.keys():
                raise ValueError(f"decoding states of different solves ({first.solve} and "
                                 f"{s.solve}) or caches cannot share one batch.")
        first._require("regroup", "regroup", "rows of different lengths cannot share its "
                       "batch (continuous batching)", "give the cache type a classmethod "
                       "regroup(parts, length) (continuumlm.mixers.cache.SeqCache has one)")
        device = _device([s for s, _ in parts])
        where = []  # per part: (index, keys of its rows, first real position)
        for s, index in parts:
            if index is None:
                index = torch.arange(s.batch_size, device=device)
            where.append((index, *s._rows(index, device)))
        length = max(s.pos - start for (s, _), (_, _, start) in zip(parts, where))
        rows = sum(int(index.shape[0]) for index, _, _ in where)
        out = cls(rows, first.rewind)
        out.pos, out.solve, out.shared = length, first.solve, first.shared
        keys = torch.zeros(rows, length, dtype=torch.bool, device=device)
        r = 0
        for (s, _), (_, k, start) in zip(parts, where):
            keys[r:r + k.shape[0], length - (s.pos - start):] = k[:, start:]
            r += k.shape[0]
        out.keys = None if bool(keys.all()) else keys
        for key, c in first._caches.items():
            out._caches[key] = type(c).regroup(
                [(s._caches[key], index, start, length - (s.pos - start))
                 for (s, _), (index, _, start) in zip(parts, where)], length)
            if isinstance(getattr(out._caches[key], "shared", None), dict):
                out._caches[key].shared = out.shared
        return out

    def put_rows(self, slots: list[int], other: DecodeState, rows: list[int]) -> None:
        """Write the rows ``rows`` of ``other`` over this state's rows ``slots``, each
        right-aligned (padded on the left), copying only those rows: how a request joins a
        running batch in a slot a finished one left (continuous batching). ``other``'s rows
        must hold no more real positions than this state has."""
        if self.static is not None or other.static is not None:
            raise ValueError("a frozen (static) decoding state cannot take rows.")
        if other.solve != self.solve or other._caches.keys() != self._caches.keys():
            raise ValueError(f"decoding states of different solves ({self.solve} and "
                             f"{other.solve}) or caches cannot share one batch.")
        device = _device([self])
        index = torch.tensor(rows, device=device)
        keys, start = other._rows(index, device)
        if other.pos - start > self.pos:
            raise ValueError(f"rows of {other.pos - start} positions do not fit a state of "
                             f"{self.pos}; regroup the two instead.")
        offset = self.pos - (other.pos - start)
        self._require("put_rows", "put_rows", "a row cannot join its batch in place",
                      "give the cache type put_rows(slots, other, index, start, offset)")
        for key, c in self._caches.items():
            c.put_rows(slots, other._caches[key], index, start, offset)
        if self.keys is None:
            self.keys = torch.ones(self.batch_size, self.pos, dtype=torch.bool, device=device)
        for slot, k in zip(slots, keys):
            self.keys[slot, :offset] = False
            self.keys[slot, offset:] = k[start:]
        if bool(self.keys.all()):
            self.keys = None

    def retire(self, slot: int) -> None:
        """Mark the row ``slot`` free: every position it holds becomes a pad, so it keeps no
        position from being dropped. A free row still takes part in each step until a new row
        takes its place (:meth:`put_rows`) or the state is regrouped without it; retire it
        again before each such step, and the token it is fed is its only real position (its
        attention reads that one: finite), whose output is not read."""
        if self.keys is None:
            self.keys = torch.ones(self.batch_size, self.pos, dtype=torch.bool,
                                   device=_device([self]))
        self.keys[slot] = False

    def _require(self, method: str, named: str, without: str, fix: str) -> None:
        """A NotImplementedError naming the first cache whose type has no ``method`` (a
        plugin's), what cannot be done without it, and how to give it one."""
        for key, c in self._caches.items():
            if not hasattr(c, method):
                raise NotImplementedError(
                    f"the decoding cache {type(c).__name__} (of {key!r}) has no {named}, so "
                    f"{without}; {fix}.")

    def _rows(self, index: torch.Tensor, device) -> tuple[torch.Tensor, int]:
        """(the padding mask of the rows ``index``, (rows, pos) bool, and their first real
        position: the positions before it are pads in every one of them)."""
        keys = self.keys if self.keys is not None else torch.ones(
            self.batch_size, self.pos, dtype=torch.bool, device=device)
        keys = keys.index_select(0, index.to(keys.device))
        real = keys.any(0)
        return keys, int(real.float().argmax()) if bool(real.any()) else self.pos

    def leading_pads(self) -> int:
        """How many of the first positions are pads in every row."""
        if self.keys is None:
            return 0
        return self._rows(torch.arange(self.batch_size, device=self.keys.device),
                          self.keys.device)[1]

    def check_solve(self, config) -> None:
        """Record the (ode_solver, ode_steps) that builds this state's caches, and refuse
        another: the caches are kept per solver stage, and another solver or step count
        (set_solver between calls) would read them at other times."""
        solve = (config.ode_solver, config.ode_steps) if config.depth == "ode" else None
        if self.pos and self.solve != solve:
            raise ValueError(f"this decoding state was built with ode_solver, ode_steps = "
                             f"{self.solve}, and the model now integrates with {solve}: start "
                             f"a new state (a new generation) after set_solver().")
        self.solve = solve

    def cache(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        if key not in self._caches:
            if self.static is not None:
                raise RuntimeError(f"a frozen decoding state has no cache for {key!r}; it "
                                   f"was frozen before that evaluation ever ran.")
            if factory is None:  # LanguageModel.check_cacheable names the mixer first
                raise ValueError(f"no decoding cache for {key!r}: its mixer has none "
                                 f"(cache_factory is None); decode with use_cache=False.")
            c = factory()
            if self.rewind and hasattr(c, "keep_rewind"):
                c.keep_rewind(self.rewind)
            if isinstance(getattr(c, "shared", None), dict):
                c.shared = self.shared
            self._caches[key] = c
        return self._caches[key]

    def share(self, other: DecodeState, keys: list[Hashable]) -> None:
        """Hold ``other``'s caches of ``keys`` (the same objects, not copies) and its
        position: a draft through a model's first layers (speculative decoding) writes the
        keys and values its verifier reads from those layers. The two states then move
        together: what one appends the other holds, and a cut of ``other`` cuts these; the
        caller sets ``pos`` after it."""
        if self._caches:
            raise ValueError("share(): this decoding state already holds caches of its own.")
        missing = [k for k in keys if k not in other._caches]
        if missing:
            raise ValueError(f"share(): the other state has no cache for {missing}; share "
                             f"after it consumed its first tokens.")
        self._caches = {k: other._caches[k] for k in keys}
        self.pos, self.solve = other.pos, other.solve

    def crop(self, length: int) -> None:
        """Cut the state back to its first ``length`` tokens, as if the later ones had never
        been consumed: what assisted and speculative decoding do with drafted tokens that were
        not accepted. Every cache is cut back, or none (a length some cache cannot reach is
        refused before any is changed). A frozen state is cut back in place (its caches and
        its position tensors keep their addresses, so compiled and recorded steps go on from
        the new position); its recurrent caches keep what their last ``rewind`` tokens
        need from the token it was frozen at on."""
        if isinstance(length, bool) or not 0 <= length <= self.pos:
            raise ValueError(f"cannot cut a decoding state of {self.pos} tokens back to "
                             f"{length!r}; give a length from 0 to {self.pos}.")
        if length == self.pos:
            return
        why = self.frozen_crop_refusal()
        if why is not None:
            raise ValueError(why)
        self._require("crop", "crop(length)", "it cannot be cut back (assisted or "
                      "speculative decoding)", "give the cache type a crop method "
                      "(continuumlm.mixers.cache.RewindLog keeps what a cache of fixed size "
                      "needs)")
        floor = max((c.rewind_floor() for c in self._caches.values()
                     if hasattr(c, "rewind_floor")), default=0)
        if length < floor:
            raise ValueError(
                f"this decoding state can be cut back to {floor} tokens at the earliest, not "
                f"{length}: its recurrent caches keep what their last {self.rewind} tokens "
                f"need; make it with init_state(batch, rewind=N) for a larger N.")
        for c in self._caches.values():
            c.crop(length)
        if self.keys is not None:
            self.keys = self.keys[:, :length]
        self.pos = length
        if self.static is not None:
            self.static.rewind(length)

    def frozen_crop_refusal(self) -> str | None:
        """Why this frozen state cannot be cut back (a cache whose frozen layout has no crop
        of its own, e.g. a plugin's written before frozen states were cut back), or None."""
        for key, c in self._caches.items():
            if isinstance(c, FrozenCache) and type(c).crop is FrozenCache.crop:
                return (f"a frozen (static) decoding cache of type {type(c).__name__} (of "
                        f"{key!r}) cannot be cut back; decode eagerly (without compile or CUDA "
                        f"graphs) to draft and rewind, or give the type a crop(length) that "
                        f"works in place (mixers.deltanet_cache.FrozenDeltaNetCache keeps a "
                        f"ring of its latest states for it)")
        return None

    def freeze(self, capacity: int, device: torch.device) -> None:
        """Switch to frozen one-token steps with room for ``capacity`` tokens in all: each
        cache is replaced by what its ``freeze(step)`` returns (its fixed-capacity layout;
        a cache type whose ``freeze`` returns None has frozen itself in place)."""
        if self.pos == 0:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        if self.keys is not None:
            raise ValueError("a decoding state that holds padded rows cannot be frozen for "
                             "one-token static steps; decode it eagerly.")
        self.static = StaticStep(capacity, self.pos, device)
        for key, c in self._caches.items():
            frozen = c.freeze(self.static)
            if frozen is not None:
                self._caches[key] = frozen

    def advance(self) -> None:
        """After a static step: move every cache (and the position) on by the step's tokens
        (one, or the static step's ``width``)."""
        n = self.static.width
        self.pos += n
        for c in self._caches.values():
            c.length += n
        self.static.advance(self.pos)

    def memory(self) -> CacheMemory:
        """What the caches hold for one batch row: bytes per token (caches that grow with
        the sequence) and fixed bytes (recurrent states), summed over the caches whose type
        tells (``nbytes()``); the rest are counted in ``unknown``."""
        per_token = fixed = unknown = 0
        for c in self._caches.values():
            if not hasattr(c, "nbytes"):
                unknown += 1
                continue
            t, f = c.nbytes()
            per_token, fixed = per_token + t, fixed + f
        return CacheMemory(per_token, fixed, len(self._caches), unknown)

    def __len__(self) -> int:
        return len(self._caches)


def _device(states: list[DecodeState]) -> torch.device:
    """Where the states' caches live (their first tensor's device; CPU for empty ones)."""
    for s in states:
        if s.keys is not None:
            return s.keys.device
        for c in s._caches.values():
            for t in [*(getattr(c, "buffers", None) or []), getattr(c, "state", None)]:
                if isinstance(t, torch.Tensor):
                    return t.device
    return torch.device("cpu")


@dataclass(frozen=True)
class CacheMemory:
    """The decoding caches of one sequence: ``per_token`` bytes for every token of context
    (keys and values, CAT's values), ``fixed`` bytes whatever the length (DeltaNet's states
    and convolution histories), in ``caches`` caches (``unknown`` of them a type that does not
    say its size, left out of the sums)."""

    per_token: int
    fixed: int
    caches: int
    unknown: int = 0

    def at(self, tokens: int) -> int:
        """Bytes for one sequence of ``tokens`` tokens."""
        return self.per_token * tokens + self.fixed

    def describe(self, blocks: int) -> str:
        parts = [f"{self.per_token:,} bytes per token ({self.per_token / blocks:,.0f} per token "
                 f"per block)"]
        if self.fixed:
            parts.append(f"{self.fixed:,} bytes fixed ({self.fixed / blocks:,.0f} per block)")
        text = (f"decoding cache: {', '.join(parts)} in {self.caches} "
                f"cache{'s' * (self.caches != 1)}")
        if self.unknown:
            text += f" ({self.unknown} of a type that does not tell its size, not counted)"
        return text

    def as_dict(self, blocks: int) -> dict:
        return {"bytes_per_token": self.per_token,
                "bytes_per_token_per_block": self.per_token / blocks,
                "fixed_bytes": self.fixed, "caches": self.caches, "unknown": self.unknown}
