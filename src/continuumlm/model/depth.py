"""Depth: how the per-position state is transformed between the embedding and the head.

``discrete`` is an ordinary stack of ``num_layers`` distinct pre-norm blocks; ``ode`` is a stack
of ``num_layers`` ODE blocks, each a shared-weight vector field integrated over t. Each depth
module takes ``(x, state=None)``, hands every mixer evaluation its own cache from the decoding
state, and reports ``last_nfe``: the number of block evaluations in its last forward.

An ODE stack can also stop integrating a token early (:class:`ExitRule`, set with
``LanguageModel.set_exit``): after each solver step, a token whose state has settled is frozen
for the rest of that block. See :func:`continuumlm.model.exit.solve_with_exit` for what that means exactly.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
import torch.utils.checkpoint

from ..errors import ConfigError
from ..mixers.padding import Padding, mix, takes_memory
from ..nn import MLP, freeze_dropout, make_norm, set_plain
from ..ode import AdaptiveSolver
from ..ode.grad import refusal as grad_refusal
from ..registry import DEPTHS, FIELDS, MIXERS, SOLVERS
from . import ladder
from .cache import DecodeState
from .exit import EXIT_CRITERIA, ExitRule, check_exit_solver, solve_with_exit  # noqa: F401 - importable here as before
from .extras import SolveExtras, augmented  # noqa: F401 - SolveExtras: importable here too
from .ode_kv import kv_refusal
from .solve import Solve

log = logging.getLogger("continuumlm")


def checkpoint(fn, *args):
    """Activation checkpointing of one layer or block (non-reentrant, which keeps the
    gradients of inputs that need none and the forward's random state)."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


class TransformerBlock(nn.Module):
    """Pre-norm block: x = x + Mixer(Norm(x)); x = x + MLP(Norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.norm1 = make_norm(cfg.hidden_size, cfg)
        self.mixer = MIXERS[cfg.mixer](cfg)
        self.norm2 = make_norm(cfg.hidden_size, cfg)
        self.mlp = MLP(cfg)
        # activation checkpointing of this layer (transformers' names, which its
        # gradient_checkpointing_enable sets): hooks run once, the layer's work is recomputed
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = checkpoint

    def forward(self, x: torch.Tensor, cache=None, padding: Padding | None = None) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self._layer, x, cache, padding)
        return self._layer(x, cache, padding)

    def _layer(self, x: torch.Tensor, cache, padding: Padding | None) -> torch.Tensor:
        x = x + mix(self.mixer, self.norm1(x), cache, padding)
        return x + self.mlp(self.norm2(x))


class DiscreteStack(nn.Module):
    """``num_layers`` distinct blocks, each applied once."""

    def __init__(self, cfg):
        super().__init__()
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.last_nfe = 0
        self.record: list[torch.Tensor] | None = None  # a list: every layer's output goes in
        # layer dropout in training ([train.layer_skip], set by the trainer): each layer's
        # probability that a sequence skips it; None: every layer runs
        self.layer_drop: list[float] | None = None

    def forward(self, x: torch.Tensor, state: DecodeState | None = None,
                padding: Padding | None = None, evaluate=None) -> torch.Tensor:
        """``evaluate(module, *args)`` (a frozen state's evaluator, e.g. a compiled call):
        how each layer runs; None: directly."""
        drop = self.layer_drop if self.training and state is None else None
        for i, layer in enumerate(self.layers):
            cache = None
            if state is not None:
                cache = state.cache(("layer", i), layer.mixer.cache_factory)
            out = evaluate(layer, x, cache) if evaluate is not None else layer(x, cache, padding)
            if drop is not None and drop[i] > 0:
                # a skipped sequence passes the layer's input on unchanged (global RNG, as
                # dropout's, so a seeded or resumed run skips alike)
                keep = torch.rand(x.shape[0], 1, 1, device=x.device) >= drop[i]
                out = torch.where(keep, out, x)
            x = out
            if self.record is not None:
                self.record.append(x)
        self.last_nfe = len(self.layers)
        return x

    def resume(self, x: torch.Tensor, state: DecodeState, start: int) -> torch.Tensor:
        """Layers ``start``.. over ``x``, the output of layer ``start - 1`` (eval, through
        ``state``'s caches of those layers): how a verifying pass goes on from the states
        its first-layer drafts already made (speculative decoding with ``Draft(layers=n)``).
        The caller moves ``state.pos`` on."""
        for i in range(start, len(self.layers)):
            layer = self.layers[i]
            x = layer(x, state.cache(("layer", i), layer.mixer.cache_factory))
        self.last_nfe = len(self.layers) - start
        return x


class ODEBlock(nn.Module):
    """h(t1) = h(t0) + integral of f(t, h) dt, one field (shared weights) for every step.

    In decoding, every evaluation of f gets its own cache, keyed by (block, evaluation index):
    a fixed-grid solve is a fixed graph of evaluations, and in decoder mode the evaluation at
    position i depends only on positions <= i of the same evaluation, so the caches make
    incremental decoding exact.

    With ``model.ode_kv = "step"`` the mixer's memory (what later tokens read) is written once
    per solver step, from the mixer input at the step's start (t_n, h_n), into one cache per
    (block, step) that every evaluation of the step reads with its own queries; with
    ``"block"``, once per block from its input, into one cache. Training (a cache made for the
    forward) and decoding (the state's) run the same writes and reads.
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
        self.last_token_nfe: torch.Tensor | None = None
        self.last_regularizers: dict[str, torch.Tensor] = {}
        self.step_states: list[torch.Tensor] = []
        self._calls = [0]
        self.gradient_checkpointing = False  # as TransformerBlock's
        self._gradient_checkpointing_func = checkpoint

    def forward(self, x: torch.Tensor, state: DecodeState | None = None,
                exit_rule: ExitRule | None = None,
                extras: SolveExtras | None = None,
                padding: Padding | None = None, evaluate=None) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # the whole solve recomputed in the backward pass (whatever ode_grad does inside
            # it), with the forward's random state: the same dropout masks
            return self._gradient_checkpointing_func(self._solve, x, state, exit_rule, extras,
                                                     padding, evaluate)
        return self._solve(x, state, exit_rule, extras, padding, evaluate)

    def _solve(self, x: torch.Tensor, state: DecodeState | None, exit_rule: ExitRule | None,
               extras: SolveExtras | None, padding: Padding | None,
               evaluate=None) -> torch.Tensor:
        """One solve of the block (model/solve.py): frozen compiled decoding a solver step at
        a time, the plain integration, or per-token exit."""
        run = Solve(self, state, extras, padding, evaluate)
        if run.frozen_steps(exit_rule):
            x = run.frozen(x)
        elif exit_rule is None:
            x = run.plain(x)
        else:
            x = run.with_exit(x, exit_rule)
        x = run.finish(x)
        if self.field.post_mlp:
            x = x + self.mlp(self.norm_mlp(x))
        return x


_WARNED: set[str] = set()  # adaptive solvers whose non-causality was announced


class ODEStack(nn.Module):
    """``num_layers`` ODE blocks, each with its own weights (CAT's ``--blocks``)."""

    def __init__(self, cfg):
        super().__init__()
        self.blocks = nn.ModuleList(ODEBlock(cfg, i) for i in range(cfg.num_layers))
        self.last_nfe = 0
        self.exit: ExitRule | None = None  # per-token exit (LanguageModel.set_exit)
        self.ladder = None  # per-token exit across solves (model/ladder.py; set_exit(ladder=))
        self.exit_totals = [0, 0]  # field evaluations and tokens since set_exit (eager only)
        self.extras: SolveExtras | None = None  # regularizers and STEER (the trainer's)
        self.last_regularizers: dict[str, torch.Tensor] = {}
        self.last_step_states: list[torch.Tensor] = []  # SolveExtras.readout's states
        self.last_token_nfe: torch.Tensor | None = None
        self.exact_cache = bool(getattr(self.blocks[0].solver, "fixed_grid", True))
        self.record: list[torch.Tensor] | None = None  # as DiscreteStack's
        if not self.exact_cache and cfg.mode == "decoder" and cfg.ode_solver not in _WARNED:
            _WARNED.add(cfg.ode_solver)  # once per solver and process: models are rebuilt often
            log.warning(
                "model.ode_solver = %r is adaptive: its step-size controller takes one error norm "
                "over the whole batch and sequence, so future tokens and other batch rows change "
                "earlier positions' outputs (the decoder is not exactly causal). Use a fixed-grid "
                "solver (euler, midpoint, heun, rk4, ...) for exact causality.", cfg.ode_solver)

    def clear_step_states(self) -> None:
        """Let go of the states SolveExtras.readout kept (and their graph)."""
        self.last_step_states = []
        for b in self.blocks:
            b.step_states = []

    @property
    def last_backward_nfe(self) -> int:
        """Field evaluations made by the backward pass of the last forward so far: the
        adjoint's backward solve, or the recomputation of checkpointed steps (0 for direct
        backpropagation, and before any backward)."""
        return sum(b._calls[0] - b.last_nfe for b in self.blocks)

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
        why = grad_refusal(cfg.ode_solver, cfg.ode_grad, adaptive, reversible, cfg.ode_steps)
        if why is not None:
            raise ConfigError(f"model.{why}" if why.startswith("ode_") else why)
        why = kv_refusal(cfg.ode_kv, cfg.mixer, cfg.ode_solver, cfg.ode_grad, adaptive,
                         reversible, takes_memory(MIXERS.component_class(cfg.mixer)),
                         cfg.mode == "encoder")
        if why is not None:
            raise ConfigError(why)
        if cfg.ode_kv != "evaluation" and not callable(
                getattr(FIELDS.component_class(cfg.field), "mixer_input", None)):
            raise ConfigError(
                f"model.ode_kv = {cfg.ode_kv!r} writes the mixer's memory from the field's "
                f"mixer input at a step or block's start, and the field {cfg.field!r} has no "
                f"mixer_input(t, h) (and a .mixer) to compute it with; use ode_kv = "
                f"'evaluation', or give the field that method.")
        if getattr(cfg, "ode_adjoint_norm", "default") == "seminorm" and not (
                adaptive and cfg.ode_grad == "adjoint"):
            raise ConfigError(
                f"model.ode_adjoint_norm = 'seminorm' sets the error norm of the adjoint's "
                f"adaptive backward solve; it needs ode_grad = 'adjoint' with an adaptive "
                f"solver (tsit5, dopri5, ...), not ode_grad = {cfg.ode_grad!r} with "
                f"{cfg.ode_solver!r}.")
        if cfg.ode_dt_embedding and adaptive:
            raise ConfigError(f"model.ode_dt_embedding conditions the field on a fixed step "
                              f"size; the adaptive {cfg.ode_solver!r} chooses its own. Use a "
                              f"fixed-grid solver, or leave ode_dt_embedding off.")
        if not cfg.ode_t1 > cfg.ode_t0:
            raise ConfigError(f"model.ode_t1 ({cfg.ode_t1}) must be greater than model.ode_t0 "
                              f"({cfg.ode_t0}).")

    def forward(self, x: torch.Tensor, state: DecodeState | None = None,
                padding: Padding | None = None, evaluate=None) -> torch.Tensor:
        """``evaluate``: as :class:`DiscreteStack`'s (each solver step, or each field
        evaluation under per-token exit or with a reversible solver)."""
        if state is not None and not self.exact_cache:
            raise ValueError("an adaptive ODE solver cannot be decoded incrementally (its steps "
                             "depend on the whole sequence); use use_cache=False.")
        if self.exit is not None:
            check_exit_solver(self.blocks[0].solver, self.blocks[0].cfg.ode_solver)
            if self.extras is not None and self.training:
                raise ValueError("per-token exit is an inference setting; it cannot run in a "
                                 "training step that regularizes the solve or moves its end "
                                 "time (train.regularize: kinetic_weight, jacobian_weight, "
                                 "steer): call model.set_exit(None) before training.")
        token_nfe = None
        if self.ladder is not None:
            if self.training and torch.is_grad_enabled():
                raise ValueError("the exit ladder is an inference setting; call "
                                 "model.set_exit(None) before training.")
            x, token_nfe = ladder.run(self, self.ladder, x, state, padding, evaluate)
            if self.record is not None:
                self.record.append(x)
        for block in self.blocks if self.ladder is None else ():
            x = block(x, state, self.exit, self.extras, padding, evaluate)
            if self.record is not None:
                self.record.append(x)
        regs: dict[str, torch.Tensor] = {}
        for b in self.blocks:  # summed over blocks
            for name, value in b.last_regularizers.items():
                regs[name] = regs[name] + value if name in regs else value
        set_plain(self, last_nfe=sum(b.last_nfe for b in self.blocks), last_regularizers=regs,
                  # the states between solver steps, every block's (SolveExtras.readout)
                  last_step_states=[h for b in self.blocks for h in b.step_states],
                  # field evaluations per token, over every block
                  last_token_nfe=(token_nfe if token_nfe is not None else
                                  sum(b.last_token_nfe for b in self.blocks)
                                  if self.exit is not None else None))
        if self.last_token_nfe is not None and not torch.compiler.is_compiling():
            self.exit_totals[0] += int(self.last_token_nfe.sum())
            self.exit_totals[1] += self.last_token_nfe.numel()
        return x


DEPTHS.register("discrete", DiscreteStack)
DEPTHS.register("ode", ODEStack)
