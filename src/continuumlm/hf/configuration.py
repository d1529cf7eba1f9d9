"""``ContinuumLMConfig``: a transformers config holding every ``ModelConfig`` field."""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import ModelConfig
from ..config.components import model_settings
from ..model.lm import MODEL_TYPE

# the two one-line modules an exported folder carries, so that tools which never import
# continuumlm.hf load it with trust_remote_code=True (its config's auto_map names them)
REMOTE_CODE = {
    "configuration_continuumlm.py": '"""ContinuumLM\'s transformers config, from the installed '
                                    'package (pip install continuumlm)."""\n'
                                    "from continuumlm.hf import ContinuumLMConfig  # noqa: F401\n",
    "modeling_continuumlm.py": '"""ContinuumLM\'s transformers model, from the installed package '
                               '(pip install continuumlm)."""\n'
                               "from continuumlm.hf import ContinuumLMForCausalLM  # noqa: F401\n",
}
AUTO_MAP = {"AutoConfig": "configuration_continuumlm.ContinuumLMConfig",
            "AutoModelForCausalLM": "modeling_continuumlm.ContinuumLMForCausalLM"}


def write_remote_code(out) -> None:
    """Write the modules ``AUTO_MAP`` names into the folder ``out``."""
    from pathlib import Path

    for name, code in REMOTE_CODE.items():
        (Path(out) / name).write_text(code)


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

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs) -> None:
        """``config.json`` (every field) and, when the config has an ``auto_map`` (an exported
        or remote-code-loaded model's), the two one-line remote-code modules it names, so the
        folder loads with ``trust_remote_code=True`` as well. (transformers' own method copies
        the source file of a class loaded as remote code, which for this package is a module
        with relative imports, and fails.)"""
        import json
        from pathlib import Path

        if push_to_hub:
            raise NotImplementedError("push_to_hub: save the folder, then upload it with "
                                      "huggingface_hub.upload_folder.")
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.to_dict()
        if cfg.get("auto_map"):
            cfg["auto_map"] = {**cfg["auto_map"], **AUTO_MAP}
            write_remote_code(out)
        tmp = out / "config.json.tmp"
        tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tmp.replace(out / "config.json")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> ContinuumLMConfig:
        return cls(**cfg.to_dict(), **kwargs)

    def to_model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(model_settings(self.__dict__), source="config.json",
                                     saved=True)


__all__ = ["ContinuumLMConfig", "MODEL_TYPE"]
