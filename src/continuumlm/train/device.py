"""Which device a run uses and in which precision: ``train.device`` and ``train.dtype``."""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError


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
