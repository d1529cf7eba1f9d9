"""The language model: embedding -> depth (mixers inside blocks or ODE fields) -> norm -> head."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, first_line
from ..eval.sampling import check_sampling_args, sample_next
from ..nn import make_norm
from .cache import DecodeState
from .depth import DEPTHS

log = logging.getLogger("continuumlm")

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still get: free memory of a CUDA device, or
    MemAvailable plus free swap on Linux; None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines()
                    if ":" in line)
        return (int(info["MemAvailable"].split()[0]) + int(info["SwapFree"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_memory(cfg: ModelConfig, device: torch.device | str = "cpu", training: bool = True,
                 shards: int = 1, copies: int = 1) -> int:
    """Refuse a model that cannot fit before any of it is allocated (a 65,536-wide model would
    otherwise end in an allocator traceback, or the kernel killing the process). The model is
    built on the meta device to count its tensors; the need is a lower bound: float32 weights
    and buffers, plus gradients and Adam's two moments when ``training`` (split over ``shards``
    FSDP ranks), times ``copies`` processes sharing the machine. Activations come on top.
    Returns the parameter count."""
    device = torch.device(device)

    def count(layers: int) -> tuple[int, int]:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            model = LanguageModel(dataclasses.replace(cfg, num_layers=layers))
        return (sum(p.numel() for p in model.parameters()),
                sum(b.numel() for b in model.buffers()))

    # Sizes are affine in num_layers (every depth builds num_layers alike blocks), so two small
    # meta models give the count; building 100,000 meta layers would take minutes.
    (p1, b1), (p2, b2) = count(1), count(2)
    params = p1 + (cfg.num_layers - 1) * (p2 - p1)
    buffers = b1 + (cfg.num_layers - 1) * (b2 - b1)
    need = copies * 4 * (params + buffers + (3 * params // shards if training else 0))
    free = available_memory(device)
    if free is not None and need > free:
        gib = 2 ** 30
        what = ("weights, buffers, gradients and Adam state in float32" if training else
                "weights and buffers in float32")
        tables = (f" and {buffers:,} buffer values (constant tables such as the rotary "
                  f"positions, which grow with max_seq_len)" if buffers > params else "")
        raise ConfigError(
            f"the model (hidden_size {cfg.hidden_size}, num_layers {cfg.num_layers}, "
            f"vocab_size {cfg.vocab_size}, max_seq_len {cfg.max_seq_len}) has {params:,} "
            f"parameters{tables}; its {what} alone need {need / gib:.1f} GiB"
            f"{f' for {copies} processes' if copies > 1 else ''}, but {device.type} has "
            f"{free / gib:.1f} GiB available. Choose smaller sizes, or a device with more memory.")
    return params


class LanguageModel(nn.Module):
    """Autoregressive (decoder) or bidirectional (encoder) Transformer language model.

    ``model(idx, targets=None) -> (logits, loss)`` with logits (B, T, vocab) and loss the mean
    cross-entropy over targets (ignoring -1), or None without targets.
    """

    _compile_failed = False  # set when compiled decoding failed once: decode eagerly after
    _open_streams = 0  # generations in progress (see generate_stream)
    _mode_before_streams = False

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

    def penalty(self) -> torch.Tensor:
        """Sum of the regularizers that mixers expose (added to the loss by the trainer)."""
        terms = [m.penalty() for m in self.modules() if m is not self and hasattr(m, "penalty")]
        return torch.stack(terms).sum() if terms else self.tok_emb.weight.new_zeros(())

    def hidden_states(self, idx: torch.Tensor, state: DecodeState | None = None) -> torch.Tensor:
        """Final normalized hidden states (B, T, C); extends ``state`` when given."""
        B, T = idx.shape
        pos0 = state.pos if state is not None else 0
        cfg = self.config
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            if pos0 + T > cfg.max_seq_len:
                raise ValueError(
                    f"sequence of {pos0 + T} tokens is longer than max_seq_len = {cfg.max_seq_len}, "
                    f"the size of this model's learned position table; use a shorter context or a "
                    f"model with position = 'rope'.")
            x = x + self.pos_emb(torch.arange(pos0, pos0 + T, device=idx.device))
        x = self.depth(self.drop(x), state)
        if state is not None:
            state.pos += T
        return self.norm_f(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                state: DecodeState | None = None):
        logits = self.lm_head(self.hidden_states(idx, state))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    def set_solver(self, ode_solver: str | None = None, ode_steps: int | None = None,
                   ode_grad: str | None = None) -> None:
        """Integrate the trained fields with another solver or number of steps, without
        retraining ("anytime depth"). Only for ``depth = "ode"``; a solver with weights of its
        own (``rk2_gated``) can be neither swapped in nor out. The gradient mode must suit the
        new solver; evaluation, which takes no gradients, passes ``ode_grad="direct"``."""
        import dataclasses

        from ..ode import SOLVERS, AdaptiveSolver

        if self.config.depth != "ode":
            raise ValueError("set_solver needs depth = 'ode'; a discrete stack has no solver.")
        changes = {k: v for k, v in (("ode_solver", ode_solver), ("ode_steps", ode_steps),
                                     ("ode_grad", ode_grad)) if v is not None}
        new = dataclasses.replace(self.config, **changes)  # validated like any config
        for block in self.depth.blocks:
            solver = SOLVERS[new.ode_solver](new)
            if any(True for _ in solver.parameters()) or any(True for _ in block.solver.parameters()):
                raise ValueError(f"cannot switch between {self.config.ode_solver!r} and "
                                 f"{new.ode_solver!r}: rk2_gated has trained weights of its own.")
            block.solver, block.cfg = solver, new
        self.depth.exact_cache = not isinstance(self.depth.blocks[0].solver, AdaptiveSolver)
        self.config = new

    # ------------------------------------------------------------------ decoding

    def init_state(self, batch_size: int) -> DecodeState:
        """An empty decoding state; feed tokens with :meth:`step`."""
        return DecodeState(batch_size)

    @torch.no_grad()
    def step(self, idx: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """Consume tokens (B, t) — a whole prompt or one new token — and return the logits of the
        last one, (B, vocab), together with the extended state."""
        if idx.shape[0] != state.batch_size:
            raise ValueError(f"state was made for batch size {state.batch_size}, got {idx.shape[0]}.")
        if state.static is not None:
            raise ValueError("this decoding state is frozen for generate(compile=True)'s one-token "
                             "steps; start a new one with init_state() to use step().")
        h = self.hidden_states(idx, state)
        return self.lm_head(h[:, -1]), state

    def generate_stream(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                        top_k: int | None = None, top_p: float | None = None,
                        greedy: bool = False, use_cache: bool = True,
                        generator: torch.Generator | None = None,
                        eos_token_id: int | None = None,
                        compile: bool = False) -> Iterator[torch.Tensor]:
        """Yield the next token ids (B,) one step at a time.

        ``compile=True`` (with the cache) decodes through ``torch.compile`` graphs: after the
        prompt, the state is frozen to fixed-capacity buffers with the position held in
        tensors, so one graph serves every token until the buffers are full; they then double,
        and the next capacity has a graph of its own (per batch size; compiled on first use,
        kept for later generations). A compiler failure warns once and decodes eagerly.
        Bad arguments raise here, when the stream is made, not at its first token.
        """
        cfg = self.config
        if cfg.mode != "decoder":
            raise ValueError("generation needs mode = 'decoder'; this model is an encoder.")
        check_sampling_args(temperature, top_k, top_p, greedy)
        if idx.dim() != 2 or idx.shape[1] == 0:
            raise ValueError("the prompt must hold at least one token, shaped (batch, length).")
        if cfg.position == "learned" and idx.shape[1] > cfg.max_seq_len:
            raise ValueError(
                f"the prompt has {idx.shape[1]} tokens, more than max_seq_len = {cfg.max_seq_len} "
                f"of this model's learned positions; shorten it to at most {cfg.max_seq_len} "
                f"tokens (its last ones), or use a RoPE model.")
        if cfg.position == "learned" and idx.shape[1] + max_new_tokens - 1 > cfg.max_seq_len:
            raise ValueError(
                f"prompt ({idx.shape[1]} tokens) plus {max_new_tokens} new tokens exceeds "
                f"max_seq_len = {cfg.max_seq_len} of this model's learned positions; ask for at most "
                f"{max(cfg.max_seq_len - idx.shape[1] + 1, 0)} new tokens or use a RoPE model.")
        return self._token_stream(idx, max_new_tokens, temperature, top_k, top_p, greedy,
                                  use_cache, generator, eos_token_id, compile)

    @torch.no_grad()
    def _token_stream(self, idx, max_new_tokens, temperature, top_k, top_p, greedy, use_cache,
                      generator, eos_token_id, compile) -> Iterator[torch.Tensor]:
        cfg = self.config
        if use_cache and not getattr(self.depth, "exact_cache", True):
            log.debug("generate: %s solves cannot be cached exactly; recomputing the whole "
                      "context for every token", cfg.ode_solver)
            use_cache = False
        # streams may interleave: the model leaves eval mode only when the last one ends
        if self._open_streams == 0:
            self._mode_before_streams = self.training
        self._open_streams += 1
        self.eval()
        try:
            seq = idx
            done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
            state = self.init_state(idx.shape[0]) if use_cache else None
            logits = self.step(idx, state)[0] if use_cache else None
            token_fn = None
            if use_cache and compile and max_new_tokens > 1:
                token_fn = self._static_decoder(state)
            for i in range(max_new_tokens):
                if not use_cache:
                    logits = self.lm_head(self.hidden_states(seq)[:, -1])
                nxt = sample_next(logits, temperature, top_k, top_p, greedy, generator)
                if eos_token_id is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                    done |= nxt == eos_token_id
                yield nxt
                if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                    break
                if token_fn is not None:
                    logits = token_fn(nxt[:, None], state)
                    state.advance()
                elif use_cache:
                    logits = self.step(nxt[:, None], state)[0]
                else:
                    seq = torch.cat([seq, nxt[:, None]], dim=1)
        finally:
            self._open_streams -= 1
            if self._open_streams == 0:
                self.train(self._mode_before_streams)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, greedy: bool = False,
                 use_cache: bool = True, generator: torch.Generator | None = None,
                 eos_token_id: int | None = None, compile: bool = False) -> torch.Tensor:
        """Return (B, T + new) token ids: the prompt followed by sampled tokens (fewer than
        max_new_tokens only when every row produced ``eos_token_id``). ``compile``: see
        :meth:`generate_stream`."""
        new = list(self.generate_stream(idx, max_new_tokens, temperature, top_k, top_p, greedy,
                                        use_cache, generator, eos_token_id, compile))
        return torch.cat([idx] + [t[:, None] for t in new], dim=1)

    @torch.no_grad()
    def _static_token_logits(self, idx: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One token (B, 1) through a frozen state: logits (B, vocab). No Python value read
        here depends on the position, so a compiled graph of it serves every token. The
        caller moves the state on with ``state.advance()``."""
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(state.static.pos)
        x = self.depth(x, state)
        return self.lm_head(self.norm_f(x)[:, -1])

    def _static_decoder(self, state: DecodeState, compile: bool = True,
                        min_capacity: int = 64):
        """Freeze ``state`` and return the (compiled, unless ``compile`` is False) one-token
        step ``fn(ids (B, 1), state) -> logits (B, vocab)``.

        Capacities are powers of two (at least ``min_capacity``) that grow with the sequence:
        the state is frozen at the smallest one that holds the next token and refrozen at twice
        the size when it is full. A frozen attention step reads its whole buffer (the mask
        hides the tail), and on CPU reading the caches of every stage evaluation is a large
        share of a token's time, so a buffer sized to the final length would make every early
        token pay for the last; with doubling, each token reads fewer than twice the positions
        it needs.
        Each capacity is one static-shape graph (a symbolic-capacity graph was slower to
        compile and to run on CPU), shared by every generation that reaches it: generations of
        any length compile at most one graph per power of two. A mixer whose step does not
        read the buffers' length (DeltaNet) keeps one graph throughout."""
        device = self.tok_emb.weight.device
        state.freeze(_capacity_for(state.pos + 1, min_capacity), device)

        def grow(st: DecodeState) -> None:
            if st.pos >= st.static.capacity:
                st.freeze(2 * st.static.capacity, device)

        if not compile:
            def eager(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
                grow(st)
                return self._static_token_logits(ids, st)
            return eager

        def step(ids: torch.Tensor, st: DecodeState) -> torch.Tensor:
            grow(st)
            if not self._compile_failed:
                try:
                    # strides are part of the guards: a contiguous (B, 1) every time
                    with _recompile_limit(_RECOMPILE_LIMIT):
                        return _compiled_token_logits()(self, ids.contiguous(), st)
                except _compile_errors() as e:
                    # fullgraph: tracing and compiling end before anything runs, so the state
                    # is untouched and the eager step below consumes this token exactly once
                    log.warning("generate(compile=True): torch.compile failed (%s: %s); "
                                "decoding eagerly.", type(e).__name__,
                                first_line(e))
                    self._compile_failed = True  # not again for this model
            return self._static_token_logits(ids, st)

        return step

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (no pickle)."""
        from safetensors.torch import save_model

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        save_model(self, str(directory / WEIGHTS_FILE))

    @classmethod
    def from_pretrained(cls, directory: str | Path, map_location: str | torch.device = "cpu"):
        from safetensors import SafetensorError
        from safetensors.torch import load_model

        directory = Path(directory)
        cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise CheckpointError(f"{p} is missing; a model folder holds {CONFIG_FILE} and "
                                      f"{WEIGHTS_FILE} (written by save_pretrained or training).")
        try:
            cfg_dict = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); the file is corrupt.") from None
        if not isinstance(cfg_dict, dict):
            raise CheckpointError(f"{cfg_path} does not hold a JSON object of model settings.")
        cfg = ModelConfig.from_dict(cfg_dict, source=str(cfg_path), saved=True)
        device = torch.device(map_location)
        check_memory(cfg, device if device.type in ("cpu", "cuda") else "cpu", training=False)
        model = cls(cfg)
        try:
            # read on the CPU, where the model was built (load_model copies into its
            # parameters), then move the model as a whole
            missing, unexpected = load_model(model, str(w_path), strict=False, device="cpu")
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            # torch lists every mismatched tensor on its own line: name the first and the count
            lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
            detail = next((x for x in lines if x.startswith("size mismatch")), lines[0] if lines
                          else type(e).__name__)
            more = sum(x.startswith("size mismatch") for x in lines) - 1
            detail += f" (and {more} more)" if more > 0 else ""
            raise CheckpointError(f"cannot read weights from {w_path}: {detail}. The file is "
                                  f"corrupt, truncated or belongs to a different configuration "
                                  f"than {cfg_path}.") from None
        if missing or unexpected:
            raise CheckpointError(f"{w_path} does not match {cfg_path}: missing tensors "
                                  f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}.")
        model = model.to(device)
        if cfg.tie_embeddings:  # a move that makes new Parameter objects (meta, some
            model.lm_head.weight = model.tok_emb.weight  # accelerators) would untie them
        return model


def _static_token_logits(model: LanguageModel, idx: torch.Tensor, state: DecodeState):
    return model._static_token_logits(idx, state)


_COMPILED = None
# one compiled function serves every model, batch size and capacity: allow more graphs than
# dynamo's default of 8 before it refuses to compile another (it then raises, under fullgraph,
# and that model decodes eagerly)
_RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def _recompile_limit(n: int):
    """Raise dynamo's per-function graph limit to at least ``n`` for one call (a plain
    attribute swap: ~3 us, against milliseconds per token)."""
    cfg = torch._dynamo.config
    # renamed from cache_size_limit in torch 2.7, which keeps the old name as an alias
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    old = getattr(cfg, name)
    setattr(cfg, name, max(old, n))
    try:
        yield
    finally:
        setattr(cfg, name, old)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises before anything runs: dynamo's errors, and (under
    fullgraph, where it exists) running out of graphs for the function."""
    exc = torch._dynamo.exc
    return tuple(e for e in (exc.TorchDynamoException,
                             getattr(exc, "FailOnRecompileLimitHit", None)) if e is not None)


def _capacity_for(n: int, minimum: int = 64) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


def _compiled_token_logits():
    """One compiled function for every model, built on first use (nothing compiled is stored on
    a model, so copies and pickles of a model are unaffected); dynamo's guards tell models,
    batch sizes and capacities apart. fullgraph: no graph breaks, so a failure to compile
    happens before any cache has moved."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(_static_token_logits, dynamic=False, fullgraph=True)
    return _COMPILED
