"""How often a coarse solve of an ODE model agrees with the model's own solve: teacher-forced
over a split's windows, the fraction of scored positions where the coarse solve's greedy token
equals the own solve's, and the mean KL(own || coarse) of their next-token distributions. The
figure speculative decoding through depth lives on (a greedy draft is kept where they agree).
A discrete stack's drafts are its first layers through its final norm and head, spelled
``("layers", n)`` (``layers:N``), as ``--draft-layers`` drafts."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..data import eval_batches
from ..decoding.speculative import FirstLayers


def check_draft_of(model, solve: tuple[str, int]) -> None:
    """A ValueError naming what is wrong with ``solve`` as a draft of ``model``."""
    kind, n = solve
    layers = model.config.num_layers
    if model.config.depth != "ode":
        if kind != "layers" or not 1 <= n < layers:
            raise ValueError(f"a discrete model's drafts are its first layers: layers:N with "
                             f"N from 1 to {layers - 1}, got {kind}:{n}")
    elif kind == "layers":
        raise ValueError("an ODE model's drafts are coarser solves of its blocks "
                         "(SOLVER:STEPS, e.g. euler:1), not its first layers")


@contextlib.contextmanager
def drafting(model, solve: tuple[str, int]):
    """The model as ``solve`` drafts with, for the block only."""
    check_draft_of(model, solve)
    if solve[0] == "layers":
        with FirstLayers(model, solve[1]).drafting():
            yield
        return
    own = (model.config.ode_solver, model.config.ode_steps, model.config.ode_grad)
    model.set_solver(*solve, ode_grad="direct")  # no gradients here
    try:
        yield
    finally:
        model.set_solver(*own)


@torch.no_grad()
def agreement(model, data: torch.Tensor, context: int, solves: list[tuple[str, int]],
              device: torch.device, batch_tokens: int = 16384,
              max_windows: int | None = None) -> dict[str, dict]:
    """{"SOLVER:STEPS": {"agreement": fraction, "kl": mean nats, "loss": the draft's mean
    cross-entropy, "own_loss": the own solve's, "positions": n}} for each of ``solves``,
    against the model's solve as it is set (the windows of ``eval``: every target scored
    once). Each solve runs once per window: the losses come from the same logits."""
    model.eval()
    for s in solves:
        check_draft_of(model, s)
    same = {s: 0 for s in solves}
    kl = {s: 0.0 for s in solves}
    nll = {s: 0.0 for s in solves}
    own_nll = 0.0
    count = 0
    for x, y in eval_batches(data, context, max(1, batch_tokens // context), max_windows):
        x, y = x.to(device), y.to(device)
        scored = y >= 0
        ref = F.log_softmax(model(x)[0].float()[scored], -1)
        target = y[scored]
        greedy = ref.argmax(-1)
        own_nll += float(F.nll_loss(ref, target, reduction="sum"))
        count += int(scored.sum())
        for s in solves:
            with drafting(model, s):
                logq = F.log_softmax(model(x)[0].float()[scored], -1)
            same[s] += int((logq.argmax(-1) == greedy).sum())
            kl[s] += float((ref.exp() * (ref - logq)).sum())
            nll[s] += float(F.nll_loss(logq, target, reduction="sum"))
    return {f"{a}:{b}": {"agreement": same[(a, b)] / count, "kl": kl[(a, b)] / count,
                         "loss": nll[(a, b)] / count, "own_loss": own_nll / count,
                         "positions": count} for a, b in solves}
