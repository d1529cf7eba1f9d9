"""The run config that holds the sections, and its checks across them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .checks import _in, _suggest, reading_saved_config
from .data import DataConfig
from .elastic import solve_nfe, solve_pairs  # noqa: F401
from .model import ModelConfig, _build
from .mqar import MQARConfig
from .train import TrainConfig

SECTIONS = ("model", "data", "train", "mqar")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mqar: MQARConfig = field(default_factory=MQARConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() if name == "model" else
                dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str | None = None,
                  overridden: dict[str, str] | None = None, saved: bool = False) -> RunConfig:
        """``overridden`` maps ``section.key`` to the ``--set`` item that gave its value, so an
        error about that key points at the command line rather than the file. ``saved``: the
        config of a saved run (see ``reading_saved_config``)."""
        if saved:
            with reading_saved_config():
                return cls.from_dict(d, where, overridden)
        sections = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
                    "mqar": MQARConfig}
        unknown = [k for k in d if k not in sections]
        if unknown:
            given = [item for key, item in (overridden or {}).items()
                     if key.partition(".")[0] == unknown[0]]
            origin = f" (from --set {given[0]})" if given else _in(where)
            raise ConfigError(f"unknown section [{unknown[0]}]{_suggest(unknown[0], sections)}"
                              f"{origin}; valid sections are [model], [data], [train] and "
                              f"[mqar].")
        built = {}
        for name, klass in sections.items():
            section = d.get(name, {})
            if not isinstance(section, dict):
                raise ConfigError(f"[{name}]{_in(where)} must be a table of key = value pairs.")
            built[name] = _build(klass, section, name, where, overridden)
        return cls(**built)

    def check_trainable(self) -> None:
        """What `train` and `mqar` need beyond a valid config: their objective is next-token
        prediction, which a bidirectional (encoder) model solves by reading the target."""
        if self.model.mode != "decoder":
            raise ConfigError(
                f"model.mode = {self.model.mode!r} cannot be trained by this trainer: its "
                f"objective is next-token prediction, and an encoder sees the token it is asked "
                f"to predict, so its loss would mean nothing. Train with mode = 'decoder'; the "
                f"encoder mode is for using the layers in your own bidirectional model.")

    def check(self) -> None:
        """Cross-section checks that need more than one section."""
        m, t = self.model, self.train
        # each [train] table checks what it asks of the model
        t.regularize.check_model(m, t.elastic)
        t.elastic.check_model(m)
        t.any_depth.check_model(m, t.elastic)
        t.layer_skip.check_model(m, t)
        if m.position == "learned" and t.seq_len > m.max_seq_len:
            raise ConfigError(
                f"train.seq_len ({t.seq_len}) is longer than model.max_seq_len ({m.max_seq_len}), "
                f"which a learned position table cannot cover; raise model.max_seq_len or use "
                f"position = 'rope'.")
