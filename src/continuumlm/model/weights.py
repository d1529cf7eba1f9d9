"""A model folder (``config.json`` and ``model.safetensors``, written by
``LanguageModel.save_pretrained``) read back: its settings, checked, and its weights, strictly."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ModelConfig
from ..config.components import model_settings
from ..errors import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODEL_TYPE = "continuumlm"  # the model_type of config.json, for transformers' Auto classes


def read_model_config(directory: str | Path) -> ModelConfig:
    """The checked settings of the model folder ``directory`` (both files must be there)."""
    directory = Path(directory)
    cfg_path = directory / CONFIG_FILE
    for p in (cfg_path, directory / WEIGHTS_FILE):
        if not p.is_file():
            raise CheckpointError(f"{p} is missing; a model folder holds {CONFIG_FILE} and "
                                  f"{WEIGHTS_FILE} (written by save_pretrained or training).")
    try:
        cfg_dict = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); the file is corrupt.") from None
    if not isinstance(cfg_dict, dict):
        raise CheckpointError(f"{cfg_path} does not hold a JSON object of model settings.")
    if "model_type" in cfg_dict:  # beside the settings: transformers' keys
        if cfg_dict["model_type"] != MODEL_TYPE:
            raise CheckpointError(f"{cfg_path} describes a {cfg_dict['model_type']!r} model, "
                                  f"not a ContinuumLM one.")
        cfg_dict = model_settings(cfg_dict)
    return ModelConfig.from_dict(cfg_dict, source=str(cfg_path), saved=True)


def load_weights(model, directory: str | Path) -> None:
    """Read ``model.safetensors`` of ``directory`` into ``model`` (built on the CPU from the
    folder's config), strictly: a tensor missing, extra or of another shape is an error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not w_path.is_file():
        raise CheckpointError(f"{w_path} is missing; a model folder holds {CONFIG_FILE} and "
                              f"{WEIGHTS_FILE} (written by save_pretrained or training).")
    try:
        # read on the CPU, where the model was built (load_model copies into its parameters)
        missing, unexpected = load_model(model, str(w_path), strict=False, device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        # torch lists every mismatched tensor on its own line: name the first and the count
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        detail = next((x for x in lines if x.startswith("size mismatch")), lines[0] if lines
                      else type(e).__name__)
        more = sum(x.startswith("size mismatch") for x in lines) - 1
        detail += f" (and {more} more)" if more > 0 else ""
        raise CheckpointError(f"cannot read weights from {w_path}: {detail}. The file is "
                              f"corrupt, truncated or belongs to a different configuration "
                              f"than {cfg_path}.") from None
    if missing or unexpected:
        raise CheckpointError(f"{w_path} does not match {cfg_path}: missing tensors "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}.")
