"""The config sections: [model], [data], [train], [mqar], and the run config that holds them."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ..errors import ConfigError
from ..registry import DEPTHS, FIELDS, MIXERS, SOLVERS, load_plugins
from .checks import ODE_TIME_LIMIT, _in, _origin, _strict, _suggest, _validate, reading_saved_config
from .components import (
    MODEL_KEYS,
    _build_components,
    _component_class,
    _configurable,
    _split_component_tables,
)


@dataclass
class ModelConfig:
    """Architecture of a :class:`~continuumlm.LanguageModel`.

    Field names follow the seed documents (``hidden_size``, ``num_heads``, ``ode_solver``...).
    """

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    vocab_size: int = 0
    """Number of token ids; 0 means "take it from the tokenizer" (filled in by the trainer)."""
    hidden_size: int = 128
    """Width of the residual stream (d_model)."""
    num_heads: int = 4
    """Attention (or DeltaNet) heads; hidden_size must be divisible by it."""
    num_layers: int = 4
    """Distinct layers (discrete depth) or stacked ODE blocks, each with its own weights."""
    ffn_hidden_size: int | None = None
    """Width of the MLP; defaults to 4 * hidden_size."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (one mask per forward
    inside an ODE field, shared by every step and stage)."""
    norm_type: str = "layernorm"
    """"layernorm", "rmsnorm" or "dyt" (Dynamic Tanh: gamma * tanh(alpha x) + beta, no
    statistics; the default of the ODE-attention seed's implementation)."""
    use_bitnet: bool = False
    """BitNet b1.58 projections: ternary weights and 8-bit activations, trained through a
    straight-through estimator."""
    mode: str = "decoder"
    """"decoder": causal language model; "encoder": bidirectional."""
    position: str = "rope"
    """Positions: "rope" (rotary, any length), "learned" (a table of max_seq_len) or "none"."""
    max_seq_len: int = 256
    """Longest sequence the learned position table covers (also the continuous mixer's
    default kernel length, and the exported tokenizer's model_max_length)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output layer."""
    bias: bool = False
    """Biases in linear layers and norms (nanoGPT's ``bias``)."""
    mixer: str = "softmax"
    """Token mixer: softmax, deltanet, continuous, or one a plugin registers. A mixer's own
    settings are its table, e.g. [model.deltanet] short_conv = 4."""
    depth: str = "discrete"
    """"discrete" (num_layers distinct layers) or "ode" (shared-weight fields integrated over
    t from ode_t0 to ode_t1, num_layers blocks)."""
    field: str = "sequential"
    """Vector field of ODE blocks: attention, sequential or parallel."""
    ode_solver: str = "rk4"
    """Fixed grid: euler, midpoint, heun, rk4 (classical), rk4_38, rk2_gated, reversible_heun;
    adaptive (torchdiffeq's step-size control): tsit5, dopri5, dopri8, bosh3, fehlberg2,
    adaptive_heun."""
    ode_steps: int = 4
    """Uniform steps of a fixed-grid solver from ode_t0 to ode_t1."""
    ode_grad: str = "direct"
    """direct, adjoint, checkpoint, binomial or reversible (reversible needs a reversible
    solver; binomial keeps ode_checkpoints states and recomputes the rest, exact gradients)."""
    ode_kv: str = "evaluation"
    """What the mixers' memory (what later tokens read: softmax keys and values, DeltaNet's
    writes and short-convolution inputs, continuous attention's values) is computed from:
    "evaluation", every field evaluation's own state (a cache per evaluation: 64 for 4 blocks
    of RK4 x 4); "step", the state at the start of each solver step (a cache per step); or
    "block", the block's input (one cache per block, a discrete layer's). Queries evolve with
    every evaluation either way; training and decoding compute the same function."""
    ode_t0: float = 0.0
    """Start of the depth interval the ODE blocks integrate over."""
    ode_t1: float = 1.0
    """End of the depth interval (greater than ode_t0)."""
    ode_rtol: float = 1e-3
    """Relative tolerance of adaptive solvers."""
    ode_atol: float = 1e-4
    """Absolute tolerance of adaptive solvers."""
    ode_max_steps: int = 1000
    """Most steps an adaptive solve may take before it stops with an error."""
    reversible_tol: float = 1e-3
    """ode_grad = "reversible": the largest distance (relative to the state's largest value, at
    least 1) between the initial state the backward rebuilds and the true one; beyond it the
    step fails as a solver error (the method's stability region is narrow)."""
    ode_checkpoints: int = 0
    """States that ode_grad = "binomial" keeps per ODE block (0: about log2 of ode_steps);
    fewer keep less memory and recompute more steps in the backward pass."""
    ode_adjoint_norm: str = "default"
    """Error norm of the adjoint's backward solve (ode_grad = "adjoint" with an adaptive
    solver): "default" (torchdiffeq's: state, adjoint state and parameter gradients) or
    "seminorm" (Kidger et al. 2021: the parameter gradients left out of step-size control,
    which is exact for them and takes fewer backward steps)."""
    ode_time_embedding: str = "none"
    """"sinusoidal" makes the field non-autonomous, dh/dt = Block(h, t)."""
    ode_dt_embedding: bool = False
    """Also condition the field on the step size dt = (ode_t1 - ode_t0) / ode_steps (a learned
    projection of a sinusoidal embedding of log2(1 / dt), zero at first), so that one field can
    learn to serve several step counts (train.ode_steps_choices). Fixed-grid solvers only."""
    ode_dt_embedding_reads: str = "step"
    """What the dt embedding reads: "step", the step size dt; or "evaluation", the spacing of
    field evaluations dt / (evaluations per step), so that solves of equal cost share it (Euler
    x 16 and RK4 x 4 both read 1/16, Euler x 4 and RK4 x 1 both 1/4) instead of an accurate
    and a coarse solve sharing one (Euler x 4 and RK4 x 4 both read dt = 1/4). With
    "evaluation", ode_dt_steps_range counts field evaluations instead of steps."""
    ode_dt_steps_range: list[int] | None = None
    """With ode_dt_embedding: [fewest, most] step counts over [ode_t0, ode_t1] whose step sizes
    the embedding reads as they are; a solve with more steps reads the embedding of the most
    (one with fewer, of the fewest), so the field stays one it was trained as, and Euler or
    RK4 with ever more steps converges to the solution of that field's ODE instead of reading
    an embedding no step trained (None: every step size read as it is)."""
    # not part of a config's identity: a run resumed with its plugin given otherwise (an extra
    # --plugin, an entry point) is the same run
    plugins: list[str] = dataclasses.field(default_factory=list, compare=False)
    """Python modules imported before the model is built, whose components (mixers, fields,
    solvers) register themselves; saved with the run, so evaluation and generation need no
    flag (``--plugin MODULE`` adds one)."""
    components: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    """The settings of components that declare a ``Config`` (a [model.NAME] table each),
    keyed by component name; the selected components' are always present (defaults where not
    given). Read them with :meth:`component`."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size
        _validate(self, "model", skip=("components",))
        load_plugins(self.plugins)  # before the selectors are checked against the registries
        if self.hidden_size % self.num_heads != 0:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                f"({self.num_heads}); choose e.g. hidden_size = "
                f"{self.num_heads * max(1, round(self.hidden_size / self.num_heads))}."
            )
        if self.position == "rope" and (self.hidden_size // self.num_heads) % 2 != 0:
            raise ConfigError(
                f"model.position = 'rope' needs an even head size, but hidden_size/num_heads = "
                f"{self.hidden_size // self.num_heads}; change the sizes or use position = 'learned'."
            )
        for name in ("ode_t0", "ode_t1"):
            if abs(getattr(self, name)) > ODE_TIME_LIMIT and _strict():
                raise ConfigError(
                    f"model.{name} = {getattr(self, name)} is outside [-{ODE_TIME_LIMIT:g}, "
                    f"{ODE_TIME_LIMIT:g}]: the solvers keep time in float32, and a step that "
                    f"large overflows it; depth is usually integrated over [0, 1].")
        r = self.ode_dt_steps_range
        if r is not None:
            if not (len(r) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                        and 1 <= n <= 10000 for n in r) and r[0] <= r[1]):
                raise ConfigError(f"model.ode_dt_steps_range must be [fewest, most]: two step "
                                  f"counts from 1 to 10000, fewest first; got {r}.")
            if not self.ode_dt_embedding:
                raise ConfigError("model.ode_dt_steps_range bounds the step sizes that the dt "
                                  "embedding reads, and this model has none: set "
                                  "model.ode_dt_embedding = true, or remove the range.")
        if self.ode_kv not in ODE_KV:
            raise ConfigError(f"model.ode_kv must be one of {', '.join(ODE_KV)} (what the "
                              f"mixers' memory is computed from), got {self.ode_kv!r}.")
        if self.ode_kv != "evaluation" and self.depth != "ode":
            raise ConfigError(f"model.ode_kv = {self.ode_kv!r} says which state of an ODE "
                              f"solve the mixers' memory comes from; depth = {self.depth!r} "
                              f"has no solve (each discrete layer already has one cache). "
                              f"Leave ode_kv out, or set depth = 'ode'.")
        if self.ode_dt_embedding_reads not in ("step", "evaluation"):
            raise ConfigError(f"model.ode_dt_embedding_reads must be 'step' (the step size) or "
                              f"'evaluation' (the spacing of field evaluations), got "
                              f"{self.ode_dt_embedding_reads!r}.")
        if self.ode_dt_embedding_reads != "step" and not self.ode_dt_embedding:
            raise ConfigError("model.ode_dt_embedding_reads says what the dt embedding reads, "
                              "and this model has none: set model.ode_dt_embedding = true, or "
                              "leave ode_dt_embedding_reads out.")
        _check_selectors(self)
        self.components = _build_components(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def component(self, name: str):
        """The ``Config`` of component ``name`` (its defaults when this config sets none)."""
        if name in self.components:
            return self.components[name]
        cls = _component_class(name)
        if cls is None:
            raise KeyError(f"no registered component {name!r} declares a Config; components "
                           f"with settings: {', '.join(sorted(_configurable())) or 'none'}.")
        return cls.Config()

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, then one table per configured component (``{"deltanet": {...}}``)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name != "components"}
        d.update({name: dataclasses.asdict(c) for name, c in sorted(self.components.items())})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None,
                  saved: bool = False) -> ModelConfig:
        with reading_saved_config() if saved else contextlib.nullcontext():
            return _build(cls, d, "model", source)


# the component tables must not shadow these keys
MODEL_KEYS.update(f.name for f in fields(ModelConfig))


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized and split."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    dataset: str = "tinyshakespeare"
    """"tinyshakespeare", "ptb" (Mikolov's splits), "text" (data.path: a text file, a folder or
    a glob of text, JSON Lines, Parquet or Arrow files, split by train_fraction or train_chars)
    or "prepared" (data.path: a folder written by ``continuumlm prepare``). Every corpus but a
    prepared one is prepared once into the user cache and memory-mapped from there."""
    path: str | None = None
    """A text file, folder or glob (dataset "text"), a corpus file, a folder with the PTB files,
    or a prepared folder (dataset "prepared")."""
    tokenizer: str = "char"
    """"char", "word" (whitespace words, <unk> and <eos>) or "bpe" (byte-level, trained on the
    training split, or a seeded sample of it of tokenizer_sample_chars characters)."""
    vocab_size: int | None = None
    """Vocabulary cap for word (most frequent words kept, rest <unk>) and bpe tokenizers."""
    vocab_source: str = "train"
    """Build the tokenizer from the training split ("train") or the whole corpus ("all")."""
    unknown_chars: str = "unk"
    """Char tokenizer: characters outside the training split but not in it map to an extra
    <unk> token, with a warning that counts them ("unk"), or stop the run ("error")."""
    train_fraction: float = 0.9
    """Share of the text that trains (the rest validates), when train_chars is not set."""
    test_fraction: float = 0.0
    """Share of the text, at its end, kept as a test split (dataset "text")."""
    train_chars: int | None = None
    """If set, the first ``train_chars`` characters train and the rest validate (CAT's split)."""
    errors: str = "strict"
    """How non-UTF-8 bytes are handled: "strict" stops with the byte offset, "replace" goes on."""
    text_field: str = "text"
    """The text field of JSON Lines records and the text column of Parquet/Arrow files."""
    tokenizer_sample_chars: int = 64_000_000
    """Word/bpe tokenizers train on the whole training text up to this many characters, and on
    a seeded sample of that size (blocks of about 1 MB) of a larger one."""

    def __post_init__(self) -> None:
        _validate(self, "data")
        n = self.vocab_size if _strict() else None
        if n is not None and self.tokenizer == "char":
            raise ConfigError(
                f"data.vocab_size = {n} has no effect with data.tokenizer = 'char', whose "
                f"vocabulary is every character of the corpus; remove it, or use the 'word' or "
                f"'bpe' tokenizer to cap the vocabulary.")
        least = {"word": 3, "bpe": 257}.get(self.tokenizer, 0)
        if n is not None and n < least:
            raise ConfigError(
                f"data.vocab_size = {n} is too small for the {self.tokenizer} tokenizer: "
                + ("its vocabulary holds <eos> and <unk> besides the words it keeps, so "
                   "anything under 3 turns every word into <unk>" if self.tokenizer == "word"
                   else "its vocabulary holds the 256 bytes and <|endoftext|> before any merge")
                + f"; use at least {least}, or leave it out for "
                + ("every word of the training text." if self.tokenizer == "word" else "4096."))


@dataclass
class TrainConfig:
    """Optimization, logging and checkpointing."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    max_steps: int = 2000
    """Optimizer steps of the run (``--resume --set train.max_steps=N`` extends it)."""
    batch_size: int = 12
    """Sequences per micro-batch and process."""
    seq_len: int = 64
    """Tokens per training sequence (the context the model is trained at)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW, reached after warmup_steps."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 100
    """Steps of linear warm-up from 0 to lr (one not below the decay's end is warned about at
    the start: it leaves no cosine decay)."""
    lr_decay_steps: int | None = None
    """The step at which the cosine decay (from lr, after the warm-up) reaches min_lr;
    defaults to max_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on every weight of two or more dimensions, the token embedding
    included (not on norms' gains, biases or other 1-D parameters)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (each backpropagates its own mean loss)."""
    eval_interval: int = 250
    """Steps between validation evaluations (each may save the best checkpoint)."""
    eval_iters: int = 20
    """Validation batches per evaluation (fixed windows spread over the split)."""
    log_interval: int = 10
    """Steps between training-metric log lines (loss, lr, grad norm, tokens/s, NFE)."""
    checkpoint_interval: int = 500
    """Steps between checkpoints (one is also written at the end and on SIGINT/SIGTERM)."""
    keep_checkpoints: int = 3
    """Newest step-* checkpoint folders kept (plus best)."""
    max_bad_steps: int = 5
    """Consecutive steps with a non-finite loss or gradient (each skipped) before training stops."""
    seed: int = 1337
    """Seeds the weights, the batch streams and dropout."""
    device: str = "auto"
    """"auto" (CUDA, else MPS, else CPU), "cpu", "cuda", "cuda:N" or "mps"."""
    dtype: str = "auto"
    """Autocast precision: "bf16"/"bfloat16", "fp16"/"float16" (with a gradient scaler),
    "fp32"/"float32", or "auto" (bf16 on CUDA, fp32 elsewhere). Weights, optimizer state and the
    ODE solvers' time variables stay fp32."""
    compile: bool = False
    """Compile the model with torch.compile (falls back to eager with one warning if it fails)."""
    threads: int | str = "auto"
    """Intra-op threads of the training process: "auto" takes the cores that other processes
    leave idle, looked at again every few seconds (continuumlm.threads: on a machine shared
    with other jobs, threads spinning at torch's barriers make small models 15-50x slower),
    or a fixed count. OMP_NUM_THREADS or a torch.set_num_threads call is kept under "auto";
    --threads N sets this key. Float rounding of reductions depends on the count, so a run that
    must repeat bit for bit names one."""
    keep_freed_memory: bool = True
    """CPU runs on Linux (glibc): keep freed memory in the process instead of handing every
    large block (above 32 MB: the logits, their gradients) back to the system at once, which
    makes each step fault those pages in again (bench/keep_freed_memory.py, 2 cores, one
    thread, the other core busy: configs/ptb_std's transformer 1.36x faster per step, its ODE
    model 1.14x, MQAR at 64 pairs 1.25x). The process holds on to its peak memory (5-11% more
    measured). Set once per process: false leaves the allocator as it is (in a process where
    an earlier run set it, it stays set)."""
    strategy: str = "ddp"
    """Under torchrun: "ddp" (replicated weights) or "fsdp" (FSDP2, sharded weights and state)."""
    requeue_signals: list[str] = dataclasses.field(
        default_factory=lambda: ["SIGUSR1", "SIGUSR2"])
    """Signals that a scheduler sends before it stops a job (SLURM: --signal=USR1@90): the run
    saves after the current step and exits with status 75, "requeue me". A signal left out
    keeps its default action (the process ends at once, without a checkpoint)."""
    checkpoint_minutes: float | None = None
    """Also save whenever this many minutes of wall time passed since the last save, so a
    hard kill loses at most that much (None: by step count only)."""
    dist_timeout_s: float = 600.0
    """Collective timeout under torchrun: a rank stuck this long fails the job instead of hanging."""
    ode_steps_choices: list[int] | None = None
    """Elastic depth (ODE models): each optimizer step integrates with a step count drawn from
    this list, seeded by train.seed and the step (a resumed run and every rank draw alike);
    every entry is equally likely, so a count listed twice is drawn twice as often;
    evaluation and checkpoints keep model.ode_steps."""
    ode_solver_choices: list[str] | None = None
    """... and with a fixed-grid solver drawn from this list (model.ode_solver if unset)."""
    ode_max_nfe: int | None = None
    """With ode_steps_choices / ode_solver_choices: draw only the (solver, steps) pairs whose
    solve takes at most this many field evaluations (RK4 x 16 is 64), every allowed pair
    equally likely (each entry of the lists counted as listed); the consistency term's finer
    solve is the next larger step count within the cap too. None: solver and step count drawn
    independently from the two lists."""
    consistency_weight: float = 0.0
    """With ode_steps_choices: add this weight times KL(finer || drawn) of the next-token
    distributions, the finer solve being the next larger step count of the choices on the same
    batch (no gradient, dropout off); logged as "consistency" on the steps that have it."""
    consistency_max_nfe: int | None = None
    """With ode_max_nfe and the consistency term: the finer solve may take up to this many
    field evaluations (at least ode_max_nfe; None: ode_max_nfe), e.g. 64 so that a drawn
    RK4 x 8 is pulled toward RK4 x 16 although RK4 x 16 itself is never drawn. The finer solve
    runs without gradients, so it costs about a third of a drawn solve of its size."""
    elastic_from: int = 0
    """With ode_steps_choices / ode_solver_choices: the first optimizer step (counted from 0)
    that draws; every step before it integrates with model.ode_solver and model.ode_steps and
    has no consistency term. A fixed-trained run made elastic for its last
    max_steps - elastic_from steps; the draws from there on are the ones a run with 0 makes."""
    distill_from: str | None = None
    """Distillation: a trained run folder (its last checkpoint) or checkpoint folder whose model
    is the teacher. Each micro-batch adds train.distill_weight times KL(teacher || model) of the
    next-token distributions (the teacher in eval mode, without gradients, at its own solver
    and step count), logged as "distill". The teacher must have this run's tokenizer; its
    weights' digest is saved with the run, and a resume refuses a teacher that changed. With
    elastic depth, a fixed-trained teacher pulls every drawn solve toward one good solution."""
    distill_weight: float = 0.0
    """The weight of the distillation term (with train.distill_from)."""
    consistency_every: int = 1
    """Add the consistency term on every N-th optimizer step only (steps 0, N, 2N, ...): its
    finer solve is an extra forward pass, so N = 2 halves what the term costs."""
    kinetic_weight: float = 0.0
    """ODE models: add this weight times the kinetic energy of the solve, the integral of
    ||f||^2 / hidden_size over t per token, averaged (Finlay et al. 2020): straighter
    trajectories that adaptive solvers take in fewer steps. Adaptive solvers only (a fixed
    grid takes the same steps whatever the field). Logged as "kinetic"."""
    jacobian_weight: float = 0.0
    """ODE models: add this weight times the integral of ||df/dh||_F^2 / hidden_size along the
    solve, estimated with one Gaussian probe per forward (Hutchinson; one extra
    vector-Jacobian product per evaluation). Adaptive solvers only, as kinetic_weight.
    Logged as "jacobian"."""
    step_readout_weight: float = 0.0
    """ODE models with a fixed-grid solver: add this weight times the mean cross-entropy of the
    read-out (final norm + head) of every intermediate solver step's state, in every block
    (deep supervision along depth: a solve that is good at every step, which per-token exit,
    eval --exit-threshold, needs). Needs model.ode_grad = "direct" or "checkpoint" and at
    least two steps. Logged as "step_readout"."""
    steer: float = 0.0
    """ODE models: STEER (Ghosh et al. 2020) draws each training step's end time uniformly from
    [ode_t1 - steer, ode_t1 + steer] (from the seed and the step, so a resumed run and every
    rank draw alike); evaluation integrates to ode_t1. Must be below ode_t1 - ode_t0."""

    def __post_init__(self) -> None:
        _validate(self, "train")
        from ..threads import parse_threads

        self.threads = parse_threads(self.threads, "train.threads")
        for name in ("ode_steps_choices", "ode_solver_choices"):
            v = getattr(self, name)
            if v is not None and not v:
                raise ConfigError(f"train.{name} is empty; list at least one value, or leave "
                                  f"it out.")
        if self.ode_steps_choices is not None and not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 10_000
                for n in self.ode_steps_choices):
            raise ConfigError(f"train.ode_steps_choices must list positive integers (up to "
                              f"10000), got {self.ode_steps_choices}.")
        for name in ("kinetic_weight", "jacobian_weight", "steer", "step_readout_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}.")
        if not self.consistency_weight >= 0:
            raise ConfigError(f"train.consistency_weight must be >= 0, got "
                              f"{self.consistency_weight}.")
        if self.ode_max_nfe is not None and not (
                isinstance(self.ode_max_nfe, int) and not isinstance(self.ode_max_nfe, bool)
                and self.ode_max_nfe >= 1):
            raise ConfigError(f"train.ode_max_nfe must be a positive integer (or left out), "
                              f"got {self.ode_max_nfe!r}.")
        if self.ode_max_nfe is not None and not (self.ode_steps_choices
                                                 or self.ode_solver_choices):
            raise ConfigError("train.ode_max_nfe caps the solves that elastic training draws; "
                              "set train.ode_steps_choices (and/or ode_solver_choices), or "
                              "leave it out.")
        if self.consistency_max_nfe is not None:
            if self.ode_max_nfe is None or not self.consistency_weight > 0:
                raise ConfigError("train.consistency_max_nfe caps the consistency term's finer "
                                  "solve beyond train.ode_max_nfe: set both ode_max_nfe and "
                                  "consistency_weight > 0, or leave it out.")
            if not (isinstance(self.consistency_max_nfe, int)
                    and not isinstance(self.consistency_max_nfe, bool)
                    and self.consistency_max_nfe >= self.ode_max_nfe):
                raise ConfigError(f"train.consistency_max_nfe must be an integer at least "
                                  f"train.ode_max_nfe ({self.ode_max_nfe}), got "
                                  f"{self.consistency_max_nfe!r}.")
        if not (isinstance(self.elastic_from, int) and not isinstance(self.elastic_from, bool)
                and self.elastic_from >= 0):
            raise ConfigError(f"train.elastic_from must be an integer >= 0 (the first optimizer "
                              f"step that draws a solve), got {self.elastic_from!r}.")
        if self.elastic_from and not (self.ode_steps_choices or self.ode_solver_choices):
            raise ConfigError("train.elastic_from is the step where elastic training starts; "
                              "set train.ode_steps_choices (and/or ode_solver_choices), or "
                              "leave it out.")
        if self.elastic_from and self.elastic_from >= self.max_steps:
            raise ConfigError(f"train.elastic_from ({self.elastic_from}) is not below "
                              f"train.max_steps ({self.max_steps}): no step would draw. Lower "
                              f"it, or leave out the elastic settings for a fixed-step run.")
        if not self.distill_weight >= 0:
            raise ConfigError(f"train.distill_weight must be >= 0, got {self.distill_weight}.")
        if (self.distill_from is None) != (self.distill_weight == 0):
            raise ConfigError(
                "train.distill_from (the teacher's run or checkpoint folder) and "
                "train.distill_weight (> 0) go together: set both to distill, or neither "
                f"(got distill_from = {self.distill_from!r}, distill_weight = "
                f"{self.distill_weight}).")
        if not (isinstance(self.consistency_every, int) and self.consistency_every >= 1):
            raise ConfigError(f"train.consistency_every must be a positive integer (1: every "
                              f"step), got {self.consistency_every!r}.")
        if self.consistency_weight > 0 and len(set(self.ode_steps_choices or [])) < 2:
            raise ConfigError("train.consistency_weight pulls a coarse solve toward a finer one: "
                              "it needs train.ode_steps_choices with at least two step counts.")
        bad = [s for s in self.requeue_signals if s not in ("SIGUSR1", "SIGUSR2")]
        if bad:
            raise ConfigError(f"train.requeue_signals may list SIGUSR1 and SIGUSR2, got "
                              f"{bad[0]!r}; SIGINT and SIGTERM always stop a run (status 130 "
                              f"and 143).")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            raise ConfigError(f"train.checkpoint_minutes must be positive (or left out), got "
                              f"{self.checkpoint_minutes}.")


@dataclass
class MQARConfig:
    """The multi-query associative recall task (``continuumlm mqar``)."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    vocab_size: int = 8192
    """Token ids of the task: keys from the lower half, values from the upper half."""
    seq_len: int = 256
    """Tokens per example (key-value pairs, then queries among noise)."""
    num_kv_pairs: int = 16
    """Key-value pairs per example (of the held-out set, and of training unless
    train_kv_pairs is set)."""
    power_a: float = 0.01
    """Query distances d are drawn with p(d) proportional to a * d^(a - 1) (Zoology's 0.01)."""
    train_examples: int = 100_000
    """Size of the fixed training set (sampled once, reused every epoch, as in Zoology)."""
    test_examples: int = 1000
    """Size of the held-out set, sampled once from its own seed."""
    stop_accuracy: float = 1.0
    """Stop at the first evaluation whose recall accuracy reaches this (1.0: only at perfect
    recall)."""
    train_kv_pairs: list[int] = field(default_factory=list)
    """Pair counts of a mixed training set, e.g. [4, 8, 16, 32, 64]: the training examples are
    split evenly among them (all at ``seq_len``), as in Zoology's training data. Empty: every
    training sequence has ``num_kv_pairs``. The held-out set always has ``num_kv_pairs``."""

    def __post_init__(self) -> None:
        _validate(self, "mqar")
        if not 0.0 <= self.stop_accuracy <= 1.0:
            raise ConfigError(f"mqar.stop_accuracy must lie in [0, 1], got {self.stop_accuracy}.")
        bad = [n for n in self.train_kv_pairs if n <= 0]
        if bad:
            raise ConfigError(f"mqar.train_kv_pairs must hold positive pair counts, got {bad[0]}; "
                              f"write e.g. train_kv_pairs = [4, 8, 16, 32, 64], or [] for none.")
        if len(self.train_kv_pairs) > self.train_examples:
            raise ConfigError(f"mqar.train_kv_pairs lists {len(self.train_kv_pairs)} pair counts "
                              f"but mqar.train_examples = {self.train_examples} cannot give "
                              f"each one an example; raise train_examples.")
        for n in (self.num_kv_pairs, *self.train_kv_pairs):
            if self.vocab_size // 2 - 1 < n:
                raise ConfigError(
                    f"mqar.vocab_size = {self.vocab_size} leaves {max(0, self.vocab_size // 2 - 1)}"
                    f" distinct keys (keys come from the lower half of the vocabulary, id 0 "
                    f"unused), fewer than the {n} key-value pairs asked for; raise "
                    f"mqar.vocab_size to at least {2 * n + 2}.")
            if (self.seq_len + 1 - 2 * n) // 2 < n:
                raise ConfigError(
                    f"mqar.seq_len = {self.seq_len} is too short for {n} key-value pairs and "
                    f"their queries; it needs at least {4 * n - 1} tokens.")
        space = (self.seq_len + 1 - 2 * min([self.num_kv_pairs, *self.train_kv_pairs])) // 2
        if space >= 1 and _strict():
            try:  # the weights a * d^(a - 1) at both ends, and their sum, in float64
                ends = (self.power_a, self.power_a * space ** (self.power_a - 1))
                usable = all(0 < w and math.isfinite(w * space) for w in ends)
            except OverflowError:
                usable = False
            if not usable:
                raise ConfigError(
                    f"mqar.power_a = {self.power_a}: query distances d up to {space} are drawn "
                    f"with p(d) proportional to a * d^(a - 1), which overflows or underflows "
                    f"here; Zoology uses 0.01 (smaller puts queries nearer their keys, a > 1 "
                    f"farther).")


SECTIONS = ("model", "data", "train", "mqar")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mqar: MQARConfig = field(default_factory=MQARConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: getattr(self, name).to_dict() if name == "model" else
                dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str | None = None,
                  overridden: dict[str, str] | None = None, saved: bool = False) -> RunConfig:
        """``overridden`` maps ``section.key`` to the ``--set`` item that gave its value, so an
        error about that key points at the command line rather than the file. ``saved``: the
        config of a saved run (see ``reading_saved_config``)."""
        if saved:
            with reading_saved_config():
                return cls.from_dict(d, where, overridden)
        sections = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig,
                    "mqar": MQARConfig}
        unknown = [k for k in d if k not in sections]
        if unknown:
            given = [item for key, item in (overridden or {}).items()
                     if key.partition(".")[0] == unknown[0]]
            origin = f" (from --set {given[0]})" if given else _in(where)
            raise ConfigError(f"unknown section [{unknown[0]}]{_suggest(unknown[0], sections)}"
                              f"{origin}; valid sections are [model], [data], [train] and "
                              f"[mqar].")
        built = {}
        for name, klass in sections.items():
            section = d.get(name, {})
            if not isinstance(section, dict):
                raise ConfigError(f"[{name}]{_in(where)} must be a table of key = value pairs.")
            built[name] = _build(klass, section, name, where, overridden)
        return cls(**built)

    def check_trainable(self) -> None:
        """What `train` and `mqar` need beyond a valid config: their objective is next-token
        prediction, which a bidirectional (encoder) model solves by reading the target."""
        if self.model.mode != "decoder":
            raise ConfigError(
                f"model.mode = {self.model.mode!r} cannot be trained by this trainer: its "
                f"objective is next-token prediction, and an encoder sees the token it is asked "
                f"to predict, so its loss would mean nothing. Train with mode = 'decoder'; the "
                f"encoder mode is for using the layers in your own bidirectional model.")

    def check(self) -> None:
        """Cross-section checks that need more than one section."""
        m, t = self.model, self.train
        regs = [n for n in ("kinetic_weight", "jacobian_weight", "steer") if getattr(t, n)]
        if regs and m.depth != "ode":
            raise ConfigError(f"train.{regs[0]} regularizes an ODE model's solve; model.depth = "
                              f"{m.depth!r} has none. Use depth = 'ode', or leave it out.")
        weighted = [n for n in ("kinetic_weight", "jacobian_weight") if getattr(t, n)]
        # what training integrates with: the elastic choices replace the model's own solver
        # (names not registered are reported by the elastic checks below)
        fixed = [s for s in (t.ode_solver_choices or [m.ode_solver])
                 if s in SOLVERS and getattr(SOLVERS.component_class(s), "fixed_grid", True)
                 ] if weighted and m.depth == "ode" else []
        if fixed:
            raise ConfigError(f"train.{weighted[0]} makes an adaptive solver's dynamics cheaper "
                              f"to integrate (fewer steps for the same tolerance); with the "
                              f"fixed-grid {fixed[0]!r} every solve takes the same steps, so "
                              f"it would only constrain the field. Use an adaptive solver "
                              f"(tsit5, dopri5, ...) or leave it out.")
        if t.step_readout_weight:
            # what training integrates with: the elastic choices replace the model's own
            solvers = list(t.ode_solver_choices or [m.ode_solver])
            steps = list(t.ode_steps_choices or [m.ode_steps])
            if m.depth != "ode":
                raise ConfigError(f"train.step_readout_weight reads out an ODE model's solver "
                                  f"steps; model.depth = {m.depth!r} has none. Use depth = "
                                  f"'ode', or leave it out.")
            for name in solvers:
                cls = SOLVERS.component_class(name)
                if not getattr(cls, "fixed_grid", True) or getattr(cls, "reversible", False):
                    raise ConfigError(
                        f"train.step_readout_weight reads out the states of a fixed grid of "
                        f"steps; {name!r} is {'reversible' if getattr(cls, 'reversible', False) else 'adaptive'} "
                        f"(its steps are not kept as a graph). Use a fixed-grid solver such as "
                        f"euler or rk4, or leave it out.")
            if m.ode_grad not in ("direct", "checkpoint"):
                raise ConfigError(f"train.step_readout_weight needs the states of every step "
                                  f"in the graph: model.ode_grad = 'direct' or 'checkpoint', "
                                  f"not {m.ode_grad!r}.")
            if max(steps) < 2:
                where = ("train.ode_steps_choices" if t.ode_steps_choices
                         else "model.ode_steps")
                raise ConfigError(f"train.step_readout_weight reads out the states between "
                                  f"solver steps; {where} = {t.ode_steps_choices or m.ode_steps} "
                                  f"has none. Use at least two steps.")
        if t.ode_max_nfe is not None and m.depth == "ode":
            if not solve_pairs(m, t):
                raise ConfigError(
                    f"train.ode_max_nfe = {t.ode_max_nfe} allows none of the drawn solves "
                    f"(solvers {t.ode_solver_choices or [m.ode_solver]}, steps "
                    f"{t.ode_steps_choices or [m.ode_steps]}): raise the cap or add smaller "
                    f"step counts.")
        if t.steer and t.consistency_weight:
            raise ConfigError("train.steer moves each training step's end time, and "
                              "train.consistency_weight pulls that solve toward a finer one "
                              "integrated to model.ode_t1: the two would compare solves of "
                              "different intervals. Use one of them.")
        # (the gradient mode against every drawn solve: checked per draw below)
        if t.steer and t.compile:
            raise ConfigError("train.steer changes the solve's end time every step, which "
                              "would recompile a compiled model every step; leave "
                              "train.compile off with STEER.")
        if t.steer and not t.steer < m.ode_t1 - m.ode_t0:
            raise ConfigError(f"train.steer = {t.steer} must be below model.ode_t1 - "
                              f"model.ode_t0 = {m.ode_t1 - m.ode_t0}, so that every drawn end "
                              f"time stays after ode_t0.")
        if (t.ode_steps_choices or t.ode_solver_choices) and m.depth != "ode":
            raise ConfigError(f"train.ode_steps_choices / ode_solver_choices draw an ODE "
                              f"model's solver per step; model.depth = {m.depth!r} has none. "
                              f"Use depth = 'ode', or leave them out.")
        for solver in t.ode_solver_choices or []:
            if solver not in SOLVERS:
                raise ConfigError(f"train.ode_solver_choices: {SOLVERS.unknown_message(solver)}")
            cls = SOLVERS.component_class(solver)
            if not getattr(cls, "fixed_grid", True) or solver == "rk2_gated" \
                    or m.ode_solver == "rk2_gated":
                raise ConfigError(f"train.ode_solver_choices may list fixed-grid solvers without "
                                  f"weights of their own (euler, midpoint, heun, rk4, ...), "
                                  f"and the model's own solver may not have weights either "
                                  f"(rk2_gated); got {solver!r} with model.ode_solver = "
                                  f"{m.ode_solver!r}.")
        if m.depth == "ode" and (t.ode_steps_choices or t.ode_solver_choices):
            # every solve a step may draw must suit the model's gradient mode (e.g. reversible
            # Heun's 'reversible' backward with rk4 drawn), or training would stop at its draw
            for solver, steps in itertools.product(
                    dict.fromkeys(t.ode_solver_choices or [m.ode_solver]),
                    dict.fromkeys(t.ode_steps_choices or [m.ode_steps])):
                try:
                    _check_selectors(dataclasses.replace(m, ode_solver=solver, ode_steps=steps))
                except ConfigError as e:
                    raise ConfigError(
                        f"train.ode_solver_choices / ode_steps_choices may draw ode_solver = "
                        f"{solver!r} with ode_steps = {steps}, which this model cannot take: "
                        f"{e}") from None
        if m.position == "learned" and t.seq_len > m.max_seq_len:
            raise ConfigError(
                f"train.seq_len ({t.seq_len}) is longer than model.max_seq_len ({m.max_seq_len}), "
                f"which a learned position table cannot cover; raise model.max_seq_len or use "
                f"position = 'rope'.")


def _build(klass, d: dict[str, Any], section: str, source: str | None = None,
           overridden: dict[str, str] | None = None):
    names = {f.name for f in fields(klass)}
    if klass is ModelConfig:
        d, names = _split_component_tables(d, source, overridden), names - {"components"}
    for key in d:
        if key == "components" and klass is ModelConfig:
            continue
        if key not in names:
            where = _origin(f"{section}.{key}", source, overridden)
            raise ConfigError(f"unknown key {section}.{key}{_suggest(key, names)}{where}; "
                              f"valid keys of [{section}] are: {', '.join(sorted(names))}.")
    try:
        return klass(**d)
    except ConfigError as e:
        where = _origin(str(e), source, overridden)
        if where:
            raise ConfigError(f"{e}{where}") from None
        raise


GRAD_MODES = ("direct", "adjoint", "checkpoint", "binomial", "reversible")
ODE_KV = ("evaluation", "step", "block")  # model.ode_kv: what the mixers' memory comes from


def _check_selectors(cfg: ModelConfig) -> None:
    # A lookup loads the built-in components (and installed plugins) on first use.
    for registry, value in ((MIXERS, cfg.mixer), (DEPTHS, cfg.depth), (FIELDS, cfg.field),
                            (SOLVERS, cfg.ode_solver)):
        if value not in registry:
            raise ConfigError(registry.unknown_message(value))
    if cfg.ode_grad not in GRAD_MODES:
        raise ConfigError(f"model.ode_grad = {cfg.ode_grad!r} is not available"
                          f"{_suggest(cfg.ode_grad, GRAD_MODES)}; available: "
                          f"{', '.join(sorted(GRAD_MODES))}.")
    checker = getattr(DEPTHS[cfg.depth], "check_config", None)
    if checker is not None:
        checker(cfg)


def solve_nfe(model_config, solver: str, steps: int) -> int:
    """Field evaluations of a fixed-grid solve with ``solver`` over ``steps`` steps."""
    per_step = SOLVERS[solver](model_config).evals_per_step
    if per_step is None:  # adaptive: no fixed count (elastic draws refuse them elsewhere)
        return 1 << 62
    return int(per_step) * steps


def solve_pairs(model_config, t) -> list[tuple[str, int]]:
    """The (solver, steps) pairs that elastic training may draw: every pair of the two lists,
    less those over ``train.ode_max_nfe`` when it is set, in list order (an entry listed twice
    counts twice)."""
    solvers = list(t.ode_solver_choices or [model_config.ode_solver])
    steps = list(t.ode_steps_choices or [model_config.ode_steps])
    return [(s, n) for s in solvers for n in steps
            if t.ode_max_nfe is None or solve_nfe(model_config, s, n) <= t.ode_max_nfe]
