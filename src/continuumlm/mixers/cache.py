"""Decoding caches of the built-in mixers, and the static one-token position they share.

A cache belongs to one mixer evaluation; the model's :class:`~continuumlm.model.cache.DecodeState`
keys them by where the evaluation sits in the network. These types sit below the model so that
a mixer (built-in or a plugin's) picks its cache without importing the model.

Cutting back (``crop(length)``: assisted and speculative decoding drop the drafted tokens that
were not accepted): a cache that grows with the sequence (:class:`SeqCache`) is cut back to any
earlier length by its length alone; a cache of fixed size (a recurrent state) keeps a
:class:`RewindLog` of its latest extensions and rebuilds its state from there.

Two layouts, two ways for a mixer to extend its cache:

- the ordinary (eager) cache, by any number k >= 1 of tokens at a time (``mixer.extend(x,
  cache)``; k = 1 is a decoded token, k > 1 a prompt or a block of drafted tokens verified in
  one pass): storage grows on demand and mixers read the position from Python integers;
- the frozen cache (:class:`FrozenCache`, made by the cache's ``freeze(step)``), one token at a
  time (``mixer.extend_frozen(x, cache)``): every buffer has a fixed capacity and the position
  lives in tensors (:class:`StaticStep`). Nothing a step reads then changes its shape or a
  Python value, so one ``torch.compile`` graph serves every token.
"""

from __future__ import annotations

from collections import deque

import torch


class StaticStep:
    """The positions of the next tokens as tensors, shared by every cache of a frozen state.

    A frozen step consumes ``width`` tokens (1 when decoding; the drafted block that a
    speculative round verifies in one pass): ``pos`` is a (width,) long tensor of their
    positions, ``mask`` a (width, capacity) bool tensor, row i True for the positions <=
    pos[i] (what token i may attend to). Both change in place; each width has tensors of its
    own, kept for the state's life (:meth:`set_width` switches between them), so a compiled
    or recorded step of one width always reads the same tensors.
    """

    def __init__(self, capacity: int, pos: int, device: torch.device, width: int = 1) -> None:
        if pos + width > capacity:
            raise ValueError(f"a static decoding state of capacity {capacity} has no room for "
                             f"{width} token(s) at position {pos}.")
        self.capacity, self.device, self.at = capacity, device, pos
        self._arange = torch.arange(capacity, device=device)
        self._widths: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.set_width(width)

    def set_width(self, width: int) -> None:
        """Make the next step consume ``width`` tokens from the current position."""
        if self.at + width > self.capacity:
            raise ValueError(f"a static decoding state of capacity {self.capacity} has no room "
                             f"for {width} token(s) at position {self.at}.")
        if width not in self._widths:
            mask = torch.zeros(width, self.capacity, dtype=torch.bool, device=self.device)
            # the capacity is symbolic in a compiled step from the first graph on: one graph
            # for every size the buffers grow to, not a static one first and a recompile at
            # the first doubling
            torch._dynamo.maybe_mark_dynamic(mask, 1)
            self._widths[width] = (torch.zeros(width, dtype=torch.long, device=self.device),
                                   mask)
        self.width = width
        self.pos, self.mask = self._widths[width]
        self._fill()

    def _fill(self) -> None:
        self.pos.copy_(torch.arange(self.at, self.at + self.width, device=self.device))
        torch.le(self._arange[None, :], self.pos[:, None], out=self.mask)

    def advance(self, new_pos: int) -> None:
        """Move on by the step's ``width`` tokens to ``new_pos`` (the caller's integer copy, so
        a one-token step needs no device sync)."""
        self.at = new_pos
        self.pos += self.width
        if self.width == 1:
            if new_pos < self.capacity:
                self.mask.index_fill_(1, self.pos, True)
        elif new_pos + self.width <= self.capacity:
            torch.le(self._arange[None, :], self.pos[:, None], out=self.mask)

    def rewind(self, pos: int) -> None:
        """Move back to ``pos`` (a frozen state cut back), in place: the tensors keep their
        addresses, so a compiled or recorded step reads the new position as it read the old."""
        if not 0 <= pos < self.capacity:
            raise ValueError(f"a static decoding state of capacity {self.capacity} cannot "
                             f"move to position {pos}.")
        self.at = pos
        self._fill()


_NOT_KEPT = object()  # an entry of a RewindLog whose start state is rebuilt when needed


class RewindLog:
    """What a cache of fixed size (a recurrent state, a convolution's history) needs to be cut
    back by up to ``tokens`` of its latest tokens: the inputs each extension consumed, and the
    state it started from for one extension in every ``stride`` tokens (references to tensors
    made anyway, no copies; 0 tokens: nothing is kept, and the cache cannot be cut back). A
    cut rebuilds the state from the latest kept state at or before it over the inputs since
    (at most ``stride`` tokens and a block). The state is the cache's own object; an input is
    a (tensor, time dimension) pair, so that the log can cut and join them. An extension
    longer than ``tokens`` (a long prompt) is not kept: the cache can be cut back to where it
    ended, not inside it."""

    def __init__(self, tokens: int = 0, stride: int = 16) -> None:
        self.tokens, self.stride = tokens, stride
        # contiguous extensions [start, T, state or _NOT_KEPT, inputs]; the first has a state.
        # Adding is O(1) (a decoded token adds one entry per cache): the starts of the entries
        # that keep a state are tracked apart, and old entries leave from the left.
        self.entries: deque[list] = deque()
        self._kept: deque[int] = deque()

    def add(self, start: int, T: int, state, inputs: dict) -> None:
        if T > self.tokens:
            self.entries.clear()
            self._kept.clear()
            return
        if self._kept and start - self._kept[-1] < self.stride:
            state = _NOT_KEPT
        else:
            self._kept.append(start)
        self.entries.append([start, T, state, inputs])
        # drop the oldest stretch (a kept state and the entries that lean on it) while what
        # is left still reaches ``tokens`` back
        while len(self._kept) > 1 and start + T - self._kept[1] >= self.tokens:
            self._kept.popleft()
            while self.entries[0][0] < self._kept[0]:
                self.entries.popleft()

    def floor(self, length: int) -> int:
        """The earliest length the cache, now at ``length``, can be cut back to."""
        return self.entries[0][0] if self.entries else length

    def cut(self, length: int) -> tuple[object, dict]:
        """Forget everything after ``length`` (at least :meth:`floor`): returns the latest kept
        state at or before ``length`` and the inputs from there to ``length`` (joined along
        time), from which the cache rebuilds its state."""
        if not self.entries or length < self.entries[0][0]:
            raise ValueError(f"cannot cut back to {length} tokens: this cache keeps what its "
                             f"last {self.tokens} tokens need (earliest "
                             f"{self.floor(length)}).")
        entries = list(self.entries)
        j = max(i for i, e in enumerate(entries) if e[0] <= length)
        b = max(i for i in range(j + 1) if entries[i][2] is not _NOT_KEPT)
        start, _, state, inputs = entries[j]
        n = length - start
        head = {k: (x.narrow(d, 0, n), d) for k, (x, d) in inputs.items()}
        parts = [e[3] for e in entries[b:j]] + [head]
        joined = {k: torch.cat([p[k][0] for p in parts], dim=d) for k, (_, d) in head.items()}
        base = entries[b][2]
        self.entries = deque(entries[:j])
        if n:
            self.entries.append([start, n, state, head])
        self._kept = deque(e[0] for e in self.entries if e[2] is not _NOT_KEPT)
        return base, joined


class Written:
    """A cache that already holds the memory of the call's tokens (``model.ode_kv = "step"``
    or ``"block"``: the mixer's ``write(m, cache)`` put it there at the start of the solver
    step or block). :func:`~continuumlm.mixers.padding.mix` hands the cache inside to the
    mixer's ``read(x, cache)``, which reads it with queries from ``x`` and writes nothing."""

    __slots__ = ("cache",)

    def __init__(self, cache) -> None:
        self.cache = cache


class FrozenCache:
    """The fixed-capacity layout of a cache, made by its ``freeze(step)``: what a mixer's
    ``extend_frozen(x, cache)`` decodes one token through. Every buffer keeps its address
    and the position is the shared :class:`StaticStep`'s tensor, so nothing a step reads
    changes shape or Python value between tokens. A frozen cache is not reordered (a frozen
    state refuses before any cache is asked). Cutting back (``crop``: speculative decoding
    through compiled or recorded steps) works in place, within the addresses a step reads;
    a frozen cache type that cannot says so here."""

    static: StaticStep
    length: int

    def rewind_floor(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        raise ValueError(f"a frozen (static) decoding cache of type {type(self).__name__} "
                         f"cannot be cut back; decode eagerly (without compile or CUDA graphs) "
                         f"to draft and rewind.")

    def reorder(self, index: torch.Tensor) -> None:
        raise ValueError("a frozen (static) decoding cache cannot be reordered.")


def _regrown(buffers: list[torch.Tensor], length: int, capacity: int) -> list[torch.Tensor]:
    """New buffers of ``capacity`` positions holding the first ``length`` of ``buffers``;
    zeros after them, not empty memory: a frozen step multiplies the masked tail by zero
    weights, and 0 * (uninitialized NaN) would be NaN."""
    new = [b.new_zeros(*b.shape[:-2], capacity, b.shape[-1]) for b in buffers]
    for n, b in zip(new, buffers):
        n[..., :length, :] = b[..., :length, :]
    return new


def _per_token_bytes(buffers) -> int:
    """Bytes one token of one batch row takes in (B, ..., capacity, D) buffers."""
    if not buffers:
        return 0
    return sum(b.numel() // (b.shape[0] * b.shape[-2]) * b.element_size() for b in buffers)


def fixed_bytes(*tensors) -> int:
    """Bytes one batch row takes in batch-first tensors (None skipped)."""
    return sum(t.numel() // t.shape[0] * t.element_size() for t in tensors if t is not None)


class SeqCache:
    """Per-token tensors of one mixer evaluation, (B, H, T, D) each, along dimension 2.

    Storage grows by doubling, so appending one token is amortized O(1) copies.
    :meth:`freeze` gives the fixed-capacity layout (:class:`FrozenSeqCache`).
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] | None = None
        self.length = 0

    def append(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Add (B, H, t, D) tensors; return views of everything so far."""
        t = xs[0].shape[-2]
        needed = self.length + t
        if self.buffers is None:
            self.buffers = [x.new_zeros(*x.shape[:-2], max(needed, 16), x.shape[-1])
                            for x in xs]
        elif needed > self.buffers[0].shape[-2]:
            self.buffers = _regrown(self.buffers, self.length,
                                    max(needed, 2 * self.buffers[0].shape[-2]))
        for buf, x in zip(self.buffers, xs):
            buf[..., self.length:needed, :] = x
        self.length = needed
        return tuple(buf[..., :needed, :] for buf in self.buffers)

    def nbytes(self) -> tuple[int, int]:
        """(bytes per token, fixed bytes) that one batch row of this cache holds."""
        return _per_token_bytes(self.buffers), 0

    def contents(self) -> tuple[torch.Tensor, ...]:
        """Views of every token's tensors so far (what the last :meth:`append` returned)."""
        if self.buffers is None:
            raise RuntimeError("this cache holds no tokens yet: write before reading it.")
        return tuple(buf[..., :self.length, :] for buf in self.buffers)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (B',) in that order: beam search's reordering and
        expansion, an index on the batch dimension."""
        if self.buffers is not None:
            self.buffers = [b.index_select(0, index.to(b.device)) for b in self.buffers]

    @classmethod
    def regroup(cls, parts: list[tuple[SeqCache, torch.Tensor, int, int]],
                length: int) -> SeqCache:
        """One cache of ``length`` positions holding, part after part, the rows ``index`` of
        each part's cache from its position ``start`` on, put at position ``offset`` (the
        positions before it are pads: zeros): how ``DecodeState.regroup`` moves rows between
        batches in one copy. Room is left for more tokens, so the next append does not
        copy again."""
        out = cls()
        out.length = length
        first = next((c for c, *_ in parts if c.buffers is not None), None)
        if first is None:
            return out
        rows = sum(int(index.shape[0]) for _, index, _, _ in parts)
        capacity = max(16, length + max(16, length // 2))
        # zeros, not empty memory, at the pads and past ``length``: a masked key's weight is
        # zero, and 0 * NaN would be NaN (a frozen step reads the whole capacity)
        out.buffers = [b.new_zeros(rows, *b.shape[1:-2], capacity, b.shape[-1])
                       for b in first.buffers]
        r = 0
        for c, index, start, offset in parts:
            k = int(index.shape[0])
            every = k == c.buffers[0].shape[0] and bool(
                (index.cpu() == torch.arange(k)).all())
            for new, old in zip(out.buffers, c.buffers):
                window = old[..., start:c.length, :]  # only the positions kept are copied
                if not every:
                    window = window.index_select(0, index.to(old.device))
                new[r:r + k, ..., offset:length, :].copy_(window)
            r += k
        return out

    def put_rows(self, slots: list[int], other: SeqCache, index: torch.Tensor, start: int,
                 offset: int) -> None:
        """Write ``other``'s rows ``index`` (its positions from ``start`` on) over the rows
        ``slots``, from position ``offset`` on; zeros before it (``DecodeState.put_rows``)."""
        if other.buffers is None:
            return
        src = [b[..., start:other.length, :].index_select(0, index.to(b.device))
               for b in other.buffers]
        for buf, x in zip(self.buffers, src):
            for i, slot in enumerate(slots):
                buf[slot, ..., :offset, :] = 0
                buf[slot, ..., offset:self.length, :] = x[i]

    def rewind_floor(self) -> int:
        return 0  # every token's entries are kept

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens (later ones are overwritten by the next append)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot cut a cache of {self.length} tokens back to {length}.")
        self.length = length

    def freeze(self, step: StaticStep) -> FrozenSeqCache:
        if self.buffers is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        return FrozenSeqCache(self.buffers, self.length, step)


class FrozenSeqCache(FrozenCache):
    """A :class:`SeqCache` at a fixed capacity: :meth:`write` puts one token at the tensor
    position of the shared :class:`StaticStep` and returns the whole buffers."""

    def __init__(self, buffers: list[torch.Tensor], length: int, step: StaticStep) -> None:
        if buffers[0].shape[-2] != step.capacity:
            buffers = _regrown(buffers, length, step.capacity)
        for b in buffers:
            torch._dynamo.maybe_mark_dynamic(b, b.dim() - 2)  # as StaticStep.mask
        self.buffers, self.length, self.static = buffers, length, step

    def nbytes(self) -> tuple[int, int]:
        return _per_token_bytes(self.buffers), 0

    def freeze(self, step: StaticStep) -> FrozenSeqCache:
        """The same tokens at another capacity (a frozen state refrozen larger)."""
        return FrozenSeqCache(self.buffers, self.length, step)

    def rewind_floor(self) -> int:
        return 0  # every token's entries are kept

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens: the positions after them are masked from the
        next step on (the state's :meth:`StaticStep.rewind`) and overwritten as it goes."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot cut a cache of {self.length} tokens back to {length}.")
        self.length = length

    def write(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store one token's (B, H, 1, D) tensors at ``static.pos``; return the whole
        fixed-capacity buffers (positions past ``pos`` hold zeros: mask them)."""
        for buf, x in zip(self.buffers, xs):
            buf[..., self.static.pos, :] = x  # index_put_: updated in place inside a graph
        return tuple(self.buffers)


class KVCache(SeqCache):
    """Keys and values of one attention evaluation (``append(k, v)``; frozen, the
    :class:`FrozenSeqCache` that ``freeze`` returns: ``write(k, v)``)."""
