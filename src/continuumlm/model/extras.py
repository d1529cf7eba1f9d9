"""What training adds to every ODE block's solve (set by the trainer's ``SolveRegularizers``,
used in training mode only): the regularizers' integrals, carried as extra channels of the
state so that every solver and gradient mode integrates them with h, STEER's end time, and
whether to keep the states between solver steps for their read-outs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..nn.twice import twice_differentiable


@dataclass(frozen=True)
class SolveExtras:
    """Training-time additions to every ODE block's solve (set by the trainer, used only in
    training mode): the kinetic energy integral of ||f||^2 / C and the Hutchinson estimate of
    the Jacobian's squared Frobenius norm / C (one Gaussian probe per forward) along the solve,
    per token (Finlay et al. 2020, "How to train your neural ODE"), STEER's end time for
    this step (Ghosh et al. 2020), and truncated backpropagation through depth (the first
    steps of a solve without autograd, the last ``backprop_steps`` with it)."""

    kinetic: bool = False
    jacobian: bool = False
    t1: float | None = None
    readout: bool = False  # keep the state after every step but the last (step_states)
    backprop_steps: int | None = None  # only the last N solver steps in the graph (truncated)
    backprop_skip: bool = False  # ... the gradient at the first of them to the block's input


def augmented(f, x: torch.Tensor, extras: SolveExtras):
    """(f, x) of the solve with the regularizers' integrals as extra channels, so that
    every solver and gradient mode integrates them along with h."""
    C = x.shape[-1]
    probe = torch.randn_like(x) if extras.jacobian else None
    k = int(extras.kinetic) + int(extras.jacobian)

    # the Jacobian term is differentiated twice: the mixers' kernels without a second
    # derivative (fused attention, chunkwise DeltaNet) give way to forms that have one
    kernels = twice_differentiable if probe is not None else contextlib.nullcontext

    def f_aug(t, z):
        outer = torch.is_grad_enabled()  # off where a solve runs without a graph
        # the Jacobian term needs a graph even then; the slice is taken inside it, since
        # a view taken without one would hide its base from torch.autograd.grad
        with torch.enable_grad() if probe is not None else contextlib.nullcontext(), \
                kernels():
            h = z[..., :C]
            if probe is not None and not h.requires_grad:
                h = h.detach().requires_grad_(True)
            dh = f(t, h)
            rates = []
            if extras.kinetic:
                rates.append(dh.pow(2).mean(-1, keepdim=True))
            if probe is not None:  # probe^T (df/dh): one vector-Jacobian product
                vjp = torch.autograd.grad(dh, h, probe, create_graph=outer)[0]
                rates.append(vjp.pow(2).mean(-1, keepdim=True))
        out = torch.cat([dh, *rates], -1)
        return out if outer else out.detach()

    return f_aug, torch.cat([x, x.new_zeros(*x.shape[:-1], k)], -1)
