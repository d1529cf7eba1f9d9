"""ContinuumLM: continuous-depth Transformer language models.

Public API::

    from continuumlm import ModelConfig, LanguageModel, load_config
"""

from typing import TYPE_CHECKING

from .config import DataConfig, ModelConfig, RunConfig, TrainConfig, load_config
from .errors import CheckpointError, ConfigError, ContinuumLMError, DataError

if TYPE_CHECKING:
    from .model import LanguageModel

__version__ = "0.1.0"


def __getattr__(name: str):
    # The model brings torch (seconds to import): it loads on first use, so that the command
    # line's --help and usage errors answer at once.
    if name == "LanguageModel":
        from .model import LanguageModel

        return LanguageModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CheckpointError", "ConfigError", "ContinuumLMError", "DataConfig", "DataError",
    "LanguageModel", "ModelConfig", "RunConfig", "TrainConfig", "load_config", "__version__",
]
