"""Checking values: types, the bounds of the sections' fields (tables keyed by name) and of
components' fields (declared with ``setting``), and where a wrong value came from."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import fields
from typing import Any

from ..errors import ConfigError

# Allowed values of the plain choice fields. The selectors that name pluggable parts
# (mixer, depth, ...) are checked against their registries instead, see ``_check_selectors``.
CHOICES: dict[str, tuple[str, ...]] = {
    "norm_type": ("layernorm", "rmsnorm", "dyt"),
    "mode": ("decoder", "encoder"),
    "position": ("rope", "learned", "none"),
    "dataset": ("tinyshakespeare", "ptb", "text", "prepared"),
    "unknown_chars": ("unk", "error"),
    "tokenizer": ("char", "word", "bpe"),
    "vocab_source": ("train", "all"),
    "errors": ("strict", "replace"),
    "device": ("auto", "cpu", "cuda", "mps"),
    "dtype": ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
    "strategy": ("ddp", "fsdp"),
    "ode_time_embedding": ("none", "sinusoidal"),
    "ode_adjoint_norm": ("default", "seminorm"),
}


POSITIVE = {
    "hidden_size", "num_heads", "num_layers", "ffn_hidden_size", "max_seq_len", "ode_steps",
    "max_steps", "batch_size", "seq_len", "grad_accum", "eval_interval", "eval_iters",
    "log_interval", "checkpoint_interval", "keep_checkpoints", "train_chars", "lr_decay_steps", "max_bad_steps",
    "dist_timeout_s", "lr", "ode_rtol", "ode_atol", "ode_max_steps", "reversible_tol", "num_kv_pairs", "train_examples", "test_examples", "power_a", "tokenizer_sample_chars",
}


NON_NEGATIVE = {"ode_checkpoints", "warmup_steps", "weight_decay", "grad_clip", "min_lr", "vocab_size"}


UNIT_INTERVAL = {"dropout": (0.0, 1.0), "train_fraction": (0.0, 1.0), "test_fraction": (0.0, 1.0), "beta1": (0.0, 1.0),
                 "beta2": (0.0, 1.0)}


# Sizes beyond what torch can index are refused here, so they never reach a tensor
# constructor's overflow traceback; sizes below this that do not fit in memory are refused by
# ``model.lm.check_memory`` with the memory they would need.
MAX_INT = 2**31 - 1
ODE_TIME_LIMIT = 1e6
UNCAPPED = {"seed", "train_chars", "tokenizer_sample_chars"}  # numbers that never size a tensor


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


def note_old_spelling(moved: list[tuple[str, str]], source: str | None,
                      overridden: dict[str, str] | None) -> None:
    """One line (an ``OldSpelling`` warning, which the CLI prints as ``note: ...``) for the
    keys of one section that a config or --set spelled as an earlier version did: ``moved``
    holds (old, new) dotted names."""
    import warnings

    from ..errors import OldSpelling

    where = _origin(" ".join(old for old, _ in moved), source, overridden)
    names = ", ".join(f"{old} is now {new}" for old, new in moved)
    warnings.warn(f"{names}{where}; the old names still load.", OldSpelling, stacklevel=3)


def _validate(obj, section: str, skip: tuple[str, ...] = ()) -> None:
    """Types, and bounds: a component's Config declares its own (``setting``); the sections
    here use the tables at the top of this module, keyed by field name."""
    hints = typing.get_type_hints(type(obj))
    own = not getattr(type(obj), "run_config_section", False)
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
        # tighter limits of a component's own are its setting(le=...)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT \
                and (own or f.name not in UNCAPPED) and _strict():
            raise ConfigError(f"{key} = {value} is larger than the most this library supports, "
                              f"{MAX_INT:,}; choose a smaller value.")
        if own:
            continue
        if f.name in CHOICES and value not in CHOICES[f.name] and not (
                f.name == "device" and re.fullmatch(r"cuda:\d+", str(value))):
            extra = ", cuda:N (one GPU by index)" if f.name == "device" else ""
            raise ConfigError(f"{key} = {value!r} is not one of {', '.join(CHOICES[f.name])}"
                              f"{extra}{_suggest(str(value), CHOICES[f.name])}.")
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
