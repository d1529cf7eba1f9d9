"""The reversible Heun method (Kidger, Foster, Li & Lyons, 2021) and its O(1)-memory backward.

State (y, z, f) with f = f(t, z). One step:

    z' = 2 y - z + dt f
    f' = f(t + dt, z')                      (the step's only new evaluation)
    y' = y + dt (f + f') / 2

The step is algebraically invertible:

    z = 2 y' - z' - dt f'
    f = f(t, z)
    y = y' - dt (f + f') / 2

so the backward pass rebuilds every earlier state from the final one instead of storing the
trajectory, and back-propagates through one step at a time. The gradient is that of the
discretized forward pass (not an approximation, as the backsolve adjoint is), up to the
round-off of the reconstruction. Under mixed precision (autocast) the field's output is cast to
the state's dtype before the solver adds it, and the backward re-enters the forward's autocast
setting, so rebuilding stays exact to the state's round-off rather than to bf16's. No library
offers this for arbitrary PyTorch modules, hence our own implementation. ``ode_grad = "direct"`` with this solver runs the same arithmetic
through ordinary autograd, the reference the tests compare against.

Stability: for dh/dt = lambda h the step's matrix has determinant -1, so one of its roots lies
outside the unit circle for every real lambda dt != 0; the method is stable only for lambda dt
on the imaginary axis with |lambda dt| < 1. On dissipative or growing fields the parasitic
root amplifies round-off in both directions (lambda = 10, 64 steps: the forward gives -0.77
for e^-10, and the float32 reconstruction error is 2.4e-2). Every backward therefore checks how
far the rebuilt initial state lies from the true one against ``model.reversible_tol``
(relative to the state's largest value, at least 1) and raises :class:`ReversibleError` (a
solver failure: the trainer counts it as a bad step) instead of returning gradients of a
trajectory it did not rebuild.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.autograd.function import once_differentiable

from ..registry import register_solver
from .adaptive import ODESolverError


class ReversibleError(ODESolverError):
    """The reversible Heun backward could not rebuild the forward's states."""


@register_solver("reversible_heun")
class ReversibleHeun(nn.Module):
    fixed_grid = True
    reversible = True
    evals_per_step = 1  # plus one initial evaluation per solve

    def __init__(self, cfg=None):
        super().__init__()
        self.last_reconstruction_error: float | None = None
        self.tol = getattr(cfg, "reversible_tol", 1e-3) if cfg is not None else 1e-3

    @staticmethod
    def integrate_direct(f, h0: torch.Tensor, times: list[float], dt: float) -> torch.Tensor:
        return _forward_states(f, h0, times, dt)[0]

    def integrate_reversible(self, f, h0: torch.Tensor, times: list[float], dt: float,
                             params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return _ReversibleHeunFn.apply(f, self, times, dt, h0, *params)


def _forward_states(f, h0: torch.Tensor, times: list[float], dt: float):
    """The forward pass: final (y, z). Under autograd this is the `direct` reference."""
    y, z = h0, h0
    fz = f(times[0], z).to(h0.dtype)
    for t in times:
        z = 2 * y - z + dt * fz
        f_next = f(t + dt, z).to(h0.dtype)
        y = y + (0.5 * dt) * (fz + f_next)
        fz = f_next
    return y, z


class _ReversibleHeunFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, solver, times, dt, h0, *params):
        with torch.no_grad():
            y, z = _forward_states(f, h0, times, dt)
        ctx.f, ctx.solver, ctx.times, ctx.dt = f, solver, times, dt
        # the backward re-evaluates f: under the same autocast setting, or it would rebuild
        # states from (and differentiate) a different function than the forward ran
        kind = h0.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.params = params
        ctx.save_for_backward(h0, y, z)
        return y

    @staticmethod
    @once_differentiable  # its vjps build no graph: a double backward would be wrong
    def backward(ctx, grad_y):
        kind, enabled, dtype = ctx.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return _backward(ctx, grad_y)


def _backward(ctx, grad_y):
    """The reversible backward (see the module docstring), one step at a time."""
    f, times, dt, params = ctx.f, ctx.times, ctx.dt, ctx.params
    h0, y, z = ctx.saved_tensors
    param_grads = [torch.zeros_like(p) if p.requires_grad else None for p in params]
    wanted = [p for p in params if p.requires_grad]

    def eval_with_graph(t, z_value):
        z_leaf = z_value.detach().requires_grad_(True)
        with torch.enable_grad():
            out = f(t, z_leaf).to(z_leaf.dtype)
        return z_leaf, out

    def vjp(z_leaf, out, cotangent):
        grads = torch.autograd.grad(out, (z_leaf, *wanted), cotangent, allow_unused=True)
        it = iter(grads[1:])
        for i, p in enumerate(params):
            if p.requires_grad:
                g = next(it)
                if g is not None:
                    param_grads[i] += g
        return grads[0] if grads[0] is not None else torch.zeros_like(z_leaf)

    a_y = grad_y
    a_z = torch.zeros_like(grad_y)
    a_f = torch.zeros_like(grad_y)
    z_leaf, f_out = eval_with_graph(times[-1] + dt, z)  # f at the final state, with graph
    for t in reversed(times):
        f1 = f_out.detach()
        # back through y' = y + dt (f + f')/2 and f' = f(t + dt, z')
        dz1 = vjp(z_leaf, f_out, a_f + (0.5 * dt) * a_y)
        a_z1 = a_z + dz1
        # rebuild the state before this step
        z = 2 * y - z - dt * f1
        z_leaf, f_out = eval_with_graph(t, z)
        y = y - (0.5 * dt) * (f_out.detach() + f1)
        # back through z' = 2 y - z + dt f
        a_y, a_z, a_f = a_y + 2 * a_z1, -a_z1, (0.5 * dt) * a_y + dt * a_z1
    # at t0: z0 = y0 and f0 = f(t0, z0)
    dz0 = vjp(z_leaf, f_out, a_f)
    grad_h0 = a_y + a_z + dz0
    with torch.no_grad():
        err = float(torch.maximum((y - h0).abs().max(), (z - h0).abs().max()))
        scale = max(float(h0.abs().max()), 1.0)
    ctx.solver.last_reconstruction_error = err
    if not err <= ctx.solver.tol * scale:  # NaN too
        raise ReversibleError(
            f"the reversible Heun backward rebuilt the initial state {err:.3g} away from the "
            f"one the forward started from (model.reversible_tol = {ctx.solver.tol:g} of its "
            f"largest value, {scale:.3g}): the field is outside the method's stability region "
            f"(dissipative or growing dynamics over {len(times)} steps of {dt:.3g}), so these "
            f"gradients would not be those of the forward. Use more, smaller steps (raise "
            f"model.ode_steps), another solver with ode_grad = 'checkpoint' or 'binomial', or "
            f"raise model.reversible_tol.")
    return (None, None, None, None, grad_h0, *param_grads)
