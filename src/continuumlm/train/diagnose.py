"""Where a training step went non-finite: the first parameter gradient, parameter, or depth
block output that is (the trainer names it when it skips or stops on such a step)."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def first_non_finite(model, amp, x, y, loss_value: float) -> str:
    """Name the first non-finite tensor: a parameter's gradient, or (when the loss itself is
    not finite) the first depth block whose output is."""
    if math.isfinite(loss_value):
        for name, p in model.named_parameters():
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return f"the gradient of {name}"
        return "the gradient norm"
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            return f"the parameter {name}"
    found: list[str] = []
    blocks = getattr(model.depth, "layers", None) or model.depth.blocks
    kind = "layer" if hasattr(model.depth, "layers") else "ODE block"

    def hook(i):
        def fn(module, inputs, output):
            if not found and not torch.isfinite(output).all():
                found.append(f"the output state of {kind} {i}")
        return fn

    handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
    try:
        was_training = model.training
        model.eval()
        with amp:
            logits, _ = model(x, y)
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    if found:
        return found[0]
    return "the loss" if torch.isfinite(logits).all() else "the logits"
