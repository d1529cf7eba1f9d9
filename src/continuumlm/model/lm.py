"""The language model: embedding -> depth (mixers inside blocks or ODE fields) -> norm -> head."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..atomic import atomic_folder
from ..config import ModelConfig
from ..errors import ConfigError
from ..mixers.padding import Padding
from ..nn import make_norm
from ..registry import DECODERS, DEPTHS, SOLVERS
from . import memory
from .cache import CacheMemory, DecodeState

# importing depth registers the built-in depths
from .exit import ExitRule, check_exit_solver
from .ladder import build as build_ladder
from .weights import CONFIG_FILE, MODEL_TYPE, WEIGHTS_FILE, load_weights, read_model_config

log = logging.getLogger("continuumlm")

# the model folder's files (model/weights.py reads them): importable from here as before
__all__ = ["CONFIG_FILE", "MODEL_TYPE", "WEIGHTS_FILE", "LanguageModel", "load_weights"]


class LanguageModel(nn.Module):
    """Autoregressive (decoder) or bidirectional (encoder) Transformer language model.

    ``model(idx, targets=None) -> (logits, loss)`` with logits (B, T, vocab) and loss the mean
    cross-entropy over targets (ignoring -1), or None without targets.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ConfigError("model.vocab_size must be positive to build a model (the trainer "
                              "fills it in from the tokenizer; set it when building by hand).")
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = (nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
                        if cfg.position == "learned" else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.depth = DEPTHS[cfg.depth](cfg)
        self.norm_f = make_norm(cfg.hidden_size, cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # model.exit_gate: P(a step's greedy token is the full solve's), read from norm_f(h)
        self.exit_gate = nn.Linear(cfg.hidden_size, 1) if cfg.exit_gate else None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * number of residual additions).
        for m in self.modules():
            if getattr(m, "residual_proj", False):
                nn.init.normal_(m.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if getattr(m, "keep_init", False):
            return
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    # ------------------------------------------------------------------ forward

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.pos_emb is not None:
            n -= self.pos_emb.weight.numel()
        return n

    @property
    def last_nfe(self) -> int:
        """Block (vector field) evaluations in the last forward pass."""
        return self.depth.last_nfe

    @property
    def last_regularizers(self) -> dict[str, torch.Tensor]:
        """The ODE regularizers of the last training forward ({"kinetic": ..., "jacobian":
        ...}, each the per-token integral averaged, summed over blocks), as the trainer asked
        for them through ``depth.extras``; empty otherwise."""
        return getattr(self.depth, "last_regularizers", {})

    @property
    def last_backward_nfe(self) -> int:
        """Field evaluations the backward pass of the last forward made (adjoint solve or
        checkpoint recomputation); 0 for a discrete stack or direct backpropagation."""
        return getattr(self.depth, "last_backward_nfe", 0)

    @property
    def last_token_nfe(self) -> torch.Tensor | None:
        """With per-token exit (:meth:`set_exit`): the field evaluations each token of the last
        forward took part in, (B, T), summed over blocks; otherwise None (every token took
        ``last_nfe``)."""
        return getattr(self.depth, "last_token_nfe", None)

    def set_exit(self, threshold: float | None, criterion: str = "state",
                 ladder: list[str] | None = None) -> None:
        """Per-token adaptive depth at inference: in every ODE block, a token whose state has
        settled after a solver step (``criterion`` below ``threshold``; see
        :class:`continuumlm.model.exit.ExitRule`) stops integrating for the rest of the
        block. ``None`` turns it off. Needs ``depth = "ode"`` with a fixed-grid solver; the
        model stays exactly causal and cached decoding equals recompute.

        ``ladder`` (coarse solves, "SOLVER:STEPS", e.g. ["euler:1", "rk4:1"]): exit across
        whole solves instead (:mod:`continuumlm.model.ladder`): each token tries them in
        order, then the own solve, and stops at the first whose ``criterion`` ("confidence"
        or "gate") is below ``threshold``. Needs one ODE block with ``ode_kv = "block"``."""
        if threshold is None:
            if hasattr(self.depth, "exit"):
                self.depth.exit = None
                self.depth.ladder = None
            return
        if ladder is not None:
            built = build_ladder(self, list(ladder), threshold, criterion, self._exit_readout,
                                 self.gate_logits if self.exit_gate is not None else None)
            self.depth.exit = None
            self.depth.ladder = built
            self.depth.exit_totals = [0, 0]
            return
        if self.config.depth != "ode":
            raise ValueError("per-token exit needs depth = 'ode'; a discrete stack has no "
                             "solver steps to stop early.")
        check_exit_solver(self.depth.blocks[0].solver, self.config.ode_solver)
        if criterion == "gate" and self.exit_gate is None:
            raise ValueError("the 'gate' exit criterion reads the model's halting gate, and "
                             "this model has none: train one with model.exit_gate = true and "
                             "train.any_depth.gate_weight > 0, or use criterion 'state' or "
                             "'kl'.")
        self.depth.ladder = None
        # a bound method, not a closure: a copy (deepcopy) reads its own head, and it pickles
        self.depth.exit = ExitRule(float(threshold), criterion, readout=self._exit_readout,
                                   gate=self.gate_logits if self.exit_gate is not None
                                   else None)
        self.depth.exit_totals = [0, 0]

    def _exit_readout(self, h: torch.Tensor) -> torch.Tensor:
        """The logits the "kl" exit criterion compares between steps."""
        return self.lm_head(self.norm_f(h))

    def gate_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The halting gate's logit for states ``h`` (..., C): sigmoid of it is the
        probability that their greedy token is already the full solve's (model.exit_gate)."""
        return self.exit_gate(self.norm_f(h)).squeeze(-1)

    def penalty(self) -> torch.Tensor:
        """Sum of the regularizers that mixers expose (added to the loss by the trainer)."""
        terms = [m.penalty() for m in self.modules() if m is not self and hasattr(m, "penalty")]
        return torch.stack(terms).sum() if terms else self.tok_emb.weight.new_zeros(())

    def hidden_states(self, idx: torch.Tensor | None, state: DecodeState | None = None,
                      attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None,
                      embeds: torch.Tensor | None = None,
                      record: list | None = None) -> torch.Tensor:
        """Final normalized hidden states (B, T, C); extends ``state`` when given.

        ``attention_mask`` (1 real, 0 pad): a padded batch, over this call's T tokens or over
        every token so far (the state's and these, transformers' convention); each row's
        outputs at its real tokens are those of the row alone (``mixers/padding.py``).
        ``position_ids`` (B, T): each token's position, when not counted from each row's
        first real token. ``embeds`` (B, T, C): input embeddings instead of ``idx``.
        ``record``: a list that receives the input of the depth module and each layer's (or
        ODE block's) output, the last one normalized as returned (transformers'
        ``hidden_states``: num_layers + 1 tensors)."""
        x = self.tok_emb(idx) if embeds is None else embeds
        B, T = x.shape[:2]
        pos0 = state.pos if state is not None else 0
        cfg = self.config
        if state is not None:
            state.check_solve(cfg)
        padding = self._padding(B, T, state, attention_mask, position_ids, x.device)
        if self.pos_emb is not None:
            # a padded batch: each row's positions count from its first real token, so the
            # rows' longest, not the columns (pads included), must fit the table
            longest = pos0 + T if padding is None or torch.compiler.is_compiling() \
                else int(padding.positions.max()) + 1
            if longest > cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {longest} tokens is longer than max_seq_len = {cfg.max_seq_len}, "
                    f"the size of this model's learned position table; use a shorter context or a "
                    f"model with position = 'rope'.")
            x = x + self.pos_emb(padding.positions if padding is not None
                                 else torch.arange(pos0, pos0 + T, device=x.device))
        x = self.drop(x)
        if record is not None:
            if not hasattr(self.depth, "record"):
                raise ValueError(f"the depth module {type(self.depth).__name__} does not "
                                 f"record its layers' outputs (a `record` list attribute), so "
                                 f"hidden states cannot be returned.")
            record.append(x)
            self.depth.record = record
        try:
            x = self.depth(x, state, padding) if padding is not None else self.depth(x, state)
        finally:
            self.depth.record = None
        if state is not None:
            state.pos += T
            state.keys = padding.keys if padding is not None else None
        x = self.norm_f(x)
        if record is not None:
            record[-1] = x
        return x

    @staticmethod
    def _padding(B: int, T: int, state: DecodeState | None, mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, device) -> Padding | None:
        """The :class:`Padding` of a call, or None when every token so far is real and the
        positions are the usual ones (the unpadded path, which every mixer takes)."""
        pos0 = state.pos if state is not None else 0
        before = state.keys if state is not None else None
        if mask is None and before is None and position_ids is None:
            return None
        if mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=device)
        mask = mask.to(device=device, dtype=torch.bool)
        if mask.dim() != 2 or mask.shape[0] != B or mask.shape[1] not in (T, pos0 + T):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; it must be "
                             f"(batch, tokens) over this call's {T} tokens or over all "
                             f"{pos0 + T} so far, batch {B}.")
        if mask.shape[1] == T and pos0:  # this call's tokens only: the state knows the rest
            past = before if before is not None else mask.new_ones(B, pos0)
            mask = torch.cat([past, mask], 1)
        if position_ids is not None:
            position_ids = position_ids.to(device).expand(B, T)
        if torch.compiler.is_compiling():  # no data-dependent branch in a traced graph
            return Padding.from_mask(mask, T, position_ids)
        if position_ids is not None:
            default = torch.arange(pos0, pos0 + T, device=device)
            if bool(mask.all()) and bool((position_ids == default).all()):
                return None
        elif before is None and bool(mask.all()):
            return None
        return Padding.from_mask(mask, T, position_ids)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                state: DecodeState | None = None, targets_only: bool = False):
        """(logits, loss): logits (B, T, vocab), and the mean cross-entropy over the targets
        that are not -1 (None without targets). ``targets_only``: the head is applied only at
        the positions with a target, so logits are (number of targets, vocab) in row-major
        order; the loss is the same at a fraction of the vocabulary-sized work (a task whose
        targets are sparse, like MQAR's queries)."""
        h = self.hidden_states(idx, state)
        if targets_only:
            if targets is None:
                raise ValueError("targets_only needs targets: it keeps the positions that have one.")
            keep = targets >= 0
            logits = self.lm_head(h[keep])
            return logits, F.cross_entropy(_upcast(logits), targets[keep])
        logits = self.lm_head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(_upcast(logits.view(-1, logits.shape[-1])),
                                   targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def set_solver(self, ode_solver: str | None = None, ode_steps: int | None = None,
                   ode_grad: str | None = None) -> None:
        """Integrate the trained fields with another solver or number of steps, without
        retraining ("anytime depth"). Only for ``depth = "ode"``; a solver with weights of its
        own (``rk2_gated``) can be neither swapped in nor out. The gradient mode must suit the
        new solver; evaluation, which takes no gradients, passes ``ode_grad="direct"``. A new solver module takes the model's training or evaluation mode."""


        if self.config.depth != "ode":
            raise ValueError("set_solver needs depth = 'ode'; a discrete stack has no solver.")
        changes = {k: v for k, v in (("ode_solver", ode_solver), ("ode_steps", ode_steps),
                                     ("ode_grad", ode_grad)) if v is not None}
        new = dataclasses.replace(self.config, **changes)  # validated like any config
        if new.ode_solver == "reversible_heun" and self.config.ode_solver != "reversible_heun":
            log.warning("set_solver: integrating a field trained with %s by reversible_heun; "
                        "the method is stable only for oscillatory dynamics (lambda dt on the "
                        "imaginary axis, |lambda dt| < 1), and its reversible backward checks "
                        "that it can rebuild the states (model.reversible_tol).",
                        self.config.ode_solver)
        for block in self.depth.blocks:
            if new.ode_solver == self.config.ode_solver:  # the same method: keep its weights
                if getattr(block.solver, "reversible", False):
                    block.solver.tol = new.reversible_tol
                block.cfg = new
                continue
            solver = SOLVERS[new.ode_solver](new)
            if any(True for _ in solver.parameters()) or any(True for _ in block.solver.parameters()):
                raise ValueError(f"cannot switch between {self.config.ode_solver!r} and "
                                 f"{new.ode_solver!r}: rk2_gated has trained weights of its own "
                                 f"(its step count can change: set_solver(ode_steps=N)).")
            if isinstance(solver, torch.nn.Module):  # the model's mode, as if it had been
                solver.train(self.training)  # there when model.eval() / .train() was called
            block.solver, block.cfg = solver, new
        self.depth.exact_cache = bool(getattr(self.depth.blocks[0].solver, "fixed_grid", True))
        self.config = new

    # ------------------------------------------------------------------ decoding

    def init_state(self, batch_size: int, rewind: int = 0) -> DecodeState:
        """An empty decoding state; feed tokens with :meth:`step`. ``rewind``: the state can
        be cut back (``state.crop(length)``) by at least this many of its latest tokens."""
        return DecodeState(batch_size, rewind)

    def cacheless_mixers(self) -> list[str]:
        """The mixers of this model that keep no decoding cache (a plugin's ``cache_factory =
        None``): such a model decodes only by recomputing the context (``use_cache=False``)."""
        return sorted({self.config.mixer for m in self.modules()
                       if m is not self and hasattr(m, "cache_factory")
                       and m.cache_factory is None})

    def check_cacheable(self, what: str = "decoding with caches") -> None:
        """A ValueError naming the mixer when this model has one without a decoding cache."""
        names = self.cacheless_mixers()
        if names:
            raise ValueError(
                f"{what} needs every mixer's decoding cache, and the mixer "
                f"{', '.join(map(repr, names))} has no decoding cache (its cache_factory is "
                f"None); decode by recomputing the context instead: use_cache=False "
                f"(--no-cache on the command line).")

    @torch.no_grad()
    def cache_memory(self) -> CacheMemory | None:
        """What decoding keeps per sequence (bytes per token and fixed bytes, in this model's
        dtype and cache layout), measured on a state after one token; None for a model that
        does not decode with caches (an adaptive solver recomputes; a mixer without a cache,
        :meth:`cacheless_mixers`)."""
        if not getattr(self.depth, "exact_cache", True) or self.cacheless_mixers():
            return None
        device = next(self.parameters()).device
        state = self.init_state(1)
        was = self.training
        self.eval()
        try:
            self.step(torch.zeros(1, 1, dtype=torch.long, device=device), state)
        finally:
            self.train(was)
        return state.memory()

    @torch.no_grad()
    def step(self, idx: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """Consume tokens (B, t) — a whole prompt or one new token — and return the logits of the
        last one, (B, vocab), together with the extended state."""
        if idx.shape[0] != state.batch_size:
            raise ValueError(f"state was made for batch size {state.batch_size}, got {idx.shape[0]}.")
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError(f"step() takes token ids of shape (batch, tokens) with at least one "
                             f"token, got shape {tuple(idx.shape)}.")
        if state.static is not None:
            raise ValueError("this decoding state is frozen for generate(compile=True)'s one-token "
                             "steps; start a new one with init_state() to use step().")
        if not state:  # the first tokens of this state: every mixer must keep a cache
            self.check_cacheable("step() through a decoding state")
        h = self.hidden_states(idx, state)
        return self.lm_head(h[:, -1]), state

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None,
                        greedy: bool = False, use_cache: bool = True,
                        generator: torch.Generator | None = None,
                        eos_token_id: int | None = None, compile: bool = False,
                        cuda_graph: bool | None = None,
                        threads=None, draft=None) -> Iterator[torch.Tensor]:
        """Yield the next token ids (B,) one step at a time: a new
        :class:`continuumlm.decoding.Decoder` of this model (``compile``, ``cuda_graph``)
        streams them (see ``Decoder.stream``: ``threads``, ``draft``). Keep a ``Decoder`` to
        reuse what it compiled and recorded across calls."""
        decoder = DECODERS["default"](self, compile=compile, cuda_graph=cuda_graph)
        return decoder.stream(idx, max_new_tokens, temperature, top_k, top_p, greedy,
                              use_cache, generator, eos_token_id, threads, draft)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
                 use_cache: bool = True, generator: torch.Generator | None = None,
                 eos_token_id: int | None = None, compile: bool = False,
                 cuda_graph: bool | None = None, threads=None, draft=None) -> torch.Tensor:
        """Return (B, T + new) token ids: the prompt followed by sampled tokens (fewer than
        max_new_tokens only when every row produced ``eos_token_id``). ``compile``,
        ``cuda_graph``, ``threads`` and ``draft`` (self-speculative decoding): see
        :meth:`generate_stream`."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, greedy,
                                        use_cache, generator, eos_token_id, compile,
                                        cuda_graph, threads, draft))
        return torch.cat([idx] + [t[:, None] for t in new], dim=1)

    @torch.no_grad()
    def frozen_logits(self, idx: torch.Tensor, state: DecodeState,
                      evaluate=None) -> torch.Tensor:
        """The static step's ``width`` tokens (B, width) through a frozen state
        (``state.freeze``): logits (B, width, vocab), each token's (one token: the decoding
        step; several: speculative decoding's verifying pass). No Python value read here
        depends on the position, so a compiled graph of it serves every token.
        ``evaluate(module, *args)``: how the depth runs each unit that repeats (a solver step,
        a layer; see :mod:`continuumlm.decoding.frozen`), None: directly. The caller moves the
        state on with ``state.advance()``."""
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(state.static.pos)
        x = self.depth(x, state) if evaluate is None else self.depth(x, state, evaluate=evaluate)
        return self.lm_head(self.norm_f(x))

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (no pickle), whole or not at all
        (``atomic.atomic_folder``: a crash leaves the folder as it was). ``config.json`` names
        its ``model_type``, so transformers' Auto classes read the folder (``import
        continuumlm.hf``)."""
        from safetensors.torch import save_model

        with atomic_folder(directory) as tmp:
            save_model(self, str(tmp / WEIGHTS_FILE))
            (tmp / CONFIG_FILE).write_text(
                json.dumps({"model_type": MODEL_TYPE, **self.config.to_dict()}, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu"):
        cfg = read_model_config(directory)
        device = torch.device(map_location)
        check_memory(cfg, device if device.type in ("cpu", "cuda") else "cpu", training=False)
        model = cls(cfg)
        load_weights(model, directory)
        model = model.to(device)
        if cfg.tie_embeddings:  # a move that makes new Parameter objects (meta, some
            model.lm_head.weight = model.tok_emb.weight  # accelerators) would untie them
        return model



def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 for the cross-entropy; float32 and float64 as they are
    (a float64 model's loss stays float64, so gradient checks through it keep its precision)."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def check_memory(cfg: ModelConfig, device: torch.device | str = "cpu", training: bool = True,
                 shards: int = 1, copies: int = 1) -> int:
    """:func:`continuumlm.model.memory.check_memory` for this model."""
    return memory.check_memory(cfg, device, training, shards, copies, build=LanguageModel)
