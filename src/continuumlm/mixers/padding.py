"""Padded batches: which tokens of each row are real, and where each row's sequence starts.

Rows of different lengths share a batch by padding (left, as decoding does, or right, as
scoring does). A :class:`Padding` tells a mixer which positions are pads, so that a padded
row's outputs at its real positions equal the same sequence run alone:

- softmax attention masks pad keys, and rotary or learned positions count from each row's
  first real token (``positions``);
- DeltaNet writes nothing to its state at a pad (write strength 0) and feeds zeros to its
  short convolution there, so a row's state and convolution history are those of the row alone.

What a pad position itself outputs is unspecified (finite, never read by a real token).

A mixer that honours padding says so with the class attribute ``supports_padding = True`` and
takes ``forward(x, cache=None, padding=None)``; :func:`mix` hands it the padding only when
there is some, so a mixer (or field) without it keeps working on unpadded batches and refuses
a padded one by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import FrozenCache, Written


@dataclass
class Padding:
    """``keys`` (B, L) bool: which of every position so far is real (the cached tokens, then
    this call's T); ``positions`` (B, T) long: the position of each of this call's tokens
    counted from its row's first real token (what rotary and learned positions read)."""

    keys: torch.Tensor
    positions: torch.Tensor
    derived: bool = True  # the positions are counted from the mask (no position_ids given)

    @property
    def valid(self) -> torch.Tensor:
        """(B, T) bool: which of this call's tokens are real."""
        return self.keys[:, self.keys.shape[1] - self.positions.shape[1]:]

    @classmethod
    def from_mask(cls, keys: torch.Tensor, T: int,
                  positions: torch.Tensor | None = None) -> Padding:
        """From a (B, L) attention mask (1 real, 0 pad) over every position so far, the last T
        of them this call's; ``positions`` (B, T) when the caller gives its own."""
        keys = keys.bool()
        derived = positions is None
        if derived:
            positions = (keys.long().cumsum(1) - 1).clamp_min(0)[:, keys.shape[1] - T:]
        return cls(keys, positions.long(), derived)

    def require_one_stretch(self, who: str) -> None:
        """Refuse rows whose real tokens are not one stretch (a pad between two real tokens:
        a right-padded prompt decoded further), for a mixer that reads a row's recent inputs
        by index. Not checked inside a traced graph (no data-dependent branch there)."""
        if torch.compiler.is_compiling():
            return
        keys = self.keys.long()
        first = keys.argmax(1)
        last = keys.shape[1] - 1 - keys.flip(1).argmax(1)
        if bool((((last - first + 1) != keys.sum(1)) & self.keys.any(1)).any()):
            raise ValueError(f"{who} reads a padded row's tokens as one stretch: pad on the "
                             f"left or on the right, not in between (decode after a "
                             f"left-padded prompt, not a right-padded one).")

    def attention_mask(self, causal: bool) -> torch.Tensor:
        """(B, 1, T, L) bool for scaled-dot-product attention: real keys (and, in decoder mode,
        no later ones). A pad query also sees itself, so that no row of the softmax is empty
        (an empty row is NaN, and NaN times a zero weight is still NaN)."""
        B, L = self.keys.shape
        T = self.positions.shape[1]
        k = torch.arange(L, device=self.keys.device)
        q = torch.arange(L - T, L, device=self.keys.device)[:, None]
        allowed = self.keys[:, None, :] | (k[None, :] == q)[None]  # (B, T, L)
        if causal:
            allowed = allowed & (k[None, :] <= q)[None]
        return allowed[:, None]


def mix(module, x: torch.Tensor, cache, padding: Padding | None, *args):
    """``module(*args, x, cache)``, with ``padding=`` when there is padding: a mixer or field
    without ``supports_padding`` is refused then, by name, instead of reading the pads.

    A mixer that states its decoding is called through it when there is a cache:
    ``extend_frozen(x, cache)`` for a cache in the frozen layout (:class:`FrozenCache`: one
    token, fixed capacity), ``extend(x, cache[, padding=])`` for any other (k >= 1 tokens).
    Without a cache, such a mixer gets ``forward(x)``. A mixer without them (a plugin's,
    written before them) gets ``forward(x, cache)``, whatever the cache's layout."""
    if isinstance(cache, Written) and not args:
        reader = _memory_method(module, "read")
        if padding is None:
            return reader(x, cache.cache)
        _check_padding(module)
        return reader(x, cache.cache, padding=padding)
    if cache is not None and not args:
        if isinstance(cache, FrozenCache) and hasattr(module, "extend_frozen"):
            if padding is not None:
                raise ValueError("a frozen (static) decoding state does not take padding.")
            return module.extend_frozen(x, cache)
        if hasattr(module, "extend"):
            if padding is None:
                return module.extend(x, cache)
            _check_padding(module)
            return module.extend(x, cache, padding=padding)
    # no cache: a mixer that states its decoding takes forward(x[, padding=]) alone
    call = (*args, x) if cache is None and hasattr(module, "extend") else (*args, x, cache)
    if padding is None:
        return module(*call)
    _check_padding(module)
    return module(*call, padding=padding)


def remember(module, m: torch.Tensor, cache, padding: Padding | None = None) -> None:
    """``module.write(m, cache[, padding=])``: put the memory of the call's tokens, computed
    from ``m`` (the mixer input at the start of a solver step or block), into ``cache``, for
    every evaluation of that step or block to :meth:`read <mix>` (``model.ode_kv``)."""
    writer = _memory_method(module, "write")
    if padding is None:
        writer(m, cache)
    else:
        _check_padding(module)
        writer(m, cache, padding=padding)


def takes_memory(mixer) -> bool:
    """Whether a mixer (an instance or class) reads its memory from a separate input: it
    declares ``write(m, cache)`` and ``read(x, cache)`` (``model.ode_kv``)."""
    return callable(getattr(mixer, "write", None)) and callable(getattr(mixer, "read", None))


def _memory_method(module, name: str):
    if not takes_memory(module):
        raise ValueError(
            f"the mixer {type(module).__name__} has no write(m, cache) and read(x, cache), so "
            f"its memory cannot come from the start of a solver step or block "
            f"(model.ode_kv = 'step' or 'block'); use ode_kv = 'evaluation', or give the "
            f"mixer those two methods.")
    return getattr(module, name)


def _check_padding(module) -> None:
    owner = getattr(module, "__self__", module)  # a bound method (field.write): its object
    if not getattr(owner, "supports_padding", False):
        raise ValueError(
            f"{type(owner).__name__} does not support padded batches (it has no "
            f"supports_padding = True): it would read the pad tokens. Score or generate the "
            f"sequences one at a time, or batch sequences of one length.")
