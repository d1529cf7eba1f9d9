"""``ContinuumLMConfig``: a transformers config holding every ``ModelConfig`` field."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import ModelConfig
from ..config.components import model_settings
from ..model.lm import MODEL_TYPE


class ContinuumLMConfig(PretrainedConfig):
    """Every field of :class:`continuumlm.ModelConfig` as an attribute (component settings as
    one dict per component, as in ``config.json``), checked by ``ModelConfig`` itself, plus the
    usual transformers attributes; ``num_attention_heads``, ``num_hidden_layers`` and
    ``max_position_embeddings`` name ``num_heads``, ``num_layers`` and ``max_seq_len``."""

    model_type = MODEL_TYPE
    attribute_map = {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
                     "max_position_embeddings": "max_seq_len"}

    def __post_init__(self, **kwargs):
        for hf, ours in self.attribute_map.items():  # the standard names, given as such
            if hf in kwargs:
                kwargs.setdefault(ours, kwargs.pop(hf))
        mine = model_settings(kwargs)
        for k in mine:
            del kwargs[k]
        mcfg = ModelConfig.from_dict(mine, source="config.json", saved=True)
        for key, value in mcfg.to_dict().items():
            object.__setattr__(self, key, value)
        kwargs.setdefault("tie_word_embeddings", mcfg.tie_embeddings)
        object.__setattr__(self, "use_cache", kwargs.pop("use_cache", True))
        super().__post_init__(**kwargs)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> ContinuumLMConfig:
        return cls(**cfg.to_dict(), **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(model_settings(self.__dict__), source="config.json",
                                     saved=True)


__all__ = ["ContinuumLMConfig", "MODEL_TYPE"]
