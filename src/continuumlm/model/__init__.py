from typing import TYPE_CHECKING

from .cache import DecodeState, KVCache

if TYPE_CHECKING:
    from .depth import DEPTHS, DiscreteStack, TransformerBlock
    from .lm import LanguageModel

__all__ = ["DEPTHS", "DecodeState", "DiscreteStack", "KVCache", "LanguageModel",
           "TransformerBlock"]


def __getattr__(name: str):
    # depth.py and lm.py build on the mixers, and the mixers build on .cache: loading the
    # former on first use keeps `import continuumlm.mixers` (or .ode) free of an import cycle.
    if name in ("DEPTHS", "DiscreteStack", "TransformerBlock"):
        from . import depth

        return getattr(depth, name)
    if name == "LanguageModel":
        from .lm import LanguageModel

        return LanguageModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
