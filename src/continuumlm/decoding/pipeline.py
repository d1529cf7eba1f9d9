"""Self-speculative decoding with the drafts made ahead, in a process of their own
(``Draft(pipeline=True)``): drafting runs on one core while the model's own solve verifies on
another (LoopSpec's pipelining of drafting with verification).

In the serial loop (speculative.py) a round drafts k tokens, then verifies them: the verifier
waits for the drafts and the drafter for the verdict. Here a second process (forked, so it
holds the model's weights as they were then) runs the draft's lean step without stopping:
from the latest token the verifier gave it, it drafts token after token, each after its own
last, publishing each into shared memory, up to ``2k + 3`` ahead of what the verifier has
taken. A round takes the drafts it needs, checks them in one pass of the model's own solve
and, when it keeps them all, checks the drafter's next draft too, at the pass's last row (the
position a serial round fills with a token of its own choosing): with the same rule as any
draft (greedy: it is the model's token; sampled: kept with probability min(1, p / q), else the
token is drawn from the residual). Then either

- that draft was kept: what the drafter made after it was drafted from the tokens decoded, so
  its run goes on and the next round takes up to k drafts from there at once; or
- a draft was refused (or none was left to check): the drafter starts again from the token the
  verifier chose, at the position after the kept ones (a new *epoch*: what it made for the old
  one is dropped), and the next round takes ``max(1, k // 4)`` drafts, the first it makes, so
  the verifier waits for a few drafts rather than k (see below for greedy rounds).

Sampled, which drafts a round takes is fixed by the tokens alone, never by timing
(``max(1, k // 4)`` after a start, k in a run, fewer where the stream ends or the learned
positions run out), and a draft is drawn from a generator seeded from the stream's generator
and the epoch (counted from the stream's first): the text is a function of the prompt, the
settings and the seed, speculative sampling's exact distribution, the same draws on every run.
Greedy, a round takes the drafts that are ready (``max(1, k // 4)`` at least, k at most): the
tokens are plain decoding's whatever the drafts, so a round need not wait for all k
(tests/test_pipeline.py: greedy against plain decoding; sampled against the distribution
enumerated exactly, and run against run). The drafter is told a round's outcome before its
tokens go out, so it drafts while the caller reads them.

What it needs: Linux (``fork``), CPU, one sequence, eager decoding through the lean steps
(the draft's and the own solve's: lean_draft.py, lean_stack.py), a fixed number of drafted
tokens per round (``Draft.tokens``, not ``"auto"``), no ``confidence``. Layer drafts make
their own first layers' caches in the drafter (LayerSkip's cache reuse is between two steps
of one process). The verifier runs on one intra-op thread while the stream runs (the drafter
has the other core); the count found is put back at the end. A decoder keeps its drafting
processes between streams (:class:`DrafterPool`) while the model's weights are unchanged.

Shared state: a few counters (an int64 tensor in shared memory), the drafted tokens and their
distributions (rings of ``2k + 4`` slots); the drafter publishes a draft under a lock after
writing it and the verifier reads (and checks the counters again) under that lock, so each sees
the other's writes in order; between them the verifier polls the counters without it. No library offers
a pipelined drafter for a model held in one process: this is written on the standard
library's ``multiprocessing``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Iterator

import torch

from .draft import AUTO, Draft, DraftStats
from .lean import own_step
from .lean_draft import LeanDraft, own_solve, refusal
from .lean_stack import LeanStack, stack_refusal
from .sampling import draw, probabilities

# the counters' places in the shared int64 tensor
EPOCH, RESET_POS, RESET_TOKEN, STOP, ACK, COUNT, USED, EVALS, ERROR, IDLE = range(10)
SEED_STEP = 0x9E3779B97F4A7C15  # an epoch's seed: the stream's plus this times the epoch
STUCK_S = 60.0  # how long the verifier waits on the drafter before it calls it stuck
POLL_EVERY = 4096  # spins between looks at whether the drafter still runs
SPIN = 20000  # an idle drafter's spins (about 2-5 ms) before it sleeps between looks
IDLE_S = 1e-4  # ... and how long it sleeps then


def pipeline_refusal(model, draft: Draft, idx: torch.Tensor) -> str | None:
    """Why ``draft`` cannot be pipelined for ``model`` and the prompt ``idx``, in one phrase
    naming the way out; None when it can."""
    if "fork" not in mp.get_all_start_methods():
        return "it forks the drafting process, which this platform cannot (Linux can)"
    if idx.device.type != "cpu":
        return (f"it pipelines over two CPU cores and the prompt is on {idx.device}; decode on "
                f"the CPU, or drop pipeline=True")
    if draft.tokens == AUTO:
        return "a round takes a fixed number of drafts: give tokens=N (--draft-tokens N)"
    if draft.confidence is not None:
        return ("every draft is made ahead of the verdict, so there is no round to stop: drop "
                "confidence (--draft-confidence)")
    if not draft.lean:
        return "both processes run the lean steps: drop lean=False"
    was = model.training
    model.eval()  # as the stream will hold it
    try:
        with torch.inference_mode():
            stack = model.config.depth != "ode"
            why = stack_refusal(model) if stack else refusal(model, own_solve(model))
            if why is not None:
                return f"the model's own solve does not run as the lean step ({why})"
            why = _draft_refusal(model, draft)
    finally:
        model.train(was)
    return None if why is None else f"the draft does not run as the lean step ({why})"


def _draft_refusal(model, draft: Draft) -> str | None:
    if draft.layers is not None:
        return None  # the stack's own lean step, checked above, runs its first layers
    from .speculative import _Solves

    return refusal(model, _Solves(model, draft.solver, draft.steps).draft[1])


class _Drafter:
    """The draft's lean step with ``tokens`` already through it, as the drafting process
    makes it: ``row(token)`` the draft's logits (V,) after one more token, ``crop``, ``pos``,
    ``nfe`` per token."""

    def __init__(self, model, draft: Draft, tokens: list[int]):
        if draft.layers is not None:
            self.step, self.layers = LeanStack(model), draft.layers
            self.nfe = draft.layers
        else:
            from .speculative import _Solves

            self.step, self.layers = LeanDraft(model, _Solves(model, draft.solver,
                                                              draft.steps).draft[1]), None
            self.nfe = self.step.nfe
        if tokens:
            self.feed(tokens)

    @property
    def pos(self) -> int:
        return self.step.pos

    def crop(self, length: int) -> None:
        self.step.crop(length)

    def feed(self, tokens: list[int]) -> torch.Tensor:
        if self.layers is not None:
            return self.step.early(tokens, self.layers)
        return self.step.logits(tokens)

    def row(self, token: int) -> torch.Tensor:
        return self.feed([token])


class _Choice:
    """How a draft is chosen from its logits: argmax, or a draw from the processed
    distribution with the drafter's generator, reseeded at every epoch."""

    def __init__(self, greedy: bool, temperature: float, top_k, top_p, seed: int):
        self.params = (greedy, temperature, top_k, top_p, seed)  # what crosses to the drafter
        self.greedy, self.temperature, self.top_k, self.top_p = greedy, temperature, top_k, top_p
        self.seed = seed
        self.gen = None if greedy else torch.Generator()

    def epoch(self, e: int) -> None:
        if self.gen is not None:
            self.gen.manual_seed((self.seed + e * SEED_STEP) % 2 ** 63)

    def __call__(self, row: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.greedy:
            return int(row.argmax()), None
        q = probabilities(row, self.temperature, self.top_k, self.top_p)
        return int(draw(q, self.gen)), q


def _serve(model, draft: Draft, ctl: torch.Tensor, toks: torch.Tensor,
           probs: torch.Tensor | None, lock, conn, ring: int) -> None:
    """The drafting process: waits for a stream (a message on ``conn``), drafts for it until
    told to stop, waits for the next; reports a failure on ``conn`` and ends."""
    try:
        torch.set_num_threads(1)
        c = ctl.numpy()
        with torch.inference_mode():
            step = _Drafter(model, draft, [])
            while True:
                msg = conn.recv()
                if msg[0] == "exit":
                    return
                _, tokens, params, limit, epoch = msg
                choice = _Choice(*params)
                step.crop(0)
                if len(tokens) > 1:
                    step.feed(tokens[:-1])
                _draft_stream(step, choice, tokens[-1], epoch, limit, c, toks.numpy(), probs,
                              lock, ring)
                with lock:
                    c[IDLE] = 1
    except BaseException:  # noqa: BLE001 - reported to the verifier, which raises it
        ctl[ERROR] = 1
        try:
            conn.send(traceback.format_exc())
        except Exception:  # noqa: BLE001 - the verifier is gone
            pass
    finally:
        conn.close()


def _draft_stream(step: _Drafter, choice: _Choice, tok: int, ep: int, limit: int | None, c,
                  tk, probs: torch.Tensor | None, lock, ring: int) -> None:
    """One stream's drafting: after ``tok`` (epoch ``ep``), each draft after the last, from
    where the verifier says at each new epoch, until the stream stops."""
    count, evals, first, idle = 0, 0, ep, 0
    choice.epoch(0)  # epochs count from the stream's first: its draws are the stream's own
    with lock:
        c[ACK] = ep
    parent = os.getppid()
    while not c[STOP]:
        if c[EPOCH] != ep:
            with lock:
                ep, pos, tok = int(c[EPOCH]), int(c[RESET_POS]), int(c[RESET_TOKEN])
                count = 0
                c[COUNT] = 0
                c[ACK] = ep
            step.crop(pos)
            choice.epoch(ep - first)
        # ahead far enough, or at the last position the verifier can use: wait, spinning at
        # first (a round's verdict comes within milliseconds), then sleeping between looks
        # (the caller may hold the stream a long while), and ending if the verifier is gone
        if count - c[USED] >= ring - 1 or (limit is not None and step.pos > limit - 2):
            idle += 1
            if idle > SPIN:
                time.sleep(IDLE_S)
                if os.getppid() != parent:
                    return
            continue
        idle = 0
        nxt, q = choice(step.row(tok))
        evals += step.nfe
        with lock:
            c[EVALS] = evals
            if c[EPOCH] != ep:
                continue  # started again meanwhile: this draft is for the old epoch
            tk[count % ring] = nxt
            if q is not None:
                probs[count % ring] = q
            count += 1
            c[COUNT] = count
        tok = nxt


def _weights(model) -> tuple | None:
    """What tells the model's weights unchanged (each tensor, its storage, dtype and device,
    and its version counter: in-place changes, ``.to()``, ``.data =``), or None where it
    cannot be told (inference tensors keep no version counter)."""
    try:
        return tuple((id(t), t.data_ptr(), t.dtype, t.device, t._version)
                     for t in (*model.parameters(), *model.buffers()))
    except RuntimeError:
        return None


class DraftProcess:
    """A drafting process (forked: it holds the model's weights as they were then) and the
    verifier's side of the shared state. Per stream: :meth:`begin`, then :meth:`take` the
    drafts of the current epoch from an index, :meth:`restart` a new epoch, :meth:`end`.
    :meth:`close` ends the process."""

    def __init__(self, model, draft: Draft):
        self.ring = 2 * draft.tokens + 4
        vocab = model.config.vocab_size
        self.ctl = torch.zeros(16, dtype=torch.int64).share_memory_()
        self.toks = torch.zeros(self.ring, dtype=torch.int64).share_memory_()
        self.probs = torch.zeros(self.ring, vocab, dtype=torch.float32).share_memory_()
        self.c = self.ctl.numpy()
        self.c[IDLE] = 1
        self.weights = _weights(model)
        ctx = mp.get_context("fork")
        self.lock = ctx.Lock()
        self.conn, child = ctx.Pipe()
        self.epoch, self.reset_pos, self.limit, self.sampled = 0, 0, None, False
        self.proc = ctx.Process(target=_serve, daemon=True, name="continuumlm-drafter",
                                args=(model, draft, self.ctl, self.toks, self.probs,
                                      self.lock, child, self.ring))
        self.proc.start()
        child.close()

    def usable(self, model) -> bool:
        """Alive and idle, with the weights ``model`` has now."""
        return (self.proc.is_alive() and not self.c[ERROR] and bool(self.c[IDLE])
                and self.weights is not None and self.weights == _weights(model))

    def begin(self, tokens: list[int], choice: _Choice, limit: int | None) -> None:
        """A stream: drafts after ``tokens[-1]``, ``tokens[:-1]`` through the draft first."""
        with self._locked():
            self.epoch += 1
            self.c[STOP], self.c[IDLE], self.c[USED], self.c[COUNT], self.c[EVALS] = 0, 0, 0, 0, 0
            self.c[EPOCH], self.c[ACK] = self.epoch, -1
        self.reset_pos, self.limit, self.sampled = len(tokens) - 1, limit, not choice.greedy
        try:
            self.conn.send(("stream", tokens, choice.params, limit, self.epoch))
        except OSError:  # the drafter has ended: say why
            self._failed()
            raise

    def reaches(self, index: int) -> bool:
        """Whether the drafter makes draft ``index`` of this epoch: the token it is drafted
        after sits at a position the verifier can still use."""
        return self.limit is None or self.reset_pos + index <= self.limit - 2

    def take(self, start: int, n: int, most: int | None = None
             ) -> tuple[list[int], list[torch.Tensor] | None]:
        """Drafts ``start``..``start + n - 1`` of the current epoch (and their distributions
        when sampling), waiting for the drafter to make them; ``most``: as many more as are
        made already, up to that many in all."""
        c = self.c
        while True:
            self._wait(lambda: c[ACK] == self.epoch and c[COUNT] >= start + n,
                       "made no draft")
            with self._locked():
                # read again under the lock: what the polling saw may predate the epoch on a
                # machine that reorders loads
                if not (c[ACK] == self.epoch and c[COUNT] >= start + n):
                    continue
                got = n if most is None else max(n, min(most, int(c[COUNT]) - start))
                slots = [(start + i) % self.ring for i in range(got)]
                tokens = [int(self.toks[s]) for s in slots]
                qs = [self.probs[s].clone() for s in slots] if self.sampled else None
            return tokens, qs

    def keep_from(self, used: int) -> None:
        """The verifier has taken the drafts before ``used`` in this epoch: the drafter may
        go that far further ahead."""
        self.c[USED] = used

    def restart(self, pos: int, token: int) -> None:
        """A new epoch: the drafter drops its drafts, cuts its caches back to ``pos`` tokens
        and drafts after ``token``."""
        with self._locked():
            self.epoch += 1
            self.reset_pos = pos
            self.c[RESET_POS], self.c[RESET_TOKEN], self.c[USED] = pos, token, 0
            self.c[EPOCH] = self.epoch

    @property
    def evals(self) -> int:
        """The drafter's field (or layer) evaluations in this stream so far, every draft
        counted, those made for an epoch that ended too."""
        return int(self.c[EVALS])

    def end(self) -> bool:
        """The stream is over: the drafter stops and waits for the next. False when it did
        not (it had failed or ended, or it did not stop within a few seconds): then it is
        not to be used again. Never raises: a failure is raised where it was found."""
        self.c[STOP] = 1
        if self.c[ERROR] or not self.proc.is_alive():
            return False
        try:
            self._wait(lambda: self.c[IDLE], "did not stop", limit_s=5.0)
        except RuntimeError:
            return False
        return True

    @contextlib.contextmanager
    def _locked(self):
        """The shared lock, looking at whether the drafter still runs while waiting for it (a
        drafter killed while holding it would hold it for ever)."""
        while not self.lock.acquire(timeout=1.0):
            if self.c[ERROR] or not self.proc.is_alive():
                self._failed()
        try:
            yield
        finally:
            self.lock.release()

    def _failed(self) -> None:
        """Raise the drafter's failure, with its traceback where it sent one."""
        try:
            why = self.conn.recv() if self.conn.poll(1.0) else None
        except (EOFError, OSError):
            why = None
        why = why or f"it ended with exit code {self.proc.exitcode}"
        raise RuntimeError(f"Draft(pipeline=True): the drafting process failed:\n{why}")

    def _wait(self, done, what: str, limit_s: float = STUCK_S) -> None:
        spins, t0 = 0, None
        while not done():
            spins += 1
            if spins % POLL_EVERY == 0:
                if self.c[ERROR] or not self.proc.is_alive():
                    self._failed()
                t0 = t0 or time.monotonic()
                if time.monotonic() - t0 > limit_s:
                    raise RuntimeError(f"Draft(pipeline=True): the drafting process {what} in "
                                       f"{limit_s:.0f} s (it is alive but stuck).")

    def close(self) -> None:
        if self.proc.is_alive():
            self.c[STOP] = 1
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(5.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5.0)
        self.conn.close()


class DrafterPool:
    """Drafting processes kept between a decoder's streams, one per draft: forking one and
    bringing its step up costs tens of milliseconds, about what a short stream decodes in.
    A kept process serves a later stream while the model's weights are the ones it was
    forked with (their version counters unchanged); else, or while another stream holds it,
    a stream gets a process of its own, closed at its end."""

    def __init__(self) -> None:
        self._idle: dict[tuple, DraftProcess] = {}

    @staticmethod
    def _key(model, draft: Draft) -> tuple:
        return (id(model), draft.solver, draft.steps, draft.layers, draft.tokens)

    def acquire(self, model, draft: Draft) -> DraftProcess:
        proc = self._idle.pop(self._key(model, draft), None)
        if proc is not None and not proc.usable(model):
            proc.close()
            proc = None
        return proc or DraftProcess(model, draft)

    def release(self, model, draft: Draft, proc: DraftProcess, clean: bool) -> None:
        key = self._key(model, draft)
        if clean and proc.weights is not None and key not in self._idle:
            self._idle[key] = proc
        else:
            proc.close()

    def close(self) -> None:
        for proc in self._idle.values():
            proc.close()
        self._idle.clear()


# pipelined streams open in this process, and torch's thread count before the first: streams
# may interleave, so the count goes back when the last one ends, not when each does
_threads = [0, 0]


def _hold_threads() -> None:
    if _threads[0] == 0:
        _threads[1] = torch.get_num_threads()
        torch.set_num_threads(1)
    _threads[0] += 1


def _release_threads() -> None:
    _threads[0] -= 1
    if _threads[0] == 0:
        torch.set_num_threads(_threads[1])


@torch.inference_mode()
def pipelined_tokens(model, idx: torch.Tensor, max_new_tokens: int, draft: Draft,
                     eos_token_id: int | None, stats: DraftStats, how,
                     pool: DrafterPool | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token (1,) at a time, as :func:`.speculative.speculative_tokens` does,
    with the drafts made by a drafting process ahead of the verifier (see the module's
    text); ``how``: the stream's :class:`.speculative.Sampling`; ``pool``: where the
    drafting process is kept between streams (a decoder's), else one for this stream."""
    from .speculative import verify

    if max_new_tokens == 0:
        return
    start = time.perf_counter()
    verifier, stats.verified_by = own_step(model, idx, True, False)
    if verifier is None:  # checked when the stream was made; the model changed since
        raise ValueError(f"Draft(pipeline=True): the model's own solve does not run as the "
                         f"lean step ({stats.verified_by}).")
    stats.drafted_by = ("first layers, " if draft.layers is not None else "") + \
        "lean step, pipelined (a drafting process of its own; one thread each)"
    k = draft.tokens
    first = max(1, k // 4)  # a round right after a start waits for this many drafts, not k
    limit = model.config.max_seq_len if model.config.position == "learned" else None
    device = idx.device
    # the drafter's seed, from the stream's generator (sampling): the same seed, the same text
    seed = 0 if how.greedy else int(torch.randint(0, 2 ** 62, (), generator=how.generator))
    _hold_threads()  # the verifier's core; the drafter has the other
    proc = None
    try:
        seq = idx[0].tolist()
        row = verifier.logits(seq, every=True)[-1]
        stats.nfe += verifier.nfe
        last = int(row.argmax()) if how.greedy else how.draw(how.probs(row))
        made = stats.tokens = 1
        yield torch.tensor([last], device=device)
        if made >= max_new_tokens or last == eos_token_id:
            return
        seq.append(last)
        proc = pool.acquire(model, draft) if pool is not None else DraftProcess(model, draft)
        proc.begin(seq, _Choice(how.greedy, how.temperature, how.top_k, how.top_p, seed),
                   limit)
        used, fresh = 0, True  # drafts taken in this epoch; a round right after a start
        while True:
            base = verifier.pos  # the position of `last`, which the verifier has not seen
            need = min(first if fresh else k, max_new_tokens - made - 1)
            if limit is not None:
                need = min(need, limit - 1 - base)
            if need <= 0:
                drafts, qs = [], []
            elif how.greedy:
                # as many as are ready, up to `need` (a few at least): greedy tokens are plain
                # decoding's whatever the drafts, so the round need not wait for all of them
                drafts, qs = proc.take(used, min(first, need), most=need)
            else:
                drafts, qs = proc.take(used, need)
            rows = verifier.logits([last, *drafts], every=True)
            stats.nfe += verifier.nfe
            n, after = verify(drafts, None if how.greedy else qs, rows, how, bonus=False)
            verifier.crop(base + 1 + n)  # the latest token and the kept drafts
            stats.rounds += 1
            stats.drafted += len(drafts)
            stats.accepted += n
            going = False  # the drafter's run goes on past this round
            if after is None:  # every draft kept: the token after them is open
                nxt = used + len(drafts)
                if made + n + 1 < max_new_tokens and proc.reaches(nxt):
                    # the drafter's next draft, made from the kept ones, is checked at the
                    # last row as one more draft; kept, the run goes on from it
                    extra, q = proc.take(nxt, 1)
                    m, after = verify(extra, q, rows[len(drafts):], how, bonus=False)
                    stats.drafted += 1
                    if m == 1:
                        after, going = extra[0], True
                        stats.accepted += 1  # not fed to the verifier yet: the next `last`
                if after is None:
                    after = (int(rows[-1].argmax()) if how.greedy
                             else how.draw(how.probs(rows[-1])))
            out = [*drafts[:n], after]
            done = (made + len(out) >= max_new_tokens
                    or (eos_token_id is not None and eos_token_id in out))
            # the drafter is told before the tokens go out: it drafts while the caller reads
            if going:
                used, fresh = used + len(drafts) + 1, False
                proc.keep_from(used)
            elif not done:  # from the verifier's token, at the position after the kept ones
                proc.restart(verifier.pos, after)
                used, fresh = 0, True
            stats.kept_per_round.append(n + 1)
            for t in out:
                made += 1
                last = t
                yield torch.tensor([t], device=device)
                if t == eos_token_id or made >= max_new_tokens:
                    break
            stats.tokens = made
            stats.seconds = time.perf_counter() - start
            if last == eos_token_id or made >= max_new_tokens:
                break
    finally:
        if proc is not None:
            clean = False
            try:
                clean = proc.end()
            finally:
                stats.nfe += proc.evals
                if pool is not None:
                    pool.release(model, draft, proc, clean)
                else:
                    proc.close()
        _release_threads()
        stats.seconds = time.perf_counter() - start
