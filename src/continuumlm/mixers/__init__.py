"""Token mixers: modules that move information between positions, ``forward(x, cache=None)``.

A mixer knows nothing about depth or solvers. Add one by registering its class here.
"""

from .softmax import SoftmaxAttention

MIXERS = {
    "softmax": SoftmaxAttention,
}

__all__ = ["MIXERS", "SoftmaxAttention"]
