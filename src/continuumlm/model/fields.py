"""Vector fields f(t, h): mixers, MLPs and norms composed into the dynamics of an ODE block.

- ``attention``: f = Attn(Norm(h)) (the seed's ODEFunc); the block adds a discrete MLP
  sublayer after the solve.
- ``sequential``: a whole pre-norm Transformer block as dynamics, in residual-branch form:
  a = Attn(N1(h)); f = a + MLP(N2(h + a)).
- ``parallel``: attention and MLP side by side (arXiv 2212.06011): f = Attn(N1(h)) + MLP(N2(h)).

The state itself is never part of f. With ``ode_time_embedding = "sinusoidal"`` a learned
projection of a sinusoidal embedding of t is added to every normalized input of f, so the
field is non-autonomous. With ``ode_dt_embedding`` an embedding of the step size (log2 of
1 / dt: 0 for one step over [0, 1], 3 for eight) is added as well, so that one field can learn
what each step count needs of it; the ODE block sets ``field.dt`` before each solve. With
``ode_dt_steps_range`` the embedded step count is clamped to that range.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..mixers.padding import mix
from ..nn import MLP, make_norm
from ..registry import MIXERS, register_field


class SinusoidalTimeEmbedding(nn.Module):
    def __init__(self, hidden_size: int, dim: int = 32, max_period: float = 100.0):
        super().__init__()
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs * 2 * math.pi, persistent=False)
        self.proj = nn.Linear(dim, hidden_size)
        self.proj.keep_init = True
        nn.init.zeros_(self.proj.weight)  # starts autonomous; learns how much t matters
        nn.init.zeros_(self.proj.bias)

    def forward(self, t) -> torch.Tensor:
        # t: a float (fixed grids), or a tensor from an adaptive solver, kept so that
        # gradients follow the step sizes' dependence on the state
        angles = (t.to(self.freqs.dtype) if torch.is_tensor(t) else float(t)) * self.freqs
        return self.proj(torch.cat([angles.sin(), angles.cos()]))


class _Field(nn.Module):
    post_mlp = False

    def __init__(self, cfg):
        super().__init__()
        self.time = (SinusoidalTimeEmbedding(cfg.hidden_size)
                     if cfg.ode_time_embedding == "sinusoidal" else None)
        # log2(1 / dt) spans about 0..10 for 1..1024 steps: periods from 1 to 64 tell them apart
        self.step_size = (SinusoidalTimeEmbedding(cfg.hidden_size, dim=16, max_period=64.0)
                          if getattr(cfg, "ode_dt_embedding", False) else None)
        self.dt = None
        # log2 of the step (or field-evaluation) counts per unit time the dt embedding reads
        # unclamped
        r = getattr(cfg, "ode_dt_steps_range", None) if self.step_size is not None else None
        span = None if r is None else cfg.ode_t1 - cfg.ode_t0
        self.dt_bounds = None if r is None else (math.log2(r[0] / span), math.log2(r[1] / span))

    def temb(self, t: float, like: torch.Tensor):
        te = None if self.time is None else self.time(t).to(like.dtype)
        if self.step_size is not None:
            if self.dt is None:
                raise RuntimeError("a field with a dt embedding is evaluated outside an ODE "
                                   "block's solve (field.dt is unset).")
            level = math.log2(1.0 / self.dt)
            if self.dt_bounds is not None:
                level = min(max(level, self.dt_bounds[0]), self.dt_bounds[1])
            de = self.step_size(level).to(like.dtype)
            te = de if te is None else te + de
        return te

    @staticmethod
    def _plus(x: torch.Tensor, te) -> torch.Tensor:
        return x if te is None else x + te

    supports_padding = True  # passed on to the mixer (mixers/padding.py)

    def write(self, t: float, h: torch.Tensor, cache, padding=None) -> None:
        """Only what later tokens read from this evaluation at state ``h``: the mixer's cache
        writes, for tokens that stopped integrating early (``ExitRule``). No MLP; the mixer's
        own read is skipped too when it has a ``write(x, cache)``."""
        x = self.mixer_input(t, h)
        writer = getattr(self.mixer, "write", None)
        if writer is None:
            mix(self.mixer, x, cache, padding)
        elif padding is None:
            writer(x, cache)
        else:
            writer(x, cache, padding=padding)


@register_field("attention")
class AttentionField(_Field):
    post_mlp = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norm = make_norm(cfg.hidden_size, cfg)
        self.mixer = MIXERS[cfg.mixer](cfg)

    def mixer_input(self, t: float, h: torch.Tensor) -> torch.Tensor:
        return self._plus(self.norm(h), self.temb(t, h))

    def forward(self, t: float, h: torch.Tensor, cache=None, padding=None) -> torch.Tensor:
        return mix(self.mixer, self.mixer_input(t, h), cache, padding)


class _TransformerField(_Field):
    """Norms, a mixer and an MLP: the parts of a Transformer block."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.norm1 = make_norm(cfg.hidden_size, cfg)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.norm2 = make_norm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg)

    def mixer_input(self, t: float, h: torch.Tensor) -> torch.Tensor:
        return self._plus(self.norm1(h), self.temb(t, h))


@register_field("sequential")
class SequentialField(_TransformerField):
    def forward(self, t: float, h: torch.Tensor, cache=None, padding=None) -> torch.Tensor:
        te = self.temb(t, h)
        a = mix(self.mixer, self._plus(self.norm1(h), te), cache, padding)
        return a + self.mlp(self._plus(self.norm2(h + a), te))


@register_field("parallel")
class ParallelField(_TransformerField):
    def forward(self, t: float, h: torch.Tensor, cache=None, padding=None) -> torch.Tensor:
        te = self.temb(t, h)
        return (mix(self.mixer, self._plus(self.norm1(h), te), cache, padding)
                + self.mlp(self._plus(self.norm2(h), te)))
