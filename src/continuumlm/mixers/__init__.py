"""Token mixers: modules that move information between positions, ``forward(x, cache=None)``.

A mixer knows nothing about depth or solvers. Add one by registering its class here.
"""

from .continuous import ContinuousAttention
from .deltanet import DeltaNetAttention, delta_rule_chunkwise, delta_rule_recurrent
from .softmax import SoftmaxAttention

MIXERS = {
    "softmax": SoftmaxAttention,
    "deltanet": DeltaNetAttention,
    "continuous": ContinuousAttention,
}

__all__ = ["MIXERS", "ContinuousAttention", "DeltaNetAttention", "SoftmaxAttention", "delta_rule_chunkwise",
           "delta_rule_recurrent"]
