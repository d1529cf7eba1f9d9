"""How much memory a model needs, checked before any of it is allocated."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import ConfigError


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
                 shards: int = 1, copies: int = 1, build=None) -> int:
    """Refuse a model that cannot fit before any of it is allocated (a 65,536-wide model would
    otherwise end in an allocator traceback, or the kernel killing the process). The model is
    built on the meta device to count its tensors; the need is a lower bound: float32 weights
    and buffers, plus gradients and Adam's two moments when ``training`` (split over ``shards``
    FSDP ranks), times ``copies`` processes sharing the machine. Activations come on top.
    ``build(cfg)`` makes the model (``LanguageModel``; ``model.lm.check_memory`` passes it).
    Returns the parameter count."""
    device = torch.device(device)

    def count(layers: int) -> tuple[int, int]:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            model = build(dataclasses.replace(cfg, num_layers=layers))
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
