"""A switch for code that will be differentiated twice.

The Jacobian regularizer takes a vector-Jacobian product of the field inside the solve and the
loss differentiates it again. Kernels with a hand-written, once-differentiable backward (the
chunkwise DeltaNet kernel, attention's fused CPU kernels) cannot take that second derivative;
inside :func:`twice_differentiable` mixers choose a form plain autograd differentiates twice.
"""

from __future__ import annotations

import contextlib

_active = 0


@contextlib.contextmanager
def twice_differentiable():
    """Inside: mixers pick kernels that autograd can differentiate twice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    global _active
    _active += 1
    try:
        with sdpa_kernel([SDPBackend.MATH]):  # attention's composite form
            yield
    finally:
        _active -= 1


def needed() -> bool:
    """Whether the code running now will be differentiated twice."""
    return _active > 0
