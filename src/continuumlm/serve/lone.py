"""Lone rows of the serving engine (:mod:`.engine`): a request of one row that comes to an
idle engine decodes through the lean step of its solve (``decoding/lean.own_step``: the
model's own solve written out op by op, with caches of its own; what ``generate`` runs at
batch 1), not through the batched decoding pass, which costs more for one row (served,
bench/serve.py: one client gets 1.7x the tokens/s). It does so when nothing else runs or was
admitted with it, no two rows decoded together in the last ``QUIET_TURNS`` turns (the load is
one client at a time), and the lean step covers the model at the request's depth
(``Engine(lean=False)``: never). When a request joins its depth the engine moves the lone row
into the batch (``Engine._prefill``'s ``movers``): the tokens its step has read are read again
in that turn's prompt pass, and it decodes on from its latest token as any row there."""

from __future__ import annotations

import logging

import torch

from ..decoding.lean import own_step
from .request import Depth, Event, Request, Row, prompt_logprobs

log = logging.getLogger("continuumlm")

# turns with one row at most before a request may decode lone: under concurrent clients the
# engine empties for a moment when a wave of rows ends together, and a lone row there would
# move into the batch a turn later, its prompt read twice
QUIET_TURNS = 16


class Lone:
    """A row decoded alone through the lean step (``step``, caches of its own), and the
    tokens that step has read (``seen``: the prompt and every token fed since)."""

    def __init__(self, row: Row, depth: Depth, step, seen: list[int]) -> None:
        self.row, self.depth, self.step, self.seen = row, depth, step, seen


def goes_lone(engine, taken: list[Request], idle: bool) -> bool:
    """Whether the requests admitted this turn (``taken``; ``idle``: none ran before) are one
    row that decodes lone."""
    return (engine.lean and idle and len(taken) == 1 and taken[0].rows == 1
            and engine.turns - engine.crowded > QUIET_TURNS)


def start_lone(engine, req: Request) -> bool:
    """Decode ``req`` (one row) alone through the lean step of its solve, its first token
    drawn from the prompt's pass there; False, with nothing done, where that step does not
    cover the model at the request's depth (the engine batches the request then)."""
    engine._use(req.depth)
    prompt = req.prompts[0]
    step, _ = own_step(engine.model, torch.tensor([prompt], device=engine.device), True)
    if step is None:
        return False
    every = req.echo and req.logprobs is not None
    out = step.logits(prompt, every=every)
    last = out[-1] if every else out
    if req.echo:
        req.sink(Event("prompt", 0, tokens=prompt,
                       logprobs=prompt_logprobs(out if every else None, prompt, req.logprobs)))
    row = Row(req, 0, engine.tokenizer, engine.device)
    if req.max_tokens == 0:
        row.finish("length")
        return True
    row.take(row.choose(last), last, step.nfe)
    if not row.done:
        with engine.cond:
            engine.lones.append(Lone(row, req.depth, step, list(prompt)))
    return True


def advance_lone(engine, lone: Lone) -> None:
    """The lone row's next token; a row that is done or cancelled leaves the engine."""
    row = lone.row
    if row.alive:
        engine._use(lone.depth)
        try:
            logits = lone.step.logits([row.pending])
            lone.seen.append(row.pending)
            row.take(row.choose(logits), logits, lone.step.nfe)
        except Exception as e:  # noqa: BLE001 - fail this request, keep serving
            log.exception("decoding step failed")
            engine._fail([row], e)
    if not row.alive:
        with engine.cond:
            engine.lones.remove(lone)
