from .cache import DecodeState, KVCache
from .depth import DEPTHS, DiscreteStack, TransformerBlock
from .lm import LanguageModel

__all__ = ["DEPTHS", "DecodeState", "DiscreteStack", "KVCache", "LanguageModel", "TransformerBlock"]
