"""ContinuumLM: continuous-depth Transformer language models.

Public API::

    from continuumlm import ModelConfig, LanguageModel, load_config
"""

from .config import DataConfig, ModelConfig, RunConfig, TrainConfig, load_config
from .errors import CheckpointError, ConfigError, ContinuumLMError, DataError
from .model import LanguageModel

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "ContinuumLMError", "DataConfig", "DataError",
    "LanguageModel", "ModelConfig", "RunConfig", "TrainConfig", "load_config", "__version__",
]
