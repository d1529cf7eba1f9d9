"""[mqar]: the multi-query associative recall task (MQARConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ConfigError
from .checks import _strict, _validate


@dataclass
class MQARConfig:
    """The multi-query associative recall task (``continuumlm mqar``)."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    vocab_size: int = 8192
    """Token ids of the task: keys from the lower half, values from the upper half."""
    seq_len: int = 256
    """Tokens per example (key-value pairs, then queries among noise)."""
    num_kv_pairs: int = 16
    """Key-value pairs per example (of the held-out set, and of training unless
    train_kv_pairs is set)."""
    power_a: float = 0.01
    """Query distances d are drawn with p(d) proportional to a * d^(a - 1) (Zoology's 0.01)."""
    train_examples: int = 100_000
    """Size of the fixed training set (sampled once, reused every epoch, as in Zoology)."""
    test_examples: int = 1000
    """Size of the held-out set, sampled once from its own seed."""
    stop_accuracy: float = 1.0
    """Stop at the first evaluation whose recall accuracy reaches this (1.0: only at perfect
    recall)."""
    train_kv_pairs: list[int] = field(default_factory=list)
    """Pair counts of a mixed training set, e.g. [4, 8, 16, 32, 64]: the training examples are
    split evenly among them (all at ``seq_len``), as in Zoology's training data. Empty: every
    training sequence has ``num_kv_pairs``. The held-out set always has ``num_kv_pairs``."""

    def __post_init__(self) -> None:
        _validate(self, "mqar")
        if not 0.0 <= self.stop_accuracy <= 1.0:
            raise ConfigError(f"mqar.stop_accuracy must lie in [0, 1], got {self.stop_accuracy}.")
        bad = [n for n in self.train_kv_pairs if n <= 0]
        if bad:
            raise ConfigError(f"mqar.train_kv_pairs must hold positive pair counts, got {bad[0]}; "
                              f"write e.g. train_kv_pairs = [4, 8, 16, 32, 64], or [] for none.")
        if len(self.train_kv_pairs) > self.train_examples:
            raise ConfigError(f"mqar.train_kv_pairs lists {len(self.train_kv_pairs)} pair counts "
                              f"but mqar.train_examples = {self.train_examples} cannot give "
                              f"each one an example; raise train_examples.")
        for n in (self.num_kv_pairs, *self.train_kv_pairs):
            if self.vocab_size // 2 - 1 < n:
                raise ConfigError(
                    f"mqar.vocab_size = {self.vocab_size} leaves {max(0, self.vocab_size // 2 - 1)}"
                    f" distinct keys (keys come from the lower half of the vocabulary, id 0 "
                    f"unused), fewer than the {n} key-value pairs asked for; raise "
                    f"mqar.vocab_size to at least {2 * n + 2}.")
            if (self.seq_len + 1 - 2 * n) // 2 < n:
                raise ConfigError(
                    f"mqar.seq_len = {self.seq_len} is too short for {n} key-value pairs and "
                    f"their queries; it needs at least {4 * n - 1} tokens.")
        space = (self.seq_len + 1 - 2 * min([self.num_kv_pairs, *self.train_kv_pairs])) // 2
        if space >= 1 and _strict():
            try:  # the weights a * d^(a - 1) at both ends, and their sum, in float64
                ends = (self.power_a, self.power_a * space ** (self.power_a - 1))
                usable = all(0 < w and math.isfinite(w * space) for w in ends)
            except OverflowError:
                usable = False
            if not usable:
                raise ConfigError(
                    f"mqar.power_a = {self.power_a}: query distances d up to {space} are drawn "
                    f"with p(d) proportional to a * d^(a - 1), which overflows or underflows "
                    f"here; Zoology uses 0.01 (smaller puts queries nearer their keys, a > 1 "
                    f"farther).")
