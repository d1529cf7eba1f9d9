"""Typed configuration: model, data and training sections, TOML files and ``--set`` overrides.

Every value is checked when a config is built, so a typo or an impossible size fails at once
with a message that names the key, instead of deep inside a training run.
"""

from __future__ import annotations

import contextlib
import contextvars
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
    "cat_basis": ("fourier", "cheb"),
}

POSITIVE = {
    "hidden_size", "num_heads", "num_layers", "ffn_hidden_size", "max_seq_len", "ode_steps",
    "max_steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters",
    "log_interval", "checkpoint_interval", "keep_checkpoints", "train_chars", "lr_decay_steps", "max_bad_steps",
    "dist_timeout_s", "lr", "ode_rtol", "ode_atol", "ode_max_steps", "cat_n_freq", "cat_n_quad",
    "num_kv_pairs", "train_examples", "test_examples", "power_a",
}
NON_NEGATIVE = {"warmup_steps", "weight_decay", "grad_clip", "min_lr", "vocab_size",
                "deltanet_short_conv", "cat_sob_lambda", "cat_length"}
UNIT_INTERVAL = {"dropout": (0.0, 1.0), "train_fraction": (0.0, 1.0), "beta1": (0.0, 1.0),
                 "beta2": (0.0, 1.0)}
# Sizes beyond what torch can index are refused here, so they never reach a tensor
# constructor's overflow traceback; sizes below this that do not fit in memory are refused by
# ``model.lm.check_memory`` with the memory they would need.
MAX_INT = 2**31 - 1
ODE_TIME_LIMIT = 1e6
# The continuous-attention basis and quadrature: Gauss-Legendre nodes come from the eigenvalues
# of an n x n companion matrix (0.1 s at 1024 nodes, 7 s at 4096) and every query reads every
# node, so larger counts are refused rather than left to stall.
UPPER = {"cat_n_freq": 1024, "cat_n_quad": 1024}
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


@dataclass
class ModelConfig:
    """Architecture of a :class:`~continuumlm.LanguageModel`.

    Field names follow the seed documents (``hidden_size``, ``num_heads``, ``ode_solver``...).
    """

    vocab_size: int = 0
    """Number of token ids; 0 means "take it from the tokenizer" (filled in by the trainer)."""
    hidden_size: int = 128
    num_heads: int = 4
    num_layers: int = 4
    """Distinct layers (discrete depth) or stacked ODE blocks, each with its own weights."""
    ffn_hidden_size: int | None = None
    """Width of the MLP; defaults to 4 * hidden_size."""
    dropout: float = 0.0
    norm_type: str = "layernorm"
    use_bitnet: bool = False
    mode: str = "decoder"
    """"decoder": causal language model; "encoder": bidirectional."""
    position: str = "rope"
    max_seq_len: int = 256
    """Longest sequence the learned position table covers (also the default context)."""
    tie_embeddings: bool = True
    bias: bool = False
    """Biases in linear layers and norms (nanoGPT's ``bias``)."""
    mixer: str = "softmax"
    """Token mixer: softmax, deltanet or continuous."""
    deltanet_short_conv: int = 0
    """Kernel size of DeltaNet's causal depthwise convolution on q, k, v (0 = off)."""
    cat_basis: str = "fourier"
    """Continuous attention basis: "fourier" cosines or "cheb" Chebyshev polynomials."""
    cat_n_freq: int = 32
    """Basis functions per axis of the continuous-attention kernel."""
    cat_n_quad: int = 32
    """Gauss-Legendre nodes of the continuous-attention quadrature."""
    cat_sob_lambda: float = 1e-6
    """Weight of the Sobolev (biharmonic) penalty on the kernel coefficients."""
    cat_length: int = 0
    """Positions per unit of continuous position s (0 = max_seq_len)."""
    depth: str = "discrete"
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
    ode_t1: float = 1.0
    ode_rtol: float = 1e-3
    ode_atol: float = 1e-4
    ode_max_steps: int = 1000
    """Most steps an adaptive solve may take before it stops with an error."""
    ode_time_embedding: str = "none"
    """"sinusoidal" makes the field non-autonomous, dh/dt = Block(h, t)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size
        _validate(self, "model")
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None,
                  saved: bool = False) -> ModelConfig:
        with reading_saved_config() if saved else contextlib.nullcontext():
            return _build(cls, d, "model", source)


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized and split."""

    dataset: str = "tinyshakespeare"
    path: str | None = None
    """A text file (dataset "text"), a corpus file, or a folder with the PTB files."""
    tokenizer: str = "char"
    vocab_size: int | None = None
    """Vocabulary cap for word (most frequent words kept, rest <unk>) and bpe tokenizers."""
    vocab_source: str = "train"
    """Build the char/word vocabulary from the training split ("train") or the whole corpus."""
    train_fraction: float = 0.9
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
    batch_size: int = 12
    seq_len: int = 64
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    lr_decay_steps: int | None = None
    """Steps of cosine decay from lr to min_lr; defaults to max_steps."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    grad_accum: int = 1
    eval_interval: int = 250
    eval_iters: int = 20
    """Validation batches per evaluation (fixed windows spread over the split)."""
    log_interval: int = 10
    checkpoint_interval: int = 500
    keep_checkpoints: int = 3
    max_bad_steps: int = 5
    """Consecutive steps with a non-finite loss or gradient (each skipped) before training stops."""
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"
    """Autocast precision: "bf16"/"bfloat16", "fp16"/"float16" (with a gradient scaler),
    "fp32"/"float32", or "auto" (bf16 on CUDA, fp32 elsewhere). Weights, optimizer state and the
    ODE solvers' time variables stay fp32."""
    compile: bool = False
    """Compile the model with torch.compile (falls back to eager with one warning if it fails)."""
    strategy: str = "ddp"
    """Under torchrun: "ddp" (replicated weights) or "fsdp" (FSDP2, sharded weights and state)."""
    dist_timeout_s: float = 600.0
    """Collective timeout under torchrun: a rank stuck this long fails the job instead of hanging."""

    def __post_init__(self) -> None:
        _validate(self, "train")


@dataclass
class MQARConfig:
    """The multi-query associative recall task (``continuumlm mqar``)."""

    vocab_size: int = 8192
    seq_len: int = 256
    num_kv_pairs: int = 16
    power_a: float = 0.01
    train_examples: int = 100_000
    """Size of the fixed training set (sampled once, reused every epoch, as in Zoology)."""
    test_examples: int = 1000
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
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

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
                base: dict[str, Any] | None = None, where: str | None = None) -> RunConfig:
    """Read a TOML file with [model], [data] and [train] sections (or start from ``base``, a
    dict of sections), then apply ``section.key=value`` overrides (values parsed as TOML, bare
    words as strings)."""
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
        raw[section][name] = value
        overridden[key] = item
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
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            if isinstance(v, bool):
                text = "true" if v else "false"
            elif isinstance(v, str):
                text = '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif isinstance(v, float):
                text = repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
            else:
                text = str(v)
            lines.append(f"{k} = {text}")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation

def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _in(source: str | None) -> str:
    return f" in {source}" if source else ""


_KEY = re.compile(r"\b((?:model|data|train|mqar)\.\w+)")


def _origin(message: str, source: str | None, overridden: dict[str, str] | None) -> str:
    """Where the values an error message names came from: `` (from --set k=v)`` for keys given
    on the command line, `` (in FILE)`` for the rest; empty when neither is known."""
    overridden = overridden or {}
    keys = list(dict.fromkeys(_KEY.findall(message)))
    given = [overridden[k] for k in keys if k in overridden]
    parts = []
    if given:
        parts.append("from " + ", ".join(f"--set {g}" for g in given))
    if source and (len(given) < len(keys) or not keys):
        parts.append(f"in {source}")
    return f" ({'; '.join(parts)})" if parts else ""


def _build(klass, d: dict[str, Any], section: str, source: str | None = None,
           overridden: dict[str, str] | None = None):
    names = {f.name for f in fields(klass)}
    for key in d:
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


def _validate(obj, section: str) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{section}.{f.name}"
        setattr(obj, f.name, _coerce(key, value, hints[f.name]))
        value = getattr(obj, f.name)
        if value is None:
            continue
        if f.name in CHOICES and value not in CHOICES[f.name]:
            raise ConfigError(f"{key} = {value!r} is not one of {', '.join(CHOICES[f.name])}"
                              f"{_suggest(str(value), CHOICES[f.name])}.")
        if f.name in POSITIVE and value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}.")
        if isinstance(value, int) and not isinstance(value, bool) and f.name not in UNCAPPED \
                and value > UPPER.get(f.name, MAX_INT) and _strict():
            raise ConfigError(f"{key} = {value} is larger than the most this library supports, "
                              f"{UPPER.get(f.name, MAX_INT):,}; choose a smaller value.")
        if f.name in NON_NEGATIVE and value < 0:
            raise ConfigError(f"{key} must be zero or positive, got {value}.")
        if f.name in UNIT_INTERVAL:
            lo, hi = UNIT_INTERVAL[f.name]
            if not (lo <= value < hi) or (f.name == "train_fraction" and value <= 0):
                raise ConfigError(f"{key} must lie in [{lo}, {hi}), got {value}.")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}.")


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


def _check_selectors(cfg: ModelConfig) -> None:
    # Imported here: the registries import model code, which imports this module.
    from .mixers import MIXERS
    from .model.depth import DEPTHS
    from .ode import FIELDS, GRAD_MODES, SOLVERS

    _check_registry("model.mixer", cfg.mixer, MIXERS)
    _check_registry("model.depth", cfg.depth, DEPTHS)
    _check_registry("model.field", cfg.field, FIELDS)
    _check_registry("model.ode_solver", cfg.ode_solver, SOLVERS)
    _check_registry("model.ode_grad", cfg.ode_grad, dict.fromkeys(GRAD_MODES))
    checker = getattr(DEPTHS[cfg.depth], "check_config", None)
    if checker is not None:
        checker(cfg)


def _check_registry(key: str, value: str, registry: dict) -> None:
    if value not in registry:
        raise ConfigError(f"{key} = {value!r} is not available{_suggest(value, registry)}; "
                          f"available: {', '.join(sorted(registry))}.")
