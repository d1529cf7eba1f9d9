"""[train.distill]: distillation from a trained model (DistillConfig, implemented by
``train/distill.Teacher``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .checks import _validate


@dataclass
class DistillConfig:
    """Distillation: the teacher and the weight of its term."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    teacher: str | None = None
    """A trained run folder (its last checkpoint) or checkpoint folder whose model is the
    teacher. Each micro-batch adds train.distill.weight times KL(teacher || model) of the
    next-token distributions (the teacher in eval mode, without gradients, at its own solver
    and step count), logged as "distill". The teacher must have this run's tokenizer; its
    weights' digest is saved with the run, and a resume refuses a teacher that changed. With
    elastic depth, a fixed-trained teacher pulls every drawn solve toward one good solution.
    (Before: train.distill_from.)"""
    weight: float = 0.0
    """The weight of the distillation term (with teacher). (Before: train.distill_weight.)"""

    @property
    def enabled(self) -> bool:
        return self.teacher is not None

    def __post_init__(self) -> None:
        _validate(self, "train.distill")
        if not self.weight >= 0:
            raise ConfigError(f"train.distill.weight must be >= 0, got {self.weight}.")
        if (self.teacher is None) != (self.weight == 0):
            raise ConfigError(
                "train.distill.teacher (the teacher's run or checkpoint folder) and "
                "train.distill.weight (> 0) go together: set both to distill, or neither "
                f"(got teacher = {self.teacher!r}, weight = {self.weight}).")
