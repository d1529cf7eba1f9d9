"""The adapter's state dicts in the wrapped model's names: ``own_names`` (a ``model.`` prefix
dropped, the tied head left out, checked) and ``load_state_dict`` (strict)."""

from __future__ import annotations

from ..errors import CheckpointError
from ..model.lm import LanguageModel

BASE_MODEL_PREFIX = "model"  # ContinuumLMForCausalLM.base_model_prefix


def own_names(lm: LanguageModel, state_dict: dict, where: str) -> dict:
    """``state_dict`` in the wrapped model's names (a ``model.`` prefix dropped; a tied head
    left out, as ``model.safetensors`` stores it), checked: a tensor missing or extra is a
    CheckpointError."""
    prefix = BASE_MODEL_PREFIX + "."
    tensors = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}
    expected = set(lm.state_dict())
    if lm.config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise CheckpointError(f"{where} does not match the model: missing tensors "
                              f"{missing[:5]}, unexpected {unexpected[:5]}.")
    return tensors


def load_state_dict(lm: LanguageModel, state_dict: dict, where: str) -> None:
    """Copy ``state_dict`` (names with or without the ``model.`` prefix) into ``lm``,
    strictly."""
    tensors = own_names(lm, state_dict, where)
    try:
        lm.load_state_dict(tensors, strict=False)
    except RuntimeError as e:
        raise CheckpointError(f"{where} does not fit the model: {str(e).splitlines()[-1]}") \
            from None
