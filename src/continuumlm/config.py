"""Typed configuration: model, data and training sections, TOML files and ``--set`` overrides.

Every value is checked when a config is built, so a typo or an impossible size fails at once
with a message that names the key, instead of deep inside a training run.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomllib

from .errors import ConfigError
from .registry import DEPTHS, FIELDS, MIXERS, SOLVERS, load_plugins

# Allowed values of the plain choice fields. The selectors that name pluggable parts
# (mixer, depth, ...) are checked against their registries instead, see ``_check_selectors``.
CHOICES: dict[str, tuple[str, ...]] = {
    "norm_type": ("layernorm", "rmsnorm"),
    "mode": ("decoder", "encoder"),
    "position": ("rope", "learned", "none"),
    "dataset": ("tinyshakespeare", "ptb", "text"),
    "tokenizer": ("char", "word", "bpe"),
    "vocab_source": ("train", "all"),
    "errors": ("strict", "replace"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "dtype": ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
    "strategy": ("ddp", "fsdp"),
    "ode_time_embedding": ("none", "sinusoidal"),
}

POSITIVE = {
    "hidden_size", "num_heads", "num_layers", "ffn_hidden_size", "max_seq_len", "ode_steps",
    "max_steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters",
    "log_interval", "checkpoint_interval", "keep_checkpoints", "train_chars", "lr_decay_steps", "max_bad_steps",
    "dist_timeout_s", "lr", "ode_rtol", "ode_atol", "ode_max_steps", "num_kv_pairs", "train_examples", "test_examples", "power_a",
}
NON_NEGATIVE = {"warmup_steps", "weight_decay", "grad_clip", "min_lr", "vocab_size"}
UNIT_INTERVAL = {"dropout": (0.0, 1.0), "train_fraction": (0.0, 1.0), "beta1": (0.0, 1.0),
                 "beta2": (0.0, 1.0)}
# Sizes beyond what torch can index are refused here, so they never reach a tensor
# constructor's overflow traceback; sizes below this that do not fit in memory are refused by
# ``model.lm.check_memory`` with the memory they would need.
MAX_INT = 2**31 - 1
ODE_TIME_LIMIT = 1e6
UPPER: dict[str, int] = {}
UNCAPPED = {"seed", "train_chars"}  # numbers that never size a tensor

# The refusals above that are limits of this version rather than of any run (sizes, the ODE
# interval, settings that do nothing) apply to what a user writes, not to configs read back
# from a run saved before they existed: that run still evaluates and resumes.
_reading_saved = contextvars.ContextVar("reading_saved", default=False)


def _strict() -> bool:
    return not _reading_saved.get()


@contextlib.contextmanager
def reading_saved_config():
    token = _reading_saved.set(True)
    try:
        yield
    finally:
        _reading_saved.reset(token)


def setting(default: Any, *, gt: float | None = None, ge: float | None = None,
            le: float | None = None, lt: float | None = None,
            choices: tuple[str, ...] | None = None):
    """A field of a component's own ``Config`` dataclass with its bounds, checked when the
    config is built (``le``/``lt`` are limits of this version: a saved run that exceeds them
    still loads). Document the field with a string right below it, as for any field here::

        @dataclass
        class Config:
            kernel: int = setting(4, gt=0)
            \"\"\"Width of the convolution.\"\"\"
    """
    bounds = {k: v for k, v in dict(gt=gt, ge=ge, le=le, lt=lt, choices=choices).items()
              if v is not None}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=bounds)
    return dataclasses.field(default=default, metadata=bounds)


# Settings of the built-in components as earlier versions spelled them, flat in [model]: read
# from old configs, checkpoints and --set, and mapped to the component's own table.
LEGACY_KEYS = {
    "deltanet_short_conv": ("deltanet", "short_conv"),
    "cat_basis": ("continuous", "basis"),
    "cat_n_freq": ("continuous", "n_freq"),
    "cat_n_quad": ("continuous", "n_quad"),
    "cat_sob_lambda": ("continuous", "sob_lambda"),
    "cat_length": ("continuous", "length"),
}


@dataclass
class ModelConfig:
    """Architecture of a :class:`~continuumlm.LanguageModel`.

    Field names follow the seed documents (``hidden_size``, ``num_heads``, ``ode_solver``...).
    """

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
    """"layernorm" or "rmsnorm"."""
    use_bitnet: bool = False
    """BitNet b1.58 projections: ternary weights and 8-bit activations, trained through a
    straight-through estimator."""
    mode: str = "decoder"
    """"decoder": causal language model; "encoder": bidirectional."""
    position: str = "rope"
    """Positions: "rope" (rotary, any length), "learned" (a table of max_seq_len) or "none"."""
    max_seq_len: int = 256
    """Longest sequence the learned position table covers (also the default context)."""
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
    adaptive (torchdiffeq): dopri5, bosh3, adaptive_heun."""
    ode_steps: int = 4
    """Uniform steps of a fixed-grid solver from ode_t0 to ode_t1."""
    ode_grad: str = "direct"
    """direct, adjoint, checkpoint or reversible (reversible needs a reversible solver)."""
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
    ode_time_embedding: str = "none"
    """"sinusoidal" makes the field non-autonomous, dh/dt = Block(h, t)."""
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


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized and split."""

    dataset: str = "tinyshakespeare"
    """"tinyshakespeare", "ptb" (Mikolov's splits) or "text" (data.path, split by
    train_fraction or train_chars)."""
    path: str | None = None
    """A text file (dataset "text"), a corpus file, or a folder with the PTB files."""
    tokenizer: str = "char"
    """"char", "word" (whitespace words, <unk> and <eos>) or "bpe" (byte-level, trained on the
    training split)."""
    vocab_size: int | None = None
    """Vocabulary cap for word (most frequent words kept, rest <unk>) and bpe tokenizers."""
    vocab_source: str = "train"
    """Build the char/word vocabulary from the training split ("train") or the whole corpus."""
    train_fraction: float = 0.9
    """Share of the text that trains (the rest validates), when train_chars is not set."""
    train_chars: int | None = None
    """If set, the first ``train_chars`` characters train and the rest validate (CAT's split)."""
    errors: str = "strict"
    """How non-UTF-8 bytes are handled: "strict" stops with the byte offset, "replace" goes on."""

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
    """Steps of linear warm-up from 0 to lr."""
    lr_decay_steps: int | None = None
    """Steps of cosine decay from lr to min_lr; defaults to max_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms, biases or embeddings of size 1)."""
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
    strategy: str = "ddp"
    """Under torchrun: "ddp" (replicated weights) or "fsdp" (FSDP2, sharded weights and state)."""
    requeue_signals: list[str] = dataclasses.field(
        default_factory=lambda: ["SIGUSR1", "SIGUSR2"])
    """Signals that a scheduler sends before it stops a job (SLURM: --signal=USR1@90): the run
    saves after the current step and exits with status 75, "requeue me". [] to ignore them."""
    checkpoint_minutes: float | None = None
    """Also save whenever this many minutes of wall time passed since the last save, so a
    hard kill loses at most that much (None: by step count only)."""
    dist_timeout_s: float = 600.0
    """Collective timeout under torchrun: a rank stuck this long fails the job instead of hanging."""

    def __post_init__(self) -> None:
        _validate(self, "train")
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
    """Stop at the first evaluation whose recall accuracy reaches this (1.0: run max_steps)."""
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
        if m.position == "learned" and t.seq_len > m.max_seq_len:
            raise ConfigError(
                f"train.seq_len ({t.seq_len}) is longer than model.max_seq_len ({m.max_seq_len}), "
                f"which a learned position table cannot cover; raise model.max_seq_len or use "
                f"position = 'rope'.")


# ----------------------------------------------------------------------------- loading

def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None, where: str | None = None,
                plugins: list[str] | None = None) -> RunConfig:
    """Read a TOML file with [model], [data] and [train] sections (or start from ``base``, a
    dict of sections), then apply ``section.key=value`` overrides (values parsed as TOML, bare
    words as strings). ``plugins``: modules added to ``model.plugins`` (``--plugin``)."""
    raw: dict[str, Any] = {k: dict(v) for k, v in (base or {}).items()}
    if path is not None:
        path = Path(path)
        where = str(path)
        if path.is_dir():
            raise ConfigError(f"config {path} is a folder, not a TOML file; pass a file such as "
                              f"configs/shakespeare_char/demo.toml (to continue a run in a "
                              f"folder, use --out FOLDER --resume).")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing TOML file, "
                              f"e.g. configs/shakespeare_char/demo.toml.")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM is harmless
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid TOML: {e}.") from None
    overridden: dict[str, str] = {}
    for item in overrides or []:
        key, value = parse_override(item)
        section, _, name = key.partition(".")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"--set {item}: [{section}] is not a table.")
        # an override replaces the file's value under either spelling (LEGACY_KEYS)
        canonical = LEGACY_KEYS.get(name) if section == "model" else None
        if canonical or (section == "model" and name.count(".") == 1):
            table, leaf = canonical or tuple(name.split("."))
            sub = raw[section].get(table)
            if isinstance(sub, dict):
                sub.pop(leaf, None)
            for old, spot in LEGACY_KEYS.items():
                if spot == (table, leaf):
                    raw[section].pop(old, None)
        table, *inner = name.split(".")
        if inner:  # model.deltanet.short_conv=4: the [model.deltanet] table
            sub = raw[section].setdefault(table, {})
            if not isinstance(sub, dict) or len(inner) > 1:
                raise ConfigError(f"--set {item}: {section}.{table} is not a table of "
                                  f"settings; component settings are set as "
                                  f"model.COMPONENT.KEY=VALUE.")
            sub[inner[0]] = value
        else:
            raw[section][name] = value
        overridden[key] = item
        if canonical:  # errors name the new spelling
            overridden[f"model.{canonical[0]}.{canonical[1]}"] = item
    if plugins:
        model = raw.setdefault("model", {})
        if isinstance(model, dict):
            given = model.get("plugins", [])
            if isinstance(given, list):  # anything else is refused by the type check
                model["plugins"] = list(dict.fromkeys([*given, *plugins]))
    cfg = RunConfig.from_dict(raw, where, overridden)
    try:
        cfg.check()
    except ConfigError as e:
        raise ConfigError(f"{e}{_origin(str(e), where, overridden)}") from None
    return cfg


def parse_override(item: str) -> tuple[str, Any]:
    section, _, name = item.split("=", 1)[0].strip().partition(".")
    if "=" not in item or not section or not name:
        raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. "
                          f"--set train.max_steps=100 or --set model.mixer=softmax.")
    key, text = item.split("=", 1)
    key, text = key.strip(), text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `softmax` is a string
    return key, value


def dump_toml(cfg: RunConfig) -> str:
    """Write a RunConfig as TOML (None values are left out: they mean "default")."""
    lines: list[str] = []

    def table(name: str, values: dict) -> None:
        lines.append(f"[{name}]")
        for k, v in values.items():
            if v is not None and not isinstance(v, dict):
                lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
        for k, v in values.items():  # [model.NAME] component tables after the plain keys
            if isinstance(v, dict):
                table(f"{name}.{k}", v)

    for section, values in cfg.to_dict().items():
        table(section, values)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


# ----------------------------------------------------------------------------- validation

def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _in(source: str | None) -> str:
    return f" in {source}" if source else ""


_KEY = re.compile(r"\b((?:model|data|train|mqar)(?:\.\w+)+)")


def _origin(message: str, source: str | None, overridden: dict[str, str] | None) -> str:
    """Where the values an error message names came from: `` (from --set k=v)`` for keys given
    on the command line, `` (in FILE)`` for the rest; empty when neither is known."""
    overridden = overridden or {}
    keys = list(dict.fromkeys(_KEY.findall(message)))
    # a key names its --set item, and a table ([model.NAME]) the items that set its keys
    given = list(dict.fromkeys(item for k in keys for o, item in overridden.items()
                               if o == k or o.startswith(k + ".")))
    parts = []
    if given:
        parts.append("from " + ", ".join(f"--set {g}" for g in given))
    if source and (len(given) < len(keys) or not keys):
        parts.append(f"in {source}")
    return f" ({'; '.join(parts)})" if parts else ""


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


def _split_component_tables(d: dict[str, Any], source, overridden) -> dict[str, Any]:
    """[model] as read (TOML, JSON or --set): plain keys stay; tables ([model.NAME]) and the
    flat names of earlier versions (LEGACY_KEYS) go into ``components`` as dicts, built into
    each component's Config by ``_build_components``."""
    plain, tables = {}, {}
    for key, value in d.items():
        if key == "components":  # ModelConfig(components=...) as a dict, e.g. asdict(cfg)
            plain[key] = value
        elif key in LEGACY_KEYS:
            name, leaf = LEGACY_KEYS[key]
            table = tables.setdefault(name, {})
            if leaf in table:
                where = _origin(f"model.{key}", source, overridden)
                raise ConfigError(f"model.{key} and model.{name}.{leaf} both set {name}'s "
                                  f"{leaf}{where}; keep [model.{name}] {leaf} = ... (model.{key} "
                                  f"is the older spelling).")
            table[leaf] = value
        elif isinstance(value, dict):
            table = tables.setdefault(key, {})
            for leaf, v in value.items():
                if leaf in table:
                    old = next(k for k, t in LEGACY_KEYS.items() if t == (key, leaf))
                    raise ConfigError(f"model.{old} and model.{key}.{leaf} both set {key}'s "
                                      f"{leaf}{_in(source)}; keep [model.{key}] {leaf} = ... "
                                      f"(model.{old} is the older spelling).")
                table[leaf] = v
        else:
            plain[key] = value
    if tables:
        given = plain.get("components", {})
        plain["components"] = {**(given if isinstance(given, dict) else {}), **tables}
    return plain


def _configurable() -> dict[str, type]:
    """Registered components that declare a ``Config``, by name (mixers first, then fields,
    then solvers: a name taken in two registries means the first)."""
    found: dict[str, type] = {}
    reserved = {f.name for f in fields(ModelConfig)} | set(LEGACY_KEYS)
    for registry in (MIXERS, FIELDS, SOLVERS):
        for name in registry:
            cls = registry.component_class(name)
            if not dataclasses.is_dataclass(getattr(cls, "Config", None)):
                continue
            if name in reserved or name in found:
                what = ("a [model] key" if name in reserved else
                        f"another component with settings ({found[name].__qualname__})")
                raise ConfigError(
                    f"the {registry.kind} {name!r} ({cls.__module__}.{cls.__qualname__}) has "
                    f"settings, whose table [model.{name}] would clash with {what}; register "
                    f"it under another name.")
            found[name] = cls
    return found


def _component_class(name: str) -> type | None:
    return _configurable().get(name)


def _build_components(cfg: ModelConfig) -> dict[str, Any]:
    """Each [model.NAME] table as its component's Config, checked; plus the defaults of the
    selected mixer, field and solver when they have settings and none were given."""
    configurable = _configurable()
    given = cfg.components
    if not isinstance(given, dict):
        raise ConfigError(f"model.components must be a table of component settings, got "
                          f"{type(given).__name__}.")
    built = {}
    for name, value in given.items():
        cls = configurable.get(name)
        if cls is None:
            plain = {f.name for f in fields(ModelConfig)} - {"components"}
            raise ConfigError(
                f"[model.{name}] is not the table of a component with settings"
                f"{_suggest(name, [*configurable, *plain])}; tables here: "
                f"{', '.join(f'[model.{n}]' for n in sorted(configurable)) or 'none'}"
                + (f" (model.{name} is a plain key: write {name} = ... under [model])"
                   if name in plain else "") + ".")
        if isinstance(value, cls.Config):
            value = dataclasses.asdict(value)
        if not isinstance(value, dict):
            raise ConfigError(f"[model.{name}] must be a table of key = value pairs, got "
                              f"{type(value).__name__} {value!r}.")
        known = {f.name for f in fields(cls.Config)}
        for key in value:
            if key not in known:
                raise ConfigError(f"unknown key model.{name}.{key}{_suggest(key, known)}; "
                                  f"valid keys of [model.{name}] are: "
                                  f"{', '.join(sorted(known))}.")
        obj = cls.Config(**value)
        _validate(obj, f"model.{name}")
        built[name] = obj
    selected = (cfg.mixer, cfg.field, cfg.ode_solver)
    for name in selected:
        if name in configurable and name not in built:
            built[name] = configurable[name].Config()
    # the defaults of a component that is not selected say nothing (0.1 checkpoints hold every
    # flat setting whatever the mixer): left out, so equal configs compare equal
    return {name: c for name, c in built.items()
            if name in selected or c != configurable[name].Config()}


def _validate(obj, section: str, skip: tuple[str, ...] = ()) -> None:
    """Types, and bounds: a component's Config declares its own (``setting``); the sections
    here use the tables at the top of this module, keyed by field name."""
    hints = typing.get_type_hints(type(obj))
    own = type(obj) not in (ModelConfig, DataConfig, TrainConfig, MQARConfig)
    for f in fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        key = f"{section}.{f.name}"
        setattr(obj, f.name, _coerce(key, value, hints[f.name]))
        value = getattr(obj, f.name)
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}.")
        _check_bounds(key, value, f.metadata)
        cap = MAX_INT if own else UPPER.get(f.name, MAX_INT)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap \
                and (own or f.name not in UNCAPPED) and _strict():
            raise ConfigError(f"{key} = {value} is larger than the most this library supports, "
                              f"{cap:,}; choose a smaller value.")
        if own:
            continue
        if f.name in CHOICES and value not in CHOICES[f.name]:
            raise ConfigError(f"{key} = {value!r} is not one of {', '.join(CHOICES[f.name])}"
                              f"{_suggest(str(value), CHOICES[f.name])}.")
        if f.name in POSITIVE and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}.")
        if f.name in NON_NEGATIVE and value < 0:
            raise ConfigError(f"{key} must be zero or positive, got {value}.")
        if f.name in UNIT_INTERVAL:
            lo, hi = UNIT_INTERVAL[f.name]
            if not (lo <= value < hi) or (f.name == "train_fraction" and value <= 0):
                raise ConfigError(f"{key} must lie in [{lo}, {hi}), got {value}.")


def _check_bounds(key: str, value: Any, bounds) -> None:
    """The bounds a component's ``setting(...)`` declares."""
    if "choices" in bounds and value not in bounds["choices"]:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(bounds['choices'])}"
                          f"{_suggest(str(value), bounds['choices'])}.")
    if "gt" in bounds and not value > bounds["gt"]:
        raise ConfigError(f"{key} must be greater than {bounds['gt']}, got {value}.")
    if "ge" in bounds and not value >= bounds["ge"]:
        raise ConfigError(f"{key} must be at least {bounds['ge']}, got {value}.")
    if _strict() and "le" in bounds and not value <= bounds["le"]:
        raise ConfigError(f"{key} = {value} is larger than the most this library supports, "
                          f"{bounds['le']:,}; choose a smaller value.")
    if _strict() and "lt" in bounds and not value < bounds["lt"]:
        raise ConfigError(f"{key} must be less than {bounds['lt']}, got {value}.")


def _coerce(key: str, value: Any, hint) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key} must not be empty.")
    for t in allowed:
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            if isinstance(value, list) and all(
                    isinstance(v, item) and not isinstance(v, bool) for v in value):
                return list(value)
            continue
        if t is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if t is int and isinstance(value, bool):
            continue
        if t is not type(None) and isinstance(value, t):
            return value
    names = " or ".join("none" if t is type(None) else
                        f"a list of {typing.get_args(t)[0].__name__}" if typing.get_origin(t)
                        is list else t.__name__ for t in allowed)
    raise ConfigError(f"{key} must be {names}, got {type(value).__name__} {value!r}.")


GRAD_MODES = ("direct", "adjoint", "checkpoint", "reversible")


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


# ----------------------------------------------------------------------------- documentation

def field_docs(cls: type) -> dict[str, str]:
    """The documentation of a dataclass's fields: the string literal right below each one (as
    in this module), read from the class's source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a class made at run time)
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and \
                isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain(cfg: RunConfig) -> str:
    """Every setting of ``cfg`` with its value, type, default and documentation, section by
    section, the model's component tables included (``continuumlm inspect --explain``)."""
    lines: list[str] = []

    def block(title: str, obj) -> None:
        docs = field_docs(type(obj))
        hints = typing.get_type_hints(type(obj))
        lines.append(f"[{title}]")
        for f in fields(obj):
            if f.name == "components":
                continue
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING
                       else None)
            hint = getattr(hints[f.name], "__name__", None) or str(hints[f.name])
            value = getattr(obj, f.name)
            changed = "" if value == default else f"  (default {default!r})"
            lines.append(f"  {f.name} = {value!r}  [{hint}]{changed}")
            bounds = ", ".join(f"{k} {v}" for k, v in f.metadata.items())
            doc = docs.get(f.name, "")
            if doc or bounds:
                lines.append(f"      {doc}{f' ({bounds})' if bounds else ''}")
        lines.append("")

    for name in SECTIONS:
        block(name, getattr(cfg, name))
        if name == "model":
            for comp, obj in sorted(cfg.model.components.items()):
                block(f"model.{comp}", obj)
    return "\n".join(lines)
