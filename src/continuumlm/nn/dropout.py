"""Dropout that can hold its mask fixed for the duration of one ODE solve.

Inside a vector field f, ordinary dropout would draw a new mask at every solver stage, making f
a different function at each evaluation of the same step (and breaking the adjoint, checkpoint
and reversible backward passes, which evaluate f again). ODE blocks therefore freeze the masks:
one mask per module per forward pass, reused by every step and stage of the solve and by the
backward pass, and redrawn at the next forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SharedDropout(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.frozen = False  # set by ODE blocks for every dropout inside their field
        self._mask: torch.Tensor | None = None

    def active(self) -> bool:
        return self.training and self.p > 0

    def mask_like(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen mask for this shape (already scaled by 1/(1-p))."""
        if self._mask is None or self._mask.shape != x.shape or self._mask.device != x.device:
            keep = torch.empty_like(x).bernoulli_(1 - self.p)
            self._mask = keep / (1 - self.p)
        return self._mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active():
            return x
        if self.frozen:
            return x * self.mask_like(x)
        return F.dropout(x, self.p, True)

    def reset(self) -> None:
        if self._mask is not None:  # (nn.Module's attribute setting costs a few us per call)
            self._mask = None

    def extra_repr(self) -> str:
        return f"p={self.p}, frozen={self.frozen}"


def freeze_dropout(module: nn.Module) -> list[SharedDropout]:
    """Freeze every SharedDropout under ``module``; return them (to reset per forward)."""
    found = [m for m in module.modules() if isinstance(m, SharedDropout)]
    for m in found:
        m.frozen = True
    return found
