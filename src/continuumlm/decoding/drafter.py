"""The drafting process of pipelined self-speculative decoding (:mod:`.pipeline`): a forked
process that runs a draft's lean step ahead of the verifier, and the verifier's side of the
state they share (:class:`DraftProcess`), kept between a decoder's streams
(:class:`DrafterPool`).

Shared state: a few counters (an int64 tensor in shared memory), the drafted tokens and their
distributions (rings of ``2k + 4`` slots); the drafter publishes a draft under a lock after
writing it and the verifier reads (and checks the counters again) under that lock, so each
sees the other's writes in order; between them the verifier polls the counters without it.
No library offers a pipelined drafter for a model held in one process: this is written on the
standard library's ``multiprocessing``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback

import torch

from .draft import Draft
from .lean_draft import LeanDraft
from .lean_stack import LeanStack
from .sampling import draw, probabilities
from .speculative import _Solves

# the counters' places in the shared int64 tensor
EPOCH, RESET_POS, RESET_TOKEN, STOP, ACK, COUNT, USED, EVALS, ERROR, IDLE = range(10)
SEED_STEP = 0x9E3779B97F4A7C15  # an epoch's seed: the stream's plus this times the epoch
STUCK_S = 60.0  # how long the verifier waits on the drafter before it calls it stuck
POLL_EVERY = 4096  # spins between looks at whether the drafter still runs
SPIN = 20000  # an idle drafter's spins (about 2-5 ms) before it sleeps between looks
IDLE_S = 1e-4  # ... and how long it sleeps then


class _Drafter:
    """The draft's lean step as the drafting process runs it: ``feed(tokens)``, ``row(token)``
    the draft's logits (V,) after one more token, ``crop``, ``pos``, ``nfe`` per token."""

    def __init__(self, model, draft: Draft):
        if draft.layers is not None:
            self.step, self.layers = LeanStack(model), draft.layers
            self.nfe = draft.layers
        else:
            self.step, self.layers = LeanDraft(model, _Solves(model, draft.solver,
                                                              draft.steps).draft[1]), None
            self.nfe = self.step.nfe

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


class Choice:
    """How a draft is chosen from its logits: argmax, or a draw from the processed
    distribution with the drafter's generator, reseeded at every epoch."""

    def __init__(self, greedy: bool, temperature: float, top_k, top_p, seed: int):
        self.greedy, self.temperature, self.top_k, self.top_p = greedy, temperature, top_k, top_p
        self.seed = seed
        self.gen = None if greedy else torch.Generator()

    @property
    def params(self) -> tuple:
        """What crosses to the drafting process, which makes its own Choice of them."""
        return self.greedy, self.temperature, self.top_k, self.top_p, self.seed

    def epoch(self, e: int) -> None:
        if self.gen is not None:
            self.gen.manual_seed((self.seed + e * SEED_STEP) % 2 ** 63)

    def __call__(self, row: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self.greedy:
            return int(row.argmax()), None
        q = probabilities(row, self.temperature, self.top_k, self.top_p)
        return int(draw(q, self.gen)), q


def _serve(model, draft: Draft, ctl: torch.Tensor, toks: torch.Tensor, probs: torch.Tensor,
           lock, conn, ring: int) -> None:
    """The drafting process: waits for a stream (a message on ``conn``), drafts for it until
    told to stop, waits for the next; reports a failure on ``conn`` and ends."""
    try:
        torch.set_num_threads(1)
        c = ctl.numpy()
        with torch.inference_mode():
            step = _Drafter(model, draft)
            while True:
                msg = conn.recv()
                if msg[0] == "exit":
                    return
                _, tokens, params, limit, epoch = msg
                choice = Choice(*params)
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


def _draft_stream(step: _Drafter, choice: Choice, tok: int, ep: int, limit: int | None, c,
                  tk, probs: torch.Tensor, lock, ring: int) -> None:
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
        self.c, self.tk = self.ctl.numpy(), self.toks.numpy()  # scalar reads, no dispatch
        self.c[IDLE] = 1
        self.weights = _weights(model)
        self.onednn = torch.backends.mkldnn.enabled  # what the forked process inherits
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

    def begin(self, tokens: list[int], choice: Choice, limit: int | None) -> None:
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
                tokens = [int(self.tk[s]) for s in slots]
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
    def _key(model, draft: Draft, onednn: bool | None = None) -> tuple:
        # a process keeps the oneDNN switch it was forked with (decoding/kernels.py)
        return (id(model), draft.solver, draft.steps, draft.layers, draft.tokens,
                torch.backends.mkldnn.enabled if onednn is None else onednn)

    def acquire(self, model, draft: Draft) -> DraftProcess:
        proc = self._idle.pop(self._key(model, draft), None)
        if proc is not None and not proc.usable(model):
            proc.close()
            proc = None
        return proc or DraftProcess(model, draft)

    def release(self, model, draft: Draft, proc: DraftProcess, clean: bool) -> None:
        key = self._key(model, draft, proc.onednn)
        if clean and proc.weights is not None and key not in self._idle:
            self._idle[key] = proc
        else:
            proc.close()

    def close(self) -> None:
        for proc in self._idle.values():
            proc.close()
        self._idle.clear()
