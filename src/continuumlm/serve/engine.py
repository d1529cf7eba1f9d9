"""The serving engine: many requests decoded together, joining and leaving a running batch at
token boundaries (continuous batching), each row with its own exact caches.

One thread owns the model. Each turn of its loop it

1. admits waiting requests (first come, first served) while the running rows number fewer
   than ``max_batch``: each prompt is consumed alone (batch 1, the request's own solve) and
   the row's first token is drawn from that pass;
2. steps every group of rows once: the rows of one *depth* (solver, steps, per-token exit)
   share a :class:`~continuumlm.model.cache.DecodeState` and one batched forward; a row that
   joins its group's state padded on the left to the longest row, so it decodes on exactly
   as it would alone (the padding invariant): it takes the slot of a row that finished,
   copying its own caches only (``DecodeState.put_rows``); the whole state is rebuilt
   (``DecodeState.regroup``: free slots and positions that are pads in every row dropped)
   only when a row does not fit or much of the state is idle;
3. advances every self-speculative request (``draft``; batch 1 by its nature) by one token.
   Drafted requests share one decoder, so a pipelined draft (``draft.pipeline``) keeps its
   drafting process between requests (closed with the engine); while a pipelined request
   runs, torch's threads in the engine are held at one (the drafter has the other core);
4. advances every *lone* row by one token: a request of one row that came to an idle engine
   decodes alone through the lean step of its solve, as ``generate`` does, until a request
   joins its depth (:mod:`.lone` says when, and how it moves into the batch).

Groups take turns (round robin): with several depths running, a token of each group costs the
sum of the groups' steps. A request's tokens are those it gets alone: greedy, the same tokens;
sampled, the same draws (each row draws from its own generator, seeded by the request's
``seed``, with the same calls as ``generate``); up to logits that tie within float rounding,
which a batch may sum in another order than a single row.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import torch

from ..model.cache import DecodeState
from .lone import QUIET_TURNS, Lone, advance_lone, goes_lone, start_lone
from .request import Depth, Event, Request, Row, Sampling, prompt_logprobs

# Depth, Event, Request and Sampling are named here too: what a caller hands the engine
__all__ = ["Closed", "Depth", "Engine", "Event", "QueueFull", "Request", "Sampling"]

log = logging.getLogger("continuumlm")


class QueueFull(Exception):
    """The queue holds ``max_queue`` rows already (HTTP 429)."""


class Closed(Exception):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class Group:
    """The rows of one depth and their shared decoding state; ``rows[i]`` decodes in the
    state's row i (None: a free slot, decoded but not read, until a new row takes it)."""

    def __init__(self, depth: Depth) -> None:
        self.depth = depth
        self.rows: list[Row] = []
        self.state: DecodeState | None = None


class Engine:
    """Decodes the requests given to :meth:`submit` on a thread of its own (:meth:`start`);
    see the module's text. ``default`` is the depth of a request that names none."""

    def __init__(self, model, tokenizer, max_batch: int = 32, max_queue: int = 256,
                 threads=None, max_prefill_tokens: int = 256, lean: bool = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.lean = lean
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.threads = threads
        self.device = next(model.parameters()).device
        self.waiting: deque[Request] = deque()
        self.groups: dict[Depth, Group] = {}
        self.solos: list[tuple[Request, Row, object]] = []
        self.lones: list[Lone] = []  # rows decoded alone through the lean step
        self._drafting = None  # the drafted requests' Decoder, made at the first
        self.cond = threading.Condition()
        self.closing = False
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.turns = 0
        self.crowded = -QUIET_TURNS - 1  # the last turn that ended with two rows or more
        cfg = model.config
        self.ode = cfg.depth == "ode"
        self.default = Depth(cfg.ode_solver, cfg.ode_steps) if self.ode else Depth()
        model.eval()

    # ------------------------------------------------------------------ the other threads'

    def submit(self, request: Request) -> None:
        with self.cond:
            if self.closing:
                raise Closed("the server is shutting down")
            queued = sum(r.rows for r in self.waiting)
            if queued + request.rows > self.max_queue:
                raise QueueFull(f"the queue holds {queued} rows waiting for a place in the "
                                f"batch, and {request.rows} more would pass --max-queue "
                                f"{self.max_queue}; retry later")
            self.waiting.append(request)
            self.cond.notify()

    def start(self) -> Engine:
        self.thread = threading.Thread(target=self._run, name="continuumlm-engine", daemon=True)
        self.thread.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Finish every admitted and waiting request, then stop the thread."""
        with self.cond:
            self.closing = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    @property
    def running(self) -> int:
        """Rows decoding now (a finished row's state is let go at the next turn)."""
        return sum(r is not None and r.alive for g in self.groups.values() for r in g.rows) \
            + len(self.solos) + len(self.lones)

    def stats(self) -> dict:
        with self.cond:
            return {"running": self.running, "waiting": sum(r.rows for r in self.waiting),
                    "groups": {g.depth.describe(): sum(r is not None and r.alive for r in g.rows)
                               for g in self.groups.values()},
                    "lone": len(self.lones), "turns": self.turns}

    @property
    def busy(self) -> bool:
        """Anything waiting or decoding."""
        return bool(self.waiting or self.groups or self.solos or self.lones)

    # ------------------------------------------------------------------ the engine's thread

    def _run(self) -> None:
        if self.threads is not None:
            self.threads.apply()
        try:
            while True:
                with self.cond:
                    while not (self.busy or self.closing):
                        self.cond.wait()
                    if self.closing and not self.busy:
                        return
                if self.threads is not None:
                    self.threads.poll()
                self.turn()
        except BaseException as e:  # noqa: BLE001 - kept for the server to report
            self.error = e
            log.exception("serving engine stopped")
            self._fail_all(f"the serving engine stopped: {e}")
            raise
        finally:
            if self._drafting is not None:
                self._drafting.close()  # the pipelined drafts' processes

    @torch.inference_mode()
    def turn(self) -> None:
        """One turn: admit, step every group once, advance every speculative request and
        every lone row."""
        self.turns += 1
        joining = self._admit()
        for depth in [*self.groups, *(d for d in joining if d not in self.groups)]:
            try:
                self._regroup(depth, joining.get(depth))
            except Exception as e:  # noqa: BLE001 - fail these requests, keep serving
                log.exception("rebuilding a batch failed")
                group = self.groups.get(depth)
                rows = [r for r in (group.rows if group else []) if r is not None]
                rows += joining[depth][2] if depth in joining else []
                self._fail(rows, e)
                with self.cond:
                    self.groups.pop(depth, None)
        for group in list(self.groups.values()):
            self._step(group)
        for solo in list(self.solos):
            self._advance(solo)
        for lone in list(self.lones):
            advance_lone(self, lone)
        if self.running > 1:
            self.crowded = self.turns

    def _regroup(self, depth: Depth, joining) -> None:
        """The depth's batch after this turn's changes. A row that finished or was cancelled
        frees its slot (``DecodeState.retire``); a prompt just read (``joining``: its state,
        the rows of it to keep, their Row objects) takes free slots, copying only its own
        caches (``put_rows``). The whole state is copied (``regroup``) only when the joining
        rows do not fit (no free slot, or more positions than the batch has), when fewer
        than half the slots are busy and no request waits to fill them, or when the
        positions that are pads in every row reach half the state."""
        group = self.groups.get(depth)
        if group is None:
            if joining is not None:
                state, keep, rows = joining
                group = Group(depth)
                group.state = (state if keep == list(range(state.batch_size)) else
                               DecodeState.regroup([(state, self._index(keep))]))
                group.rows = rows
                with self.cond:
                    self.groups[depth] = group
            return
        for i, r in enumerate(group.rows):
            if r is not None and not r.alive:
                group.rows[i] = None
                group.state.retire(i)
        if joining is not None:
            state, keep, rows = joining
            free = [i for i, r in enumerate(group.rows) if r is None]
            if len(free) >= len(rows) and self._fits(state, keep, group.state):
                group.state.put_rows(free[:len(rows)], state, keep)
                for i, row in zip(free, rows):
                    group.rows[i] = row
            else:
                busy = [i for i, r in enumerate(group.rows) if r is not None]
                parts = [(group.state, self._index(busy))] if busy else []
                group.state = DecodeState.regroup(parts + [(state, self._index(keep))])
                group.rows = [group.rows[i] for i in busy] + rows
        busy = [i for i, r in enumerate(group.rows) if r is not None]
        if not busy:
            with self.cond:
                del self.groups[depth]
            return
        idle = 2 * len(busy) <= len(group.rows) and len(group.rows) > 1 and not self.waiting
        if idle or group.state.leading_pads() >= max(16, group.state.pos // 2):
            group.state = DecodeState.regroup([(group.state, self._index(busy))])
            group.rows = [group.rows[i] for i in busy]

    def _index(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, device=self.device)

    def _fits(self, state: DecodeState, keep: list[int], batch: DecodeState) -> bool:
        """Whether the rows ``keep`` of ``state`` hold no more real positions than ``batch``
        has (they join right-aligned, without moving the batch)."""
        _, start = state._rows(self._index(keep), self.device)
        return state.pos - start <= batch.pos

    def _use(self, depth: Depth) -> None:
        m = self.model
        if self.ode and (m.config.ode_solver, m.config.ode_steps) != (depth.solver, depth.steps):
            m.set_solver(depth.solver, depth.steps, ode_grad="direct")
        if depth.exit is None:
            m.set_exit(None)
        else:
            m.set_exit(depth.exit[1], depth.exit[0])

    def _nfe(self, row: int) -> int:
        per_token = self.model.last_token_nfe
        return int(per_token[row, -1]) if per_token is not None else self.model.last_nfe

    def _admit(self) -> None:
        """Take waiting requests, first come first served, while the batch has room and this
        turn's prompt budget (``max_prefill_tokens``) lasts, at least one request a turn: the
        prompts that join together are read in one padded pass per depth, so a wave of
        arrivals costs the running rows one longer turn, not one per request."""
        taken, budget = [], self.max_prefill_tokens
        with self.cond:
            running = self.running
            idle = running == 0
            while self.waiting:
                req = self.waiting[0]
                if req.cancelled:
                    self.waiting.popleft()
                    continue
                tokens = sum(map(len, req.prompts))
                if taken and tokens > budget:
                    break
                if running and running + req.rows > self.max_batch:
                    break
                self.waiting.popleft()
                taken.append(req)
                running += req.rows
                budget -= tokens
        by_depth: dict[Depth, list[Request]] = {}
        lone = goes_lone(self, taken, idle)
        for req in taken:
            if req.draft is not None:
                self._guarded([req], self._start_draft, req)
            elif not lone or self._guarded([req], start_lone, self, req) is False:
                by_depth.setdefault(req.depth, []).append(req)
        joining = {}
        for depth, reqs in by_depth.items():
            movers = [x for x in self.lones if x.depth == depth and x.row.alive]
            read = self._guarded(reqs, self._prefill, depth, reqs, movers)
            if read is not None:
                joining[depth] = read
                with self.cond:  # they decode in the batch from now on
                    self.lones = [x for x in self.lones if x not in movers]
        return joining

    def _guarded(self, reqs: list[Request], fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a request the model refuses: its error
            log.exception("request failed at its prompt")
            for req in reqs:
                req.sink(Event("error", message=f"{type(e).__name__}: {e}"))
            return None

    def _prefill(self, depth: Depth, reqs: list[Request], movers: list[Lone] = ()):
        """Read the prompts of ``reqs`` (one depth) in one pass, left-padded to the longest,
        and draw each row's first token: (the state, the prompt of each row that goes on
        (n rows of a prompt repeat it), the rows), or None when none goes on. ``movers``:
        lone rows of this depth that join the batch, the tokens their steps read read again
        in the same pass (their latest token is fed at the next step, as any row's)."""
        self._use(depth)
        prompts = [(req, p, prompt) for req in reqs for p, prompt in enumerate(req.prompts)]
        prompts += [(None, x.row, x.seen) for x in movers]
        length = max(len(x[2]) for x in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(prompts), length, dtype=torch.bool, device=self.device)
        for i, (_, _, prompt) in enumerate(prompts):
            ids[i, length - len(prompt):] = torch.tensor(prompt)
            mask[i, length - len(prompt):] = True
        state = self.model.init_state(len(prompts))
        h = self.model.hidden_states(ids, state, attention_mask=None if bool(mask.all())
                                     else mask)
        last = self.model.lm_head(h[:, -1])  # (rows, vocab), as generate's read-out
        keep, rows = [], []
        for i, (req, p, prompt) in enumerate(prompts):
            if req is None:  # a lone row that moves in (p: its Row)
                rows.append(p)
                keep.append(i)
                continue
            nfe = self._nfe(i)
            if req.echo:
                logits = (self.model.lm_head(h[i, length - len(prompt):])
                          if req.logprobs is not None else None)
                req.sink(Event("prompt", p, tokens=prompt,
                               logprobs=prompt_logprobs(logits, prompt, req.logprobs)))
            for j in range(req.n):
                row = Row(req, p * req.n + j, self.tokenizer, self.device)
                if req.max_tokens == 0:
                    row.finish("length")
                    continue
                row.take(row.choose(last[i]), last[i], nfe)
                if not row.done:
                    rows.append(row)
                    keep.append(i)
        return (state, keep, rows) if rows else None

    def _step(self, group: Group) -> None:
        self._use(group.depth)
        busy = [r is not None and r.alive for r in group.rows]
        ids = torch.tensor([[r.pending if b else 0] for r, b in zip(group.rows, busy)],
                           dtype=torch.long, device=self.device)
        # a free slot holds only the token it is fed now: it keeps no earlier position from
        # being dropped, and a learned-position model's free row never runs past its table
        for i, b in enumerate(busy):
            if not b:
                group.state.retire(i)
        try:
            logits = self.model.lm_head(self.model.hidden_states(ids, group.state)[:, -1])
            for i, row in enumerate(group.rows):
                if busy[i]:  # (a free slot's output is not read)
                    row.take(row.choose(logits[i]), logits[i], self._nfe(i))
        except Exception as e:  # noqa: BLE001 - fail this group's requests, keep serving
            log.exception("decoding step failed")
            self._fail([r for r in group.rows if r is not None], e)
            with self.cond:
                del self.groups[group.depth]

    @staticmethod
    def _fail(rows: list[Row], e: Exception) -> None:
        """Send each request of ``rows`` (once) the error, and finish its rows."""
        for req in {id(r.request): r.request for r in rows}.values():
            req.sink(Event("error", message=f"{type(e).__name__}: {e}"))
        for r in rows:
            r.done = True

    def _start_draft(self, req: Request) -> None:
        from ..decoding import Decoder

        self._use(req.depth)
        row = Row(req, 0, self.tokenizer, self.device)
        s = req.sampling
        ids = torch.tensor(req.prompts, dtype=torch.long, device=self.device)
        if self._drafting is None:
            self._drafting = Decoder(self.model)
        stream = self._drafting.stream(
            ids, req.max_tokens, s.temperature, s.top_k, s.top_p, s.greedy,
            generator=row.generator, draft=req.draft)
        if req.echo:
            req.sink(Event("prompt", 0, tokens=req.prompts[0], logprobs=None))
        if req.max_tokens == 0:
            row.finish("length")
            return
        with self.cond:
            self.solos.append((req, row, iter(stream)))

    def _advance(self, solo) -> None:
        req, row, stream = solo
        if not req.cancelled:
            self._use(req.depth)
            try:
                before = stream.stats.nfe
                token = int(next(stream)[0])
                # a round's field evaluations fall to the first token it yields
                row.take(token, None, stream.stats.nfe - before)
            except StopIteration:
                row.finish("length")
            except Exception as e:  # noqa: BLE001
                log.exception("speculative decoding failed")
                req.sink(Event("error", message=f"{type(e).__name__}: {e}"))
                row.done = True
        if row.done or req.cancelled:
            with self.cond:
                self.solos.remove(solo)
            _end(stream)

    def _fail_all(self, message: str) -> None:
        with self.cond:
            reqs = {id(r.request): r.request for g in self.groups.values() for r in g.rows
                    if r is not None}
            reqs.update({id(s[0]): s[0] for s in self.solos})
            reqs.update({id(x.row.request): x.row.request for x in self.lones})
            reqs.update({id(r): r for r in self.waiting})
            solos = list(self.solos)
            self.groups.clear()
            self.solos.clear()
            self.lones.clear()
            self.waiting.clear()
            self.closing = True
        for _, _, stream in solos:
            _end(stream)
        for req in reqs.values():
            req.sink(Event("error", message=message))


def _end(stream) -> None:
    """End a drafted stream now, not when it is collected: a pipelined one hands back its
    drafting process and torch's thread count (a request cancelled mid-stream included)."""
    try:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    except Exception:  # noqa: BLE001 - the stream's own failure was reported already
        log.exception("ending a drafted stream failed")
