"""DeltaNet's decoding caches: the eager one (a state, the short convolution's history, a
rewind log for cutting back), the frozen one (fixed addresses, and a ring of the latest
states for cutting back in place), and the memory a write leaves for its reads
(``model.ode_kv``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import FrozenCache, RewindLog, fixed_bytes
from .delta_rule import delta_rule_state


@dataclass
class DeltaMemory:
    """What :meth:`DeltaNetAttention.write` leaves for the reads of one solver step or block:
    the written tokens' keys, values and write strengths, the state before them (None: zeros,
    or for a single token already advanced past it), and the q convolution's inputs (its
    history, then the memory's q projections) when there is a short convolution."""

    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    start: torch.Tensor | None
    q_window: torch.Tensor | None
    pending: bool = False  # the cache's state is still the start state (set by the first read)


class DeltaNetCache:
    """Decoding state of one DeltaNet evaluation: the matrix state S and the short-convolution
    history. Its size does not grow with the number of tokens.

    Cutting back (:meth:`crop`): with ``keep_rewind(tokens)`` (``init_state(rewind=N)``), the
    state and history each of the latest extensions started from, and the keys, values, write
    strengths and convolution inputs it consumed, are kept for its last ``tokens`` tokens; the
    state at an earlier length is rebuilt from there by the token recurrence."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        self.conv: dict[str, torch.Tensor] = {}
        self.length = 0
        self.log = RewindLog()
        # what the mixer keeps while it decodes (its stacked projection weights:
        # nn.stacked_linear); a decoding state gives all its caches its own one
        self.shared: dict = {}
        # the latest write of a memory input (model.ode_kv = "step" or "block"): what every
        # read of that step or block runs the delta rule over (DeltaNetAttention.write)
        self.memory: DeltaMemory | None = None

    def keep_rewind(self, tokens: int) -> None:
        self.log = RewindLog(tokens)

    def nbytes(self) -> tuple[int, int]:
        """(bytes per token, fixed bytes) of one batch row: the state and the convolution
        history, whatever the length (the rewind log aside)."""
        self.settle()
        return 0, fixed_bytes(self.state, *self.conv.values())

    def settle(self) -> None:
        """Bring ``state`` up to the latest written tokens when no read has yet (a memory
        write of several tokens leaves that to the first read's kernel, which computes it)."""
        mem = self.memory
        if mem is not None and mem.pending:
            self.state = delta_rule_state(mem.k, mem.v, mem.beta, mem.start)
            mem.pending = False

    def release_memory(self) -> None:
        """Let go of the latest write's tokens once every read of its step or block is done
        (the ODE block calls this after its solve): the state takes them in, so the cache
        holds the state and history alone, whatever the prompt's length."""
        self.settle()
        self.memory = None

    def start(self):
        """The state an extension starts from (for :meth:`record`), taken before it changes."""
        self.settle()
        return (self.state, dict(self.conv)) if self.log.tokens else None

    def record(self, T: int, start, inputs: dict) -> None:
        """An extension of ``T`` tokens from ``start`` consumed ``inputs`` (for crop)."""
        if start is not None:
            self.log.add(self.length, T, start, inputs)

    def rewind_floor(self) -> int:
        return self.log.floor(self.length)

    def crop(self, length: int) -> None:
        """Cut back to the first ``length`` tokens (at least :meth:`rewind_floor`)."""
        self.settle()
        self.memory = None
        if length == self.length:
            return
        (state, conv), inputs = self.log.cut(length)
        conv = dict(conv)  # the log's own dict stays as it was: a later cut may start there
        if inputs["k"].shape[2]:
            state = delta_rule_state(inputs["k"], inputs["v"], inputs["beta"], state)
        for name in [n for n in inputs if n.startswith("conv_")]:
            x, hist = inputs[name], conv.get(name[5:])
            if hist is None:  # the extension started the sequence: zeros before it
                hist = x.new_zeros(x.shape[0], self.conv[name[5:]].shape[1], x.shape[2])
            conv[name[5:]] = torch.cat([hist, x], dim=1)[:, x.shape[1]:].clone()
        self.state, self.conv, self.length = state, conv, length

    def freeze(self, step) -> FrozenDeltaNetCache:
        self.settle()
        if self.state is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        frozen = FrozenDeltaNetCache(self.state, self.conv, self.length, step, self.log.tokens)
        frozen.shared = self.shared
        return frozen

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` in that order (beam search)."""
        self.settle()
        self.memory = None
        if self.state is not None:
            self.state = self.state.index_select(0, index.to(self.state.device))
        self.conv = {n: h.index_select(0, index.to(h.device)) for n, h in self.conv.items()}
        self.log = RewindLog(self.log.tokens)  # its rows are the old ones: cut back no further

    @classmethod
    def regroup(cls, parts: list[tuple[DeltaNetCache, torch.Tensor, int, int]],
                length: int) -> DeltaNetCache:
        """One cache holding, part after part, the rows ``index`` of each part's cache
        (``DecodeState.regroup``). A pad writes nothing to the state and feeds zeros to the
        short convolution, so positions dropped or padded in front change only the length."""
        for c, *_ in parts:
            c.settle()
        out = cls()
        out.length = length
        out.log = RewindLog(parts[0][0].log.tokens)  # its positions are the old ones

        def rows(t, index):
            return t.index_select(0, index.to(t.device))
        if parts[0][0].state is not None:
            out.state = torch.cat([rows(c.state, i) for c, i, _, _ in parts])
        out.conv = {n: torch.cat([rows(c.conv[n], i) for c, i, _, _ in parts])
                    for n in parts[0][0].conv}
        return out

    def put_rows(self, slots: list[int], other: DeltaNetCache, index: torch.Tensor,
                 start: int, offset: int) -> None:
        """Write ``other``'s rows ``index`` over the rows ``slots`` (``DecodeState.put_rows``):
        the state and the convolution history; the positions do not matter here."""
        self.settle()
        other.settle()
        self.memory = None
        at = torch.tensor(slots, device=index.device)
        if self.state is not None:
            self.state[at] = other.state.index_select(0, index.to(other.state.device))
        for n, h in self.conv.items():
            h[at] = other.conv[n].index_select(0, index.to(h.device))

    def update(self, state: torch.Tensor, T: int) -> None:
        self.state, self.length = state, self.length + T

    def update_conv(self, name: str, history: torch.Tensor) -> None:
        # its own storage: a view would keep the whole prompt's activations alive
        self.conv[name] = history.clone()


class FrozenDeltaNetCache(FrozenCache):
    """A :class:`DeltaNetCache` for frozen one-token steps: the state and convolution history
    are updated in place (fixed shapes and addresses).

    Cutting back (``rewind`` tokens, from the eager cache's ``keep_rewind``): the state and
    history after each of the latest ``rewind`` tokens are also copied into a ring of
    ``rewind + 1`` slots, indexed by the position tensor (the token at position p writes slot
    p mod slots), so a compiled or recorded step keeps them as it goes; a cut copies the slot
    of its length back. No ring for 0 (the default): nothing is kept, and the cache cannot be
    cut back."""

    def __init__(self, state: torch.Tensor, conv: dict[str, torch.Tensor], length: int,
                 step, rewind: int = 0) -> None:
        self.state = state
        self.conv = {n: h.clone() for n, h in conv.items()}  # own storage, updated in place
        self.length, self.static = length, step
        self.shared: dict = {}
        self.memory: DeltaMemory | None = None
        self.rewind, self.frozen_at = rewind, length
        self.ring: dict[str, torch.Tensor] = {}
        if rewind:
            slots, here = rewind + 1, (length - 1) % (rewind + 1)
            for name, t in (("state", state), *((f"conv_{n}", h) for n, h in self.conv.items())):
                ring = t.new_zeros(slots, *t.shape)
                ring[here] = t  # the state the cache was frozen at: a cut may go back to it
                self.ring[name] = ring

    def freeze(self, step) -> FrozenDeltaNetCache:
        self.static = step  # no buffer grows with the capacity
        return self

    def nbytes(self) -> tuple[int, int]:
        return 0, fixed_bytes(self.state, *self.conv.values())

    def start(self):
        return None

    def settle(self) -> None:
        pass  # one token at a time: its write updates the state

    def record(self, T: int, start, inputs: dict) -> None:
        pass

    def _keep(self, name: str, per_token: torch.Tensor) -> None:
        """``per_token`` (width, ...): what follows each of the step's tokens, into slots pos
        mod slots (read from the position tensor)."""
        ring = self.ring.get(name)
        if ring is not None:
            ring.index_copy_(0, torch.remainder(self.static.pos, ring.shape[0]), per_token)

    def update(self, state: torch.Tensor, T: int) -> None:
        if T > 1 and self.ring:
            raise RuntimeError("a frozen DeltaNet cache that keeps states for cutting back is "
                               "extended by several tokens with update_tokens (every state).")
        self.state.copy_(state)
        self._keep("state", self.state[None])

    def update_tokens(self, states: torch.Tensor) -> None:
        """The states after each of the step's tokens (B, H, T, Dv, Dk): the last is the
        cache's, each kept in the ring."""
        self.state.copy_(states[:, :, -1])
        self._keep("state", states.movedim(2, 0))

    def update_conv(self, name: str, history: torch.Tensor, window: torch.Tensor | None = None
                    ) -> None:
        """The history after the step; ``window`` (B, K - 1 + T, C): the history before it
        followed by the step's T inputs, from which the ring keeps the history after each."""
        self.conv[name].copy_(history)
        if self.ring:
            if window is None:  # one token: the history after it
                self._keep(f"conv_{name}", self.conv[name][None])
            else:  # the K - 1 inputs up to each token: windows 1..T of the joined sequence
                per_token = window.unfold(1, history.shape[1], 1)[:, 1:]  # (B, T, C, K - 1)
                self._keep(f"conv_{name}", per_token.permute(1, 0, 3, 2))

    def rewind_floor(self) -> int:
        return max(self.frozen_at, self.length - self.rewind) if self.rewind else self.length

    def crop(self, length: int) -> None:
        """Cut back to the first ``length`` tokens (at least :meth:`rewind_floor`): the state
        and history after token ``length - 1`` copied back from the ring, in place."""
        if not self.rewind_floor() <= length <= self.length:
            raise ValueError(f"this frozen DeltaNet cache of {self.length} tokens can be cut "
                             f"back to {self.rewind_floor()} at the earliest, not {length}: it "
                             f"keeps its last {self.rewind} tokens' states; make the state with "
                             f"init_state(batch, rewind=N) for a larger N.")
        self.memory = None
        if length == self.length:
            return
        slot = (length - 1) % (self.rewind + 1)
        self.state.copy_(self.ring["state"][slot])
        for name, h in self.conv.items():
            h.copy_(self.ring[f"conv_{name}"][slot])
        self.length = length
