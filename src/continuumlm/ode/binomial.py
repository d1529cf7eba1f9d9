"""Binomial checkpointing of a fixed-grid solve (``ode_grad = "binomial"``): exact gradients
with memory for ``c`` saved states, whatever the number of steps.

``torch.utils.checkpoint`` per step (``ode_grad = "checkpoint"``) keeps every step's input, so
its memory grows linearly in the steps. With ``c`` checkpoints, the backward pass reverses the
``n`` steps by recursion (Griewank's binomial scheme, the one Revolve schedules): to reverse
the steps [i, j) from a held state h_i, advance without a graph to a split point m, keep h_m in
a free checkpoint, reverse [m, j) with one checkpoint fewer, free it, then reverse [i, m). A
single step is reversed by recomputing it with a graph and backpropagating through it. The
forward pass already keeps the checkpoints of the first splits (the recursion's right spine),
so those advances are not repeated. The split points minimize the steps recomputed, found by
a small dynamic programme (written here: torch has no such scheduler).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable


def default_checkpoints(steps: int) -> int:
    """About log2 of the steps (at least 1): the recompute factor then stays near log2(n)."""
    return max(1, math.ceil(math.log2(max(steps, 2))))


MAX_STEPS = 4096


def _build_tables(n: int, c: int):
    """cost[k][m]: fewest steps advanced without a graph to reverse m steps from a held start
    with k free checkpoints; split[k][m]: the best first split (0: none). Filled bottom-up with
    cost[k][m] = min over s of s + cost[k-1][m-s] + cost[k][s], cost[k][1] = 0 and
    cost[0][m] = m(m-1)/2 (every input recomputed from the start)."""
    import numpy as np

    m = np.arange(n + 1, dtype=np.int64)
    cost = [m * (m - 1) // 2]
    split = [np.zeros(n + 1, dtype=np.int64)]
    cost[0][0] = 0
    for _ in range(c):
        prev = cost[-1]
        cur, where = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
        for length in range(2, n + 1):
            s = np.arange(1, length)
            total = s + prev[length - s] + cur[s]
            k = len(total) - 1 - int(total[::-1].argmin())  # ties: the latest split, so the
            # forward pass keeps checkpoints further on and the backward recomputes less
            cur[length], where[length] = total[k], s[k]
        cost.append(cur)
        split.append(where)
    return cost, split


_TABLES: list = [0, 0, None]  # the largest tables built so far: [steps, checkpoints, tables]


def _tables(n: int, c: int):
    """Tables that cover n steps and c checkpoints: one set serves every smaller plan (the
    nested plans of a backward pass all are), so a backward builds at most one."""
    if n > _TABLES[0] or c > _TABLES[1]:
        n, c = max(n, _TABLES[0]), max(c, _TABLES[1])
        _TABLES[:] = [n, c, _build_tables(n, c)]
    return _TABLES[2]


def _plan(n: int, c: int) -> tuple[int, int]:
    """(steps advanced without a graph to reverse n steps with c free checkpoints, the best
    first split; 0 when none is made)."""
    if n <= 1:
        return 0, 0
    if c == 0:
        return n * (n - 1) // 2, 0
    cost, split = _tables(_bucket(n), c)
    return int(cost[c][n]), int(split[c][n])


def _bucket(n: int) -> int:
    """Tables are built for a power of two at least n, so nested plans share them."""
    return 1 << max(n - 1, 1).bit_length()


def spine(n: int, c: int) -> list[tuple[int, int]]:
    """The checkpoints the forward pass keeps: [(step index, free checkpoints left below it)],
    starting with (0, c) for the initial state."""
    points, i, free = [(0, c)], 0, c
    while n - i > 1 and free > 0:
        i += _plan(n - i, free)[1]
        free -= 1
        points.append((i, free))
    return points


def recomputed_steps(n: int, c: int) -> int:
    """Steps advanced without a graph in the backward pass (each reversed step is also run once
    more, with its graph): the backward evaluates the field (this + n) x stages times."""
    if n > MAX_STEPS:
        raise ValueError(f"binomial checkpointing plans at most {MAX_STEPS} steps, not {n}.")
    return _plan(n, c)[0] - spine(n, c)[-1][0]


class _BinomialSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h0, step, n, c, autocast, *params):
        ctx.step, ctx.n, ctx.autocast = step, n, autocast
        ctx.points = spine(n, c)
        # the spine's states are made here without a graph: held on ctx (not saved tensors)
        # so that the backward can let each go once its segment is reversed, keeping at most
        # c + 1 states alive at any time, as the schedule assumes
        ctx.kept, h, i = [], h0, 0
        for start, _ in ctx.points[1:]:
            h = _advance(step, h, i, start)
            ctx.kept.append(h)
            i = start
        h = _advance(step, h, i, n)
        ctx.save_for_backward(h0, *params)
        return h

    @staticmethod
    @once_differentiable  # its vjps build no graph: a double backward would be wrong
    def backward(ctx, grad_out):
        h0, *params = ctx.saved_tensors
        if len(ctx.kept) != len(ctx.points) - 1:  # freed by an earlier backward
            raise RuntimeError(
                "binomial checkpointing lets go of its checkpoints as the backward pass reverses "
                "them, so a solve can be differentiated once (backward(retain_graph=True) then "
                "a second backward is not supported): run the forward again, or use ode_grad = "
                "'checkpoint', which keeps its checkpoints.")
        grads: list[torch.Tensor | None] = [None] * len(params)
        g, end = grad_out, ctx.n
        with torch.autocast(**ctx.autocast):
            for start, free in reversed(ctx.points):
                h = ctx.kept.pop() if start else h0
                g = _reverse(ctx.step, h, start, end, free, g, params, grads)
                del h
                end = start
        return (g, None, None, None, None, *grads)


def _advance(step, h: torch.Tensor, i: int, j: int) -> torch.Tensor:
    with torch.no_grad():
        for k in range(i, j):
            h = step(k, h)
    return h


def reverse_step(step, h: torch.Tensor, g: torch.Tensor, params, grads: list):
    """Backpropagate ``g`` through one recomputed step ``step(h)`` (with a graph): returns the
    gradient at ``h`` and adds the parameters' gradients into ``grads`` (None: none yet)."""
    with torch.enable_grad():
        x = h.detach().requires_grad_(True)
        out = step(x)
    got = torch.autograd.grad(out, [x, *(p for p in params if p.requires_grad)], g,
                              allow_unused=True)
    it = iter(got[1:])
    for k, p in enumerate(params):
        if p.requires_grad:
            d = next(it)
            if d is not None:
                grads[k] = d if grads[k] is None else grads[k] + d
    return got[0]


def _reverse(step, h_i, i: int, j: int, c: int, g_j, params, grads):
    """Gradient at h_i of <g_j, h_j>, accumulating the parameters' gradients into ``grads``."""
    if j - i == 1:
        return reverse_step(lambda x: step(i, x), h_i, g_j, params, grads)
    if c == 0:  # no free checkpoint: each step's input recomputed from h_i
        g = g_j
        for k in range(j - 1, i - 1, -1):
            g = _reverse(step, _advance(step, h_i, i, k), k, k + 1, 0, g, params, grads)
        return g
    m = i + _plan(j - i, c)[1]
    h_m = _advance(step, h_i, i, m)  # the checkpoint, freed when [m, j) is reversed
    g_m = _reverse(step, h_m, m, j, c - 1, g_j, params, grads)
    del h_m
    return _reverse(step, h_i, i, m, c, g_m, params, grads)


def integrate_binomial(step, h0: torch.Tensor, steps: int, checkpoints: int,
                       params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """h after ``steps`` calls ``h = step(i, h)``, differentiable in h0 and ``params`` (every
    tensor with a gradient that ``step`` reads) with at most ``checkpoints`` saved states."""
    recomputed_steps(steps, checkpoints)  # plans (and refuses) before anything runs
    dev = h0.device.type
    autocast = dict(device_type=dev, enabled=torch.is_autocast_enabled(dev),
                    dtype=torch.get_autocast_dtype(dev))
    return _BinomialSolve.apply(h0, step, steps, checkpoints, autocast, *params)
