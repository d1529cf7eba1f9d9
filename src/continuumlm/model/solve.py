"""One solve of an ODE block (``depth.ODEBlock``): what a forward pass of the block shares
between its field evaluations (this forward's dropout masks and dt, the evaluation count, the
caches of ``model.ode_kv``'s memory), and its three strategies:

- :meth:`Solve.frozen`: a frozen, compiled decoding state, one compiled solver step at a time
  (its stages' evaluations and the solver's combinations are the compiled unit);
- :meth:`Solve.plain`: the integration through ``ode.integrate`` (every solver and gradient
  mode; the regularizers' integrals ride along; truncated backpropagation through depth);
- :meth:`Solve.with_exit`: per-token exit (``model/exit.py``), a token frozen once settled.
"""

from __future__ import annotations

import torch

from ..mixers.cache import Written
from ..mixers.padding import Padding, mix, remember
from ..nn import set_plain
from ..ode import integrate
from ..ode.solvers import grid
from .cache import DecodeState
from .exit import ExitRule, solve_with_exit
from .extras import SolveExtras, augmented
from .ode_kv import StepMemory, memory_step


class Solve:
    """The state of one forward solve of ``block``; made per call of ``ODEBlock._solve``."""

    def __init__(self, block, state: DecodeState | None, extras: SolveExtras | None,
                 padding: Padding | None, evaluate=None):
        for d in block._dropouts:
            d.reset()  # one dropout mask per forward, shared by every step and stage
        self.block, self.state, self.padding, self.evaluate = block, state, padding, evaluate
        self.calls = [0]
        self.field, self.key = block.field, block.index
        self.factory = block.field.mixer.cache_factory
        cfg = self.cfg = block.cfg
        self.extras = extras if (extras is not None and block.training) else None
        extras = self.extras
        self.t1 = extras.t1 if extras is not None and extras.t1 is not None else cfg.ode_t1
        dt = (self.t1 - cfg.ode_t0) / cfg.ode_steps  # read by a dt embedding
        if cfg.ode_dt_embedding_reads == "evaluation":  # the spacing of field evaluations
            dt /= block.solver.evals_per_step
        self.dt = dt
        # this forward's dropout masks (drawn at its first evaluation) and dt live with this
        # object: a backward pass that evaluates f again (checkpoint, binomial, adjoint,
        # reversible) sees them even if another forward ran in between and reset the modules
        self.masks: list = [None] * len(block._dropouts)
        # dropout that draws masks (training): each evaluation restores this forward's masks
        self.dropouts = [d for d in block._dropouts if d.active()]
        # ode_kv "step" / "block": the cache of the current step or block, holding its memory
        self.written: list[Written | None] = [None]
        self.held: list = []  # the decoding state's memory caches this solve wrote
        self.field.dt = dt  # (a plugin field may keep dt otherwise: its own setattr)
        set_plain(block, last_token_nfe=None, last_regularizers={}, step_states=[])

    # ------------------------------------------------------------------ evaluations

    def evaluation(self, fn, t: float, h: torch.Tensor, n: int):
        """``fn`` (the field, or its write) at (t, h) as evaluation ``n`` of this solve.
        ``evaluate`` (a frozen decoding state's evaluator, a compiled call): the plain solve
        runs each solver step through it; per-token exit and reversible solvers, each field
        evaluation."""
        # per evaluation only what can change (Module.__setattr__ costs microseconds, and a
        # decoded token makes dozens of evaluations)
        field, block = self.field, self.block
        if field.dt != self.dt:
            field.dt = self.dt
        if self.dropouts:
            for d, mask in zip(block._dropouts, self.masks):
                d._mask = mask
        if self.evaluate is not None:
            out = self.evaluate(fn, t, h, self.cache_of(n))
        else:
            out = mix(fn, h, self.cache_of(n), self.padding, t)
        if self.dropouts:
            self.masks[:] = [d._mask for d in block._dropouts]
        return out

    def f(self, t: float, h: torch.Tensor) -> torch.Tensor:
        n = self.calls[0]
        self.calls[0] += 1
        return self.evaluation(self.field, t, h, n)

    def memory_cache(self, where) -> Written:
        """The cache of a step or block, new for a forward without a decoding state."""
        if self.state is None:
            return Written(self.factory())
        self.held.append(self.state.cache(("ode", self.key, *where), self.factory))
        return Written(self.held[-1])

    def remember_at(self, t, h: torch.Tensor, where) -> None:
        w = self.memory_cache(where)
        remember(self.field.mixer, self.field.mixer_input(t, h[..., :self.cfg.hidden_size]),
                 w.cache, self.padding)
        self.written[0] = w

    def cache_of(self, n: int):
        if self.cfg.ode_kv != "evaluation":
            return self.written[0]
        if self.state is None:
            return None
        return self.state.cache(("ode", self.key, n), self.factory)

    def at_step(self):
        """``at_step(t, h, dt)`` for ode_kv = "step": the step's memory written at its start
        (None for the other layouts; "block" writes once, here)."""
        cfg = self.cfg
        if cfg.ode_kv == "step":
            def at_step(t: float, h: torch.Tensor, dt: float) -> None:
                self.remember_at(t, h, ("step", round((t - cfg.ode_t0) / dt)))
            return at_step
        return None

    # ------------------------------------------------------------------ strategies

    def frozen_steps(self, exit_rule: ExitRule | None) -> bool:
        """Whether this solve runs a frozen, compiled decoding state a solver step at a time."""
        return (self.evaluate is not None and exit_rule is None and not self.dropouts
                and _steps_compiled(self.block.solver))

    def frozen(self, x: torch.Tensor) -> torch.Tensor:
        """A frozen, compiled decoding state: a solver step (its stages' evaluations and the
        solver's combinations) is the compiled unit, one graph for every step of every block;
        each step gets its stages' caches in order."""
        cfg, solver, state, field = self.cfg, self.block.solver, self.state, self.field
        evaluate, kv = self.evaluate, cfg.ode_kv
        per_step = int(solver.evals_per_step)
        step_dt = (self.t1 - cfg.ode_t0) / cfg.ode_steps
        # t as a tensor: one graph for every step's time, not one per value. On the state's
        # device, made at the first frozen step and kept with the state, so a recorded graph
        # reads it in place (a host tensor would be a copy from pageable memory inside the
        # capture)
        at = ("ode_grid", cfg.ode_t0, self.t1, cfg.ode_steps, x.device)
        if at not in state.shared:
            state.shared[at] = torch.tensor(grid(cfg.ode_t0, self.t1, cfg.ode_steps),
                                            dtype=torch.float64, device=x.device)
        times = state.shared[at]
        for s in range(cfg.ode_steps):
            if kv == "evaluation":
                caches = tuple(self.cache_of(s * per_step + i) for i in range(per_step))
                x = evaluate(_solver_step, solver, field, times[s], x, step_dt, caches)
            elif kv == "step" or s == 0:  # the memory written at the step's start
                self.written[0] = self.memory_cache(("step", s) if kv == "step" else ("block",))
                x = evaluate(memory_step, solver, field, times[s], x, step_dt, self.written[0])
            else:
                x = evaluate(_solver_step, solver, field, times[s], x, step_dt,
                             (self.written[0],) * per_step)
        self.calls[0] = cfg.ode_steps * per_step
        return x

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The integration through ``ode.integrate``: every solver and gradient mode, the
        regularizers' integrals as extra channels, the step states kept for read-outs, and
        truncated backpropagation through depth."""
        cfg, block, extras = self.cfg, self.block, self.extras
        where = f"ODE block {block.index}"
        # what f and the solver read (rk2_gated's gate is the solver's)
        # (a backward pass alone reads them: decoding, at batch 1, skips the walk over the
        # modules, about a tenth of a one-evaluation draft's time)
        params = (tuple(block.field.parameters()) + tuple(block.solver.parameters())
                  if torch.is_grad_enabled() else ())
        C = x.shape[-1]
        f = self.f
        if extras is not None and (extras.kinetic or extras.jacobian):
            f, x = augmented(f, x, extras)
        observe = None
        if extras is not None and extras.readout:
            def observe(n: int, h: torch.Tensor) -> None:
                block.step_states.append(h[..., :C])
        solver = block.solver
        if cfg.ode_kv == "block":
            self.remember_at(cfg.ode_t0, x, ("block",))
        elif cfg.ode_kv == "step":
            solver = StepMemory(solver, self.at_step())
        t0, steps = cfg.ode_t0, cfg.ode_steps
        tail = extras.backprop_steps if extras is not None else None
        if tail is not None and tail < steps and torch.is_grad_enabled():
            # truncated backpropagation through depth: the first steps without autograd, the
            # same grid (t0 + k dt), and the graph from the state they reach
            head, t0 = steps - tail, cfg.ode_t0 + (steps - tail) * (self.t1 - cfg.ode_t0) / steps
            x_in = x
            with torch.no_grad():
                x = integrate(f, x, cfg.ode_t0, t0, solver, head, "direct", params,
                              where=where, observe=observe)
            if observe is not None:
                observe(head - 1, x)
            x, steps = x.detach(), tail
            if extras.backprop_skip:  # the same value; its gradient goes on to the input
                x = x + (x_in - x_in.detach())
        x = integrate(f, x, t0, self.t1, solver, steps, cfg.ode_grad, params, where=where,
                      checkpoints=cfg.ode_checkpoints, observe=observe)
        if x.shape[-1] != cfg.hidden_size:  # the integrals ride along as extra channels
            C = cfg.hidden_size
            names = [n for n in ("kinetic", "jacobian") if getattr(extras, n)]
            block.last_regularizers = {n: x[..., C + i].mean() for i, n in enumerate(names)}
            x = x[..., :C]
        return x

    def with_exit(self, x: torch.Tensor, exit_rule: ExitRule) -> torch.Tensor:
        """Per-token exit: a token whose state has settled stops integrating."""
        cfg = self.cfg
        if cfg.ode_kv == "block":
            self.remember_at(cfg.ode_t0, x, ("block",))

        def write(t: float, h: torch.Tensor) -> torch.Tensor:
            n = self.calls[0]
            self.calls[0] += 1
            # a plugin field without write(): evaluate it whole, keep the cache writes
            self.evaluation(getattr(self.field, "write", self.field), t, h, n)
            return torch.zeros_like(h)

        x, self.block.last_token_nfe = solve_with_exit(
            cfg, self.block.solver, self.f, None if cfg.ode_kv != "evaluation" else write, x,
            exit_rule, self.state is not None, self.at_step())
        return x

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """After the solve: the memory caches let go of what no later read needs, and the
        block's counts are set."""
        if self.held and not torch.is_grad_enabled():
            # every read of the memory is done: a cache that keeps the written tokens beside
            # its state (DeltaNet's, until the next write) lets go of them (a backward pass
            # would replay the reads: kept while grad is on)
            for cache in self.held:
                release = getattr(cache, "release_memory", None)
                if release is not None:
                    release()
        # (_calls: evaluations made later, by a backward pass, still count here)
        set_plain(self.block, last_nfe=self.calls[0], _calls=self.calls)
        return x


def _steps_compiled(solver) -> bool:
    """Whether a frozen state's compiled decoding runs this solver a step at a time: a
    fixed-grid explicit step (the protocol's ``step`` and ``evals_per_step``), not a
    reversible one (whose coupled states live in its own integration loop)."""
    return (getattr(solver, "fixed_grid", True) and not getattr(solver, "reversible", False)
            and hasattr(solver, "step") and isinstance(solver.evals_per_step, int))


def _solver_step(solver, field, t: torch.Tensor, h: torch.Tensor, dt: float, caches: tuple):
    """One solver step whose k-th field evaluation reads and extends ``caches[k]``."""
    stage = iter(caches)
    return solver.step(lambda tt, hh: field(tt, hh, next(stage)), t, h, dt)
