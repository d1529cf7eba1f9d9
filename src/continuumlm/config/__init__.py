"""Typed configuration: model, data and training sections, TOML files and ``--set`` overrides.

Every value is checked when a config is built, so a typo or an impossible size fails at once
with a message that names the key, instead of deep inside a training run. The package is
split by concern: ``sections`` (the dataclasses), ``checks`` (types, bounds, where a value came
from), ``components`` (the [model.NAME] tables components own, and the 0.1 names),
``loading`` (TOML and --set), ``docs`` (--explain).
"""

from .checks import reading_saved_config, setting
from .components import LEGACY_KEYS, _configurable
from .docs import explain, field_docs
from .loading import canonical_key, dump_toml, load_config, parse_override
from .sections import (
    GRAD_MODES,
    ODE_KV,
    SECTIONS,
    DataConfig,
    ModelConfig,
    MQARConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "GRAD_MODES", "LEGACY_KEYS", "ODE_KV", "SECTIONS", "DataConfig", "MQARConfig", "ModelConfig",
    "RunConfig", "TrainConfig", "_configurable", "canonical_key", "dump_toml", "explain", "field_docs",
    "load_config", "parse_override", "reading_saved_config", "setting",
]
