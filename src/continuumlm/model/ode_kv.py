"""``model.ode_kv``: the mixers' memory written at the start of each solver step or block and
read by every field evaluation in it (see docs/continuous_depth.md). The ODE block
(``depth.py``) calls these; its config check reads the refusals."""

from __future__ import annotations

import torch

from ..mixers.cache import Written
from ..mixers.padding import remember


def memory_step(solver, field, t: torch.Tensor, h: torch.Tensor, dt: float,
                 written: Written):
    """One solver step that first writes the mixer's memory from the step's start (t, h)
    into ``written``'s cache, which every evaluation of the step then reads."""
    remember(field.mixer, field.mixer_input(t, h), written.cache)
    return solver.step(lambda tt, hh: field(tt, hh, written), t, h, dt)


class StepMemory:
    """A fixed-grid solver whose every step first calls ``at_step(t, h, dt)`` with the step's
    start (``model.ode_kv = "step"``: the mixer's memory is written there). The memory is a
    function of the step's input, so a step recomputed in the backward pass (checkpoint,
    binomial) writes it again from the same state."""

    fixed_grid = True
    reversible = False

    def __init__(self, solver, at_step) -> None:
        self.solver, self.at_step = solver, at_step
        self.evals_per_step = solver.evals_per_step
        self.tableau = getattr(solver, "tableau", None)

    def step(self, f, t, h: torch.Tensor, dt):
        self.at_step(t, h, dt)
        return self.solver.step(f, t, h, dt)


def kv_refusal(kv: str, mixer: str, solver: str, grad: str, adaptive: bool,
               reversible: bool, memory: bool, encoder: bool = False) -> str | None:
    """Why ``model.ode_kv = kv`` cannot go with this mixer (``memory``: it has write and
    read), solver and gradient mode (``encoder``: mode = "encoder"), in one sentence with the
    way out; None when it can."""
    if kv == "evaluation":
        return None
    what = f"model.ode_kv = {kv!r} (the mixers' memory from the start of each " + (
        "solver step)" if kv == "step" else "block)")
    if not memory:
        return (f"{what} needs a mixer that writes its memory from one input and reads it "
                f"with another (write(m, cache) and read(x, cache)); {mixer!r} has not got "
                f"them: use ode_kv = 'evaluation'.")
    if encoder:
        return (f"{what} is a decoder's: the mixers write the memory of the tokens so far "
                f"(an encoder's reads later tokens too); use ode_kv = 'evaluation' with mode "
                f"= 'encoder'.")
    if reversible:
        return (f"{what} is not implemented for the reversible solver {solver!r}, whose "
                f"backward pass rebuilds states by running the field backwards; use a "
                f"Runge-Kutta solver (euler, midpoint, heun, rk4, ...).")
    if adaptive and kv == "step":
        return (f"{what}: the adaptive solver {solver!r} chooses its own steps; use ode_kv = "
                f"'block', or a fixed-grid solver.")
    if grad == "adjoint":
        return (f"{what}: the backsolve adjoint integrates the field backwards as an ODE in "
                f"the state alone, and this field also reads a memory fixed at a step or "
                f"block's start; use ode_grad = 'direct' or 'checkpoint'.")
    if adaptive and grad != "direct":
        return (f"{what} with the adaptive solver {solver!r} takes ode_grad = 'direct' (its "
                f"recorded steps are replayed without the memory), not {grad!r}.")
    if kv == "block" and grad == "binomial":
        return (f"{what}: binomial checkpointing replays steps from states alone, and the "
                f"block's memory is written before them; use ode_grad = 'checkpoint' or "
                f"'direct' (or ode_kv = 'step').")
    return None
