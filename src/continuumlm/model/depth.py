"""Depth: how the per-position state is transformed between the embedding and the head.

``discrete`` is an ordinary stack of ``num_layers`` distinct pre-norm blocks; ``ode`` is a stack
of ``num_layers`` ODE blocks, each a shared-weight vector field integrated over t. Each depth
module takes ``(x, state=None)``, hands every mixer evaluation its own cache from the decoding
state, and reports ``last_nfe``: the number of block evaluations in its last forward.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..nn import MLP, freeze_dropout, make_norm
from ..ode import ADJOINT_FIXED, AdaptiveSolver, integrate
from ..registry import DEPTHS, FIELDS, MIXERS, SOLVERS
from .cache import DecodeState

log = logging.getLogger("continuumlm")


class TransformerBlock(nn.Module):
    """Pre-norm block: x = x + Mixer(Norm(x)); x = x + MLP(Norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = make_norm(cfg.hidden_size, cfg)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.norm2 = make_norm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class DiscreteStack(nn.Module):
    """``num_layers`` distinct blocks, each applied once."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.last_nfe = 0

    def forward(self, x: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            cache = None
            if state is not None:
                cache = state.cache(("layer", i), layer.mixer.cache_factory)
            x = layer(x, cache)
        self.last_nfe = len(self.layers)
        return x


class ODEBlock(nn.Module):
    """h(t1) = h(t0) + integral of f(t, h) dt, one field (shared weights) for every step.

    In decoding, every evaluation of f gets its own cache, keyed by (block, evaluation index):
    a fixed-grid solve is a fixed graph of evaluations, and in decoder mode the evaluation at
    position i depends only on positions <= i of the same evaluation, so the caches make
    incremental decoding exact.
    """

    def __init__(self, cfg, index: int):
        super().__init__()
        self.index = index
        self.cfg = cfg
        self.field = FIELDS[cfg.field](cfg)
        self.solver = SOLVERS[cfg.ode_solver](cfg)
        self._dropouts = freeze_dropout(self.field)
        if self.field.post_mlp:  # the "attention" field: MLP stays a discrete sublayer
            self.norm_mlp = make_norm(cfg.hidden_size, cfg)
            self.mlp = MLP(cfg)
        self.last_nfe = 0

    def forward(self, x: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        for d in self._dropouts:
            d.reset()  # one dropout mask per forward, shared by every step and stage
        calls = [0]
        field, key, factory = self.field, self.index, self.field.mixer.cache_factory

        def f(t: float, h: torch.Tensor) -> torch.Tensor:
            n = calls[0]
            calls[0] += 1
            cache = state.cache(("ode", key, n), factory) if state is not None else None
            return field(t, h, cache)

        cfg = self.cfg
        field.dt = (cfg.ode_t1 - cfg.ode_t0) / cfg.ode_steps  # read by a dt embedding
        params = tuple(p for p in self.field.parameters())
        x = integrate(f, x, cfg.ode_t0, cfg.ode_t1, self.solver, cfg.ode_steps, cfg.ode_grad,
                      params, where=f"ODE block {self.index}")
        self.last_nfe = calls[0]
        if self.field.post_mlp:
            x = x + self.mlp(self.norm_mlp(x))
        return x


class ODEStack(nn.Module):
    """``num_layers`` ODE blocks, each with its own weights (CAT's ``--blocks``)."""

    def __init__(self, cfg):
        super().__init__()
        self.blocks = nn.ModuleList(ODEBlock(cfg, i) for i in range(cfg.num_layers))
        self.last_nfe = 0
        self.exact_cache = bool(getattr(self.blocks[0].solver, "fixed_grid", True))
        if not self.exact_cache and cfg.mode == "decoder":
            log.warning(
                "model.ode_solver = %r is adaptive: its step-size controller takes one error norm "
                "over the whole batch and sequence, so future tokens and other batch rows change "
                "earlier positions' outputs (the decoder is not exactly causal). Use a fixed-grid "
                "solver (euler, midpoint, heun, rk4, ...) for exact causality.", cfg.ode_solver)

    @staticmethod
    def check_config(cfg) -> None:
        # the solver protocol's class attributes (a plugin's solver declares them too)
        solver = SOLVERS.component_class(cfg.ode_solver)
        adaptive = not getattr(solver, "fixed_grid", True)
        reversible = bool(getattr(solver, "reversible", False))
        if adaptive and not (isinstance(solver, type) and issubclass(solver, AdaptiveSolver)):
            raise ConfigError(
                f"model.ode_solver = {cfg.ode_solver!r} declares fixed_grid = False, but an "
                f"adaptive solver is integrated through torchdiffeq and must subclass "
                f"continuumlm.ode.AdaptiveSolver (with its torchdiffeq method name).")
        if reversible and not all(hasattr(solver, m) for m in ("integrate_reversible",
                                                               "integrate_direct")):
            raise ConfigError(
                f"model.ode_solver = {cfg.ode_solver!r} declares reversible = True but lacks "
                f"integrate_reversible / integrate_direct (see continuumlm.ode.ReversibleHeun).")
        if cfg.ode_grad == "reversible" and not reversible:
            raise ConfigError(
                f"model.ode_grad = 'reversible' needs an algebraically reversible solver, and "
                f"{cfg.ode_solver!r} is not; use ode_solver = 'reversible_heun' (or another "
                f"ode_grad: direct, checkpoint, adjoint).")
        if cfg.ode_grad == "adjoint" and not (adaptive or cfg.ode_solver in ADJOINT_FIXED):
            raise ConfigError(
                f"model.ode_grad = 'adjoint' works with {', '.join(sorted(ADJOINT_FIXED))} and "
                f"the adaptive solvers, not {cfg.ode_solver!r}; use ode_grad = 'direct' or "
                f"'checkpoint' (or 'reversible' with reversible_heun).")
        if cfg.ode_grad == "checkpoint" and reversible:
            raise ConfigError(
                f"model.ode_grad = 'checkpoint' is not implemented for {cfg.ode_solver!r}: use "
                f"ode_grad = 'reversible' (exact gradients, memory constant in the steps, less "
                f"than checkpointing stores) or 'direct'.")
        if cfg.ode_grad == "checkpoint" and adaptive:
            raise ConfigError(
                "model.ode_grad = 'checkpoint' needs a fixed-grid solver (its steps are known in "
                "advance); with an adaptive solver use 'adjoint' or 'direct'.")
        if cfg.ode_dt_embedding and adaptive:
            raise ConfigError(f"model.ode_dt_embedding conditions the field on a fixed step "
                              f"size; the adaptive {cfg.ode_solver!r} chooses its own. Use a "
                              f"fixed-grid solver, or leave ode_dt_embedding off.")
        if not cfg.ode_t1 > cfg.ode_t0:
            raise ConfigError(f"model.ode_t1 ({cfg.ode_t1}) must be greater than model.ode_t0 "
                              f"({cfg.ode_t0}).")

    def forward(self, x: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        if state is not None and not self.exact_cache:
            raise ValueError("an adaptive ODE solver cannot be decoded incrementally (its steps "
                             "depend on the whole sequence); use use_cache=False.")
        for block in self.blocks:
            x = block(x, state)
        self.last_nfe = sum(b.last_nfe for b in self.blocks)
        return x


DEPTHS.register("discrete", DiscreteStack)
DEPTHS.register("ode", ODEStack)
