"""[train.layer_skip]: training a discrete stack so that its first layers draft for it
(LayerSkipConfig, implemented by ``train/layer_skip.LayerSkip``). Two terms, as LayerSkip
trains for early exit and self-speculative decoding:

- layer dropout rising with depth: in training, each sequence of a batch skips layer l (of L,
  counted from 0) with probability ``dropout * l / (L - 1)``; the first layer is always run,
  the last skipped at ``dropout``. A skipped layer passes its input on unchanged.
- an early-exit loss through the shared head: the output of each exit layer goes through the
  model's own final norm and head, and its cross-entropy against the data is added, the exits
  weighted by their depth (deeper exits weigh more) and summing to ``exit_weight``.

Optionally a third, ``exit_kl``: each exit is also taught the whole stack's own next-token
distribution (a KL term, no gradient through the stack's side), which is what speculative
sampling's acceptance reads (a draft is kept with probability 1 - the total variation between
the two distributions), where the exit loss teaches the data's.

A model trained so keeps its architecture and checkpoints: the terms are training-time only,
and ``generate --draft-layers N`` (``Draft(layers=N)``) drafts through the same norm and head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .checks import _validate


@dataclass
class LayerSkipConfig:
    """Layer dropout rising with depth and an early-exit loss through the shared head."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    dropout: float = 0.0
    """The last layer's drop rate in training: layer l of L (from 0) is skipped, per sequence,
    with probability dropout * l / (L - 1), so the first layer always runs (0: no layer
    dropout)."""
    exit_weight: float = 0.0
    """The early-exit loss's weight: each exit layer's output, through the model's final norm
    and head, adds its cross-entropy against the data, weighted by its depth (layer count n
    gets n / the sum of the exit layers' counts) times this (0: no early-exit loss). Logged
    as "exit_loss", the depth-weighted mean, unscaled."""
    exit_kl: float = 0.0
    """The weight of the self-distillation term: the KL divergence from the whole stack's
    next-token distribution (detached: the stack is not pulled toward its exits) to each exit
    layer's, through the final norm and head, weighted by depth as the exit loss (0: none).
    Logged as "exit_kl", the depth-weighted mean, unscaled."""
    exit_layers: list[int] | None = None
    """The layer counts whose outputs take the early-exit loss (n: the output of the first n
    layers, as ``--draft-layers n`` drafts with), from 1 to num_layers - 1; None: all of
    them."""

    @property
    def enabled(self) -> bool:
        return self.dropout > 0 or self.exit_weight > 0 or self.exit_kl > 0

    def __post_init__(self) -> None:
        _validate(self, "train.layer_skip")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"train.layer_skip.dropout is the last layer's drop rate and "
                              f"must be in [0, 1), got {self.dropout!r}.")
        if not self.exit_weight >= 0:
            raise ConfigError(f"train.layer_skip.exit_weight must be >= 0, got "
                              f"{self.exit_weight!r}.")
        if not self.exit_kl >= 0:
            raise ConfigError(f"train.layer_skip.exit_kl must be >= 0, got {self.exit_kl!r}.")
        if self.exit_layers is not None:
            if not self.exit_layers or any(isinstance(n, bool) or not isinstance(n, int)
                                           or n < 1 for n in self.exit_layers):
                raise ConfigError(f"train.layer_skip.exit_layers lists layer counts (positive "
                                  f"integers, e.g. [1, 2]), got {self.exit_layers!r}; leave "
                                  f"it out for every layer but the last.")
            if len(set(self.exit_layers)) != len(self.exit_layers):
                raise ConfigError(f"train.layer_skip.exit_layers lists a layer count twice: "
                                  f"{self.exit_layers}.")

    def exits(self, num_layers: int) -> list[int]:
        """The layer counts that take the early-exit loss and the KL term (none without
        exit_weight or exit_kl)."""
        if not (self.exit_weight > 0 or self.exit_kl > 0):
            return []
        return sorted(self.exit_layers) if self.exit_layers else list(range(1, num_layers))

    def check_model(self, m, train) -> None:
        """What the recipe asks of the model (``m``: the ModelConfig) and the trainer."""
        if not self.enabled:
            if self.exit_layers is not None:
                raise ConfigError("train.layer_skip.exit_layers is set but exit_weight and "
                                  "exit_kl are 0, so no exit is trained; set exit_weight > 0 "
                                  "(or exit_kl > 0), or leave exit_layers out.")
            return
        if m.depth != "discrete":
            raise ConfigError(f"[train.layer_skip] trains a discrete stack's first layers to "
                              f"draft for it; model.depth = {m.depth!r} is not one. An ODE "
                              f"model drafts with coarser solves of its own weights: use "
                              f"[train.any_depth].")
        if m.num_layers < 2:
            raise ConfigError(f"[train.layer_skip] needs a stack of at least 2 layers (a "
                              f"first layer that can draft for the rest), got num_layers = "
                              f"{m.num_layers}.")
        bad = [n for n in self.exits(m.num_layers) if n >= m.num_layers]
        if bad:
            raise ConfigError(f"train.layer_skip.exit_layers: {bad[0]} is not an early exit of "
                              f"a {m.num_layers}-layer stack; list layer counts from 1 to "
                              f"{m.num_layers - 1} (the last layer's output is the model's "
                              f"own, with the usual loss).")
        if (self.exit_weight > 0 or self.exit_kl > 0) and train.compile:
            # the exits read every layer's output, which the depth module hands out through a
            # Python list that a compiled graph would not fill
            raise ConfigError("train.layer_skip.exit_weight and exit_kl read each layer's "
                              "output in eager mode; set train.compile = false for this run, "
                              "or both to 0.")
