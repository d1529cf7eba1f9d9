"""The language model, its depth modules and the decoding state that keys their caches."""

from ..registry import DEPTHS
from .cache import DecodeState, KVCache
from .depth import DiscreteStack, ODEStack, TransformerBlock
from .lm import LanguageModel

__all__ = ["DEPTHS", "DecodeState", "DiscreteStack", "KVCache", "LanguageModel", "ODEStack",
           "TransformerBlock"]
