"""ContinuumLM: continuous-depth Transformer language models.

Public API::

    from continuumlm import ModelConfig, LanguageModel, load_config
    from continuumlm import register_mixer, register_field, register_solver  # your own parts
"""

from typing import TYPE_CHECKING

from .config import DataConfig, ModelConfig, RunConfig, TrainConfig, load_config
from .errors import CheckpointError, ConfigError, ContinuumLMError, DataError
from .registry import load_plugins, register_field, register_mixer, register_solver

if TYPE_CHECKING:
    from .decoding import Decoder, Draft
    from .model import LanguageModel

__version__ = "0.1.0"


def __getattr__(name: str):
    # The model brings torch (seconds to import): it loads on first use, so that the command
    # line's --help and usage errors answer at once (PEP 562; not an import-cycle workaround:
    # nothing below the package root imports it).
    if name == "LanguageModel":
        from . import model

        return model.LanguageModel
    if name in ("Decoder", "Draft"):
        from . import decoding

        return getattr(decoding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CheckpointError", "ConfigError", "ContinuumLMError", "DataConfig", "DataError", "Decoder",
    "Draft",
    "LanguageModel", "ModelConfig", "RunConfig", "TrainConfig", "load_config", "load_plugins",
    "register_field", "register_mixer", "register_solver", "__version__",
]
