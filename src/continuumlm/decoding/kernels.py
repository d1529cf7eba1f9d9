"""Which CPU kernels a decoding process runs: torch's own, or oneDNN's where torch would pick it.

torch routes a float32 GELU on the CPU through oneDNN whenever oneDNN is on (the default),
whatever the size. At decoding's sizes that costs more than it saves: one row of a 512-wide
MLP takes 14 us in oneDNN's GELU against 3 us in torch's own kernel, so batch-1 decoding of
the Shakespeare models runs 1.20-1.24x faster with oneDNN off through the lean step and
1.12-1.13x through the decoding pass; batch 8 gains 1.04-1.06x, batch 32 ties, and a
512-token prompt's one pass runs at 0.95x (bench/cpu_kernels.py). From about 64 rows on
oneDNN's GELU ties or wins (1.5x at 1,024 rows), so training keeps it.

The only switch torch has is ``torch.backends.mkldnn.enabled``, a setting of the whole process:
the library never flips it under a caller (another thread of theirs may be running). A process
that does nothing but decode does: the command line's ``generate`` and ``serve`` (``--onednn
auto``, the default: off for a float32 model on the CPU; compiled decoding, whose kernels
inductor writes, is left with torch's default, unmeasured), putting it back when the
command's work ends. The drafting process of pipelined drafts, forked from the decoding
process, inherits its setting. A program of yours that decodes alone can run its decoding
inside :func:`decoding_kernels`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CHOICES = ("auto", "on", "off")


def onednn_helps(model, compiled: bool = False) -> bool:
    """Whether oneDNN should stay on for decoding ``model``: a model on another device
    (oneDNN is a CPU library), in a half-precision or bfloat16 dtype (oneDNN's products are
    the fast ones there), or compiled (left with torch's default: not measured here)."""
    params = list(model.parameters())
    return (compiled or any(p.device.type != "cpu" for p in params)
            or any(p.is_floating_point() and p.dtype not in (torch.float32, torch.float64)
                   for p in params))


@contextlib.contextmanager
def decoding_kernels(model, choice: str = "auto", compiled: bool = False) -> Iterator[str]:
    """While the block runs, torch's oneDNN switch as a process that decodes with ``model``
    wants it (``choice``: on, off, or auto: off unless :func:`onednn_helps`); yields which, in
    a phrase for a report, and puts the switch back at the end. A setting of the whole process:
    use it where nothing else runs meanwhile (a drafting process forked inside inherits it)."""
    if choice not in CHOICES:
        raise ValueError(f"oneDNN {choice!r}: one of {', '.join(CHOICES)}")
    on = choice == "on" or (choice == "auto" and onednn_helps(model, compiled))
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = on
    try:
        yield "oneDNN on" if on else "torch's own CPU kernels (oneDNN off)"
    finally:
        torch.backends.mkldnn.enabled = was
