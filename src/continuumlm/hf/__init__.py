"""Hugging Face ``transformers`` adapter: ``ContinuumLMConfig``, ``ContinuumLMForCausalLM`` and
``ContinuumLMCache``, registered with ``AutoConfig`` and ``AutoModelForCausalLM`` when this
module is imported (``import continuumlm.hf``; the core package never imports transformers).

    import continuumlm.hf  # noqa: F401  (registers model_type "continuumlm")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("runs/demo/checkpoints/best")
    model = AutoModelForCausalLM.from_pretrained(DIR, ode_solver="rk4", ode_steps=8)

Any ContinuumLM checkpoint folder (``config.json`` + ``model.safetensors``) loads as it is;
``continuumlm export --checkpoint RUN --hf OUT`` adds the files ``AutoTokenizer`` and
``generate`` read (``tokenizer_config.json``, ``generation_config.json``). Written against
transformers 5.17 and later: the decoding state is the ``cache`` keyword and output field from
5.24, ``past_key_values`` before (``modeling.CACHE_FIELD``); either keyword is taken.
"""

from __future__ import annotations

from .configuration import ContinuumLMConfig
from .modeling import ContinuumLMCache, ContinuumLMForCausalLM

__all__ = ["ContinuumLMCache", "ContinuumLMConfig", "ContinuumLMForCausalLM", "register"]


def register() -> None:
    """Register the model type with the Auto classes (done on import; idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(ContinuumLMConfig.model_type, ContinuumLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(ContinuumLMConfig, ContinuumLMForCausalLM, exist_ok=True)


register()
