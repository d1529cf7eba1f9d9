"""An example ContinuumLM plugin: one token mixer and one ODE solver from outside the package.

    continuumlm train --plugin continuumlm_example_plugin --config configs/... \
        --set model.mixer=causal_conv --set model.causal_conv.kernel=4 \
        --set model.ode_solver=ralston

Importing the module registers both components; a run trained with ``--plugin`` saves the
module in ``model.plugins``, so ``eval`` and ``generate`` find them without the flag. Installed
with its ``pyproject.toml``, the ``continuumlm.plugins`` entry point loads it for every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

import continuumlm
from continuumlm.config import setting
from continuumlm.mixers.cache import FrozenCache, RewindLog
from continuumlm.ode.solvers import FixedGridSolver, Tableau

__all__ = ["CausalConvMixer", "ConvCache", "FrozenConvCache", "RALSTON"]


class ConvCache:
    """Decoding state of one CausalConvMixer evaluation: its last ``kernel - 1`` inputs. The
    size does not grow with the sequence. ``freeze(step)`` follows the cache protocol of
    ``continuumlm.mixers.cache``: it returns the frozen layout (:class:`FrozenConvCache`),
    whose history is updated in place (fixed shapes, so a compiled one-token step serves
    every token)."""

    def __init__(self) -> None:
        self.history: torch.Tensor | None = None
        self.length = 0
        # cutting back (assisted and speculative decoding): the history each of the latest
        # extensions started from and the inputs it consumed (DecodeState(rewind=N) asks)
        self.log = RewindLog()

    def freeze(self, step) -> FrozenConvCache:
        if self.history is None:
            raise RuntimeError("freeze a decoding state after the prompt has been consumed.")
        return FrozenConvCache(self.history.clone(), self.length, step)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` in that order (beam search reorders its beams)."""
        if self.history is not None:
            self.history = self.history.index_select(0, index)
        self.log = RewindLog(self.log.tokens)  # its rows are the old ones: cut back no further

    def keep_rewind(self, tokens: int) -> None:
        self.log = RewindLog(tokens)

    def rewind_floor(self) -> int:
        return self.log.floor(self.length)

    def crop(self, length: int) -> None:
        if length == self.length:
            return
        history, inputs = self.log.cut(length)
        x = inputs["x"]
        if history is None:  # the extension started the sequence
            history = x.new_zeros(x.shape[0], self.history.shape[1], x.shape[2])
        self.history = torch.cat([history, x], dim=1)[:, x.shape[1]:].clone()
        self.length = length

    def update(self, history: torch.Tensor, T: int, x: torch.Tensor) -> None:
        """After an extension by ``x`` (B, T, C): the last inputs are ``history``."""
        if self.log.tokens:
            self.log.add(self.length, T, self.history, {"x": (x, 1)})
        self.history, self.length = history.clone(), self.length + T


class FrozenConvCache(FrozenCache):
    """A :class:`ConvCache` for frozen one-token steps: the history updated in place."""

    def __init__(self, history: torch.Tensor, length: int, step) -> None:
        self.history, self.length, self.static = history, length, step

    def freeze(self, step) -> FrozenConvCache:
        self.static = step  # nothing grows with the capacity
        return self

    def update(self, history: torch.Tensor, T: int, x: torch.Tensor) -> None:
        self.history.copy_(history)


@continuumlm.register_mixer("causal_conv")
class CausalConvMixer(nn.Module):
    """A gated causal depthwise convolution over the last ``kernel`` positions: each channel
    mixes its own recent past, y_t = W_o (sigmoid(g_t) * sum_j w_j x_{t-j}). Cheap and
    exactly causal; the kind of local mixer a hybrid model puts beside attention."""

    @dataclass
    class Config:
        kernel: int = setting(3, gt=0, le=64)
        """Positions each output reads (the current one and kernel - 1 before it)."""

    cache_factory = ConvCache

    def __init__(self, cfg):
        super().__init__()
        settings = cfg.component("causal_conv")
        C, self.kernel = cfg.hidden_size, settings.kernel
        self.weight = nn.Parameter(torch.zeros(C, self.kernel))
        with torch.no_grad():
            self.weight[:, -1] = 1.0  # starts as the identity on the current token
        self.gate = nn.Linear(C, C, bias=cfg.bias)
        self.out = nn.Linear(C, C, bias=cfg.bias)
        if cfg.mode != "decoder":
            raise ValueError("the causal_conv mixer reads only the past: use it with "
                             "model.mode = 'decoder'.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence x (B, T, C)."""
        return self.extend(x, None)

    def extend(self, x: torch.Tensor, cache: ConvCache | None) -> torch.Tensor:
        """Extend the cache by x's k >= 1 tokens (a prompt, a token, drafted tokens)."""
        B, T, C = x.shape
        K = self.kernel
        history = cache.history if cache is not None and cache.history is not None else \
            x.new_zeros(B, K - 1, C)
        xx = torch.cat([history, x], dim=1)  # (B, K - 1 + T, C)
        y = sum(xx[:, j:j + T] * self.weight[:, j] for j in range(K))
        if cache is not None:
            cache.update(xx[:, xx.shape[1] - (K - 1):], T, x)
        return self.out(torch.sigmoid(self.gate(x)) * y)

    def extend_frozen(self, x: torch.Tensor, cache: FrozenConvCache) -> torch.Tensor:
        """One token through the frozen layout: the same work, the history written in place."""
        return self.extend(x, cache)


# Ralston's second-order method: the two-stage explicit Runge-Kutta method of least error
# bound among them (stages at 0 and 2/3, weights 1/4 and 3/4).
RALSTON = Tableau("ralston", ((), (2 / 3,)), (1 / 4, 3 / 4), (0.0, 2 / 3), 2)


@continuumlm.register_solver("ralston")
class RalstonSolver(FixedGridSolver):
    def __init__(self, cfg):
        super().__init__(cfg, tableau=RALSTON)
