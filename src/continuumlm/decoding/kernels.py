"""Which CPU kernels a decoding process runs: torch's own, or oneDNN's where torch would pick it.

torch routes a float32 GELU on the CPU through oneDNN whenever oneDNN is on (the default),
whatever the size. At decoding's sizes that costs more than it saves: one row of a 512-wide
MLP takes 14 us in oneDNN's GELU against 3 us in torch's own kernel, so batch-1 decoding of
the Shakespeare models runs 15-23% faster with oneDNN off through the lean step and 12-14%
through the decoding pass (bench/cpu_kernels.py; batch 8, 6-8%). From about 64 rows on
oneDNN's GELU is the faster one (1.5x at 1,024 rows), so training and long prompts keep it.

The only switch torch has is ``torch.backends.mkldnn.enabled``, a setting of the whole process:
the library never flips it under a caller (another thread of theirs may be running). A process
that does nothing but decode does: the command line's ``generate`` and ``serve`` (``--onednn
auto``, the default: off for a float32 model on the CPU that is not compiled, which keeps
inductor's oneDNN fusions), putting it back when the command's work ends; the drafting
process of pipelined drafts, forked from the decoding process, inherits its setting. A
program of yours that decodes alone can run its decoding inside :func:`decoding_kernels`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CHOICES = ("auto", "on", "off")


def onednn_helps(model, compiled: bool = False) -> bool:
    """Whether oneDNN should stay on for decoding ``model``: a model on another device
    (oneDNN is a CPU library), in a half-precision or bfloat16 dtype (oneDNN's products are
    the fast ones there), or compiled (inductor fuses through oneDNN)."""
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
