"""Token mixers: modules that move information between positions, ``forward(x, cache=None)``.

A mixer knows nothing about depth or solvers. Each registers itself with
``continuumlm.register_mixer(name)``; ``MIXERS`` is that registry.
"""

from ..registry import MIXERS
from .cache import KVCache, SeqCache, StaticStep
from .continuous import ContinuousAttention
from .deltanet import DeltaNetAttention, delta_rule_chunkwise, delta_rule_recurrent
from .softmax import SoftmaxAttention

__all__ = ["MIXERS", "ContinuousAttention", "DeltaNetAttention", "KVCache", "SeqCache",
           "SoftmaxAttention", "StaticStep", "delta_rule_chunkwise", "delta_rule_recurrent"]
