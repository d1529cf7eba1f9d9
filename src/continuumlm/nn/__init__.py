"""Small building blocks shared by mixers and fields."""

from .attrs import set_plain
from .dropout import SharedDropout, freeze_dropout
from .linear import (
    BitLinear,
    linear_rows,
    make_linear,
    stacked_linear,
    tensor_state,
    ternary_weights,
)
from .mlp import MLP
from .norm import Float32RMSNorm, make_norm
from .position import RotaryEmbedding

__all__ = ["set_plain", "SharedDropout", "freeze_dropout", "BitLinear", "linear_rows", "make_linear", "stacked_linear", "tensor_state", "ternary_weights", "MLP", "make_norm", "Float32RMSNorm", "RotaryEmbedding"]
