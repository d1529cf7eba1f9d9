"""Which lean step runs a model's own solve, if any: one rule for plain decoding (stream.py)
and self-speculative verification (speculative.py). ODE blocks run as
:class:`.lean_draft.LeanDraft`, a discrete stack of layers as :class:`.lean_stack.LeanStack`;
anything either does not cover goes through the decoding pass, the reason named."""

from __future__ import annotations

import torch

from .lean_draft import LeanBase, LeanDraft, own_solve, refusal
from .lean_stack import LeanStack, stack_refusal


def own_step(model, idx: torch.Tensor, asked: bool, frozen: bool = False,
             use_cache: bool = True) -> tuple[LeanBase | None, str]:
    """(the lean step of the model's own solve, or None; how the own solve runs: "lean step",
    or "decoding pass (why)") for decoding ``idx``. ``asked``: the decoder's ``lean``;
    ``frozen``: compiled or recorded steps run the solve instead."""
    why = ("Decoder(lean=False)" if not asked else "no cache" if not use_cache else
           "compiled or recorded steps" if frozen else
           "batch > 1" if idx.shape[0] != 1 else
           f"on {idx.device.type}, not the CPU" if idx.device.type != "cpu" else None)
    stack = model.config.depth != "ode" and hasattr(model.depth, "layers")
    if why is None:
        why = stack_refusal(model) if stack else refusal(model, own_solve(model))
    if why is not None:
        return None, f"decoding pass ({why})"
    return (LeanStack(model) if stack else LeanDraft(model, own_solve(model))), "lean step"
