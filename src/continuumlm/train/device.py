"""Which device a run uses and in which precision (``train.device``, ``train.dtype``), and the
compiled forward that falls back to eager (``train.compile``)."""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch

from ..errors import ConfigError, first_line


def pick_device(name: str, given_by: str = "train.device") -> torch.device:
    """The device ``name`` asks for; errors name ``given_by``, where the name came from."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{given_by} = 'cuda' but no CUDA device is available; use 'auto' or "
                          f"'cpu'.")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError(f"{given_by} = 'mps' but MPS is not available; use 'auto' or 'cpu'.")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{given_by} = {name!r} is not a device name; use auto, cpu, cuda, cuda:N "
                          f"or mps.") from None
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{given_by} = {name!r}: this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s); use cuda (the first) or an index below that count.")
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{given_by} = {name!r}: ContinuumLM runs on cpu, cuda or mps.")
    return device


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def resolve_dtype(device: torch.device, dtype: str) -> str:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return dtype


def autocast_for(device: torch.device, dtype: str):
    """Autocast context for ``train.dtype``; parameters and optimizer state stay fp32."""
    dtype = resolve_dtype(device, dtype)
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_kept_freed_memory: bool | None = None  # None: not tried yet in this process


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process (``train.keep_freed_memory``).

    PyTorch's CPU tensors come straight from malloc, which serves each block above its mmap
    threshold (at most 32 MB) by a fresh mmap and unmaps it when freed. A training step that
    allocates the same large tensors every step (logits, their gradients, the MLP's
    activations) then page-faults all of them in again: about 170,000 faults per MQAR step at
    64 pairs, 11,000 with these settings (bench/keep_freed_memory.py). With mmap off
    (M_MMAP_MAX = 0) and trimming only past 2 GB of free heap top (M_TRIM_THRESHOLD) those
    blocks come from the heap and are reused. Results are unchanged; the process keeps its
    peak memory. The settings hold for the rest of the process (a later run in the same
    process with the option off does not undo them). Returns whether they were applied (False
    off Linux or without glibc's mallopt, where the allocator is left as it is); tried once per
    process. PyTorch has no CPU caching allocator of its own, hence these settings."""
    global _kept_freed_memory
    if _kept_freed_memory is not None:
        return _kept_freed_memory
    _kept_freed_memory = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this interpreter is linked with
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # both calls return 1 on success; mallopt takes an int, so 2 GB is the largest threshold.
    # Trimming first: should the second call fail, mmap stays on and nothing changed in effect.
    _kept_freed_memory = bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1)) and bool(
        mallopt(_M_MMAP_MAX, 0))
    return _kept_freed_memory


class CompiledOrEager:
    """``module`` through torch.compile; if compiling fails (at wrap time or, as usual, at the
    first call), one warning and eager calls from then on. ``error``: why it fell back."""

    def __init__(self, module):
        self.module, self.error = module, None
        try:
            self.compiled = torch.compile(module)
        except Exception as e:  # noqa: BLE001 - any backend failure means "run eagerly"
            self._failed(e)

    def __call__(self, *args, **kwargs):
        if self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                self._failed(e)
        return self.module(*args, **kwargs)

    def _failed(self, e: Exception) -> None:
        self.compiled = None
        self.error = f"{type(e).__name__}: {first_line(e)[:300]}"
        print(f"warning: torch.compile failed ({self.error}); training continues without "
              f"compiling (set train.compile = false to silence this).", file=sys.stderr)
