"""Stopping on a signal: SIGINT or SIGTERM ends training after the current step, with a
checkpoint; so does a scheduler's warning signal (``train.requeue_signals``, SIGUSR1 and
SIGUSR2 by default), after which the command exits with status 75, "requeue me". Every rank
agrees on whether to stop, and why, before any stops.

The handlers hold from the command's first moment (:func:`install_early`): a signal that comes
before the training loop (data preparation, model build, compile) ends the command at once with
the same status and nothing saved (there is nothing yet; a resumed run's checkpoint is already
there). After the loop (teardown) a requeue signal is noted and does not cut the exit, and its
status, short; SIGINT and SIGTERM take their default action there (the checkpoint is written;
a launcher ends the remaining ranks of a failed job with SIGTERM)."""

from __future__ import annotations

import os
import signal

import torch

from . import distributed as D


class StopRequested(BaseException):
    """A signal before the training loop: the command ends at once with its status. A
    BaseException, as KeyboardInterrupt is, so that start-up code which catches Exception (a
    compile fallback, a tokenizer probe, a checkpoint read) does not take it for its own
    failure."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


class StopSignals:
    """Installed for the training loop (and restored after it). The first signal asks the
    loop to stop after the current step; a second SIGINT stops at once (the last checkpoint
    stays intact)."""

    def __init__(self, requeue: list[str] | tuple[str, ...] = (), raise_now: bool = False) -> None:
        self.requeue = tuple(requeue)
        self.requested: str | None = None
        self.seen: set[str] = set()  # every signal that came, for the exit status
        self.raise_now = raise_now  # before the loop: end the command where it stands (once)
        self.after = False  # after the loop: SIGINT and SIGTERM by their default action
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.after and signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if self.raise_now:  # the first signal ends the command; later ones are only noted
            self.raise_now = False
            self.requested = name
            self.seen.add(name)
            raise StopRequested(name)
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C after a first signal: stop at once
        self.seen.add(name)
        if self.requested is None or name in self.requeue:  # a requeue signal outranks others
            self.requested = name

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, *(getattr(signal, n) for n in self.requeue)):
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                break
        if _early is not None and _early is not self:  # the loop's handlers have taken over
            _early.raise_now = False
            if _early.requested is not None and self.requested is None:
                self.requested = _early.requested  # noted, never raised: stop at once
                self.seen |= _early.seen

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if _early is not None and _early is not self:
            _early.after = True

    def agreed_stop(self, dist: D.DistEnv, device: torch.device,
                    fault: bool = False) -> str | None:
        """Why to stop, decided on every rank alike (one collective under torchrun): "fault"
        when any rank reports one (rank 0 could not write its metrics), else a requeue signal
        when any rank got one, else SIGINT/SIGTERM when any rank got one."""
        mine = self.requested
        if not dist.enabled:
            return "fault" if fault else mine
        faults, requeue, other = dist.all_reduce_sum(
            [float(fault), float(mine in self.requeue),
             float(mine is not None and mine not in self.requeue)], device)
        if faults:
            return "fault"
        if requeue:
            return mine if mine in self.requeue else self.requeue[0]
        if other:
            return mine or "SIGTERM"
        return None


_early: StopSignals | None = None


def install_early() -> StopSignals:
    """The command's handlers from its first moment, for SIGINT, SIGTERM, SIGUSR1 and SIGUSR2
    (the requeue signals a config may name): until the training loop installs its own, a
    signal raises :class:`StopRequested` where the process stands (once; later ones are noted);
    after the loop it is only noted. A console command keeps them until it exits; an
    in-process caller gets its own back (:func:`uninstall_early`)."""
    global _early
    _early = StopSignals(requeue=("SIGUSR1", "SIGUSR2"), raise_now=True)
    _early.install()
    return _early


def before_loop() -> bool:
    """Whether a signal now would still end the command where it stands (nothing started)."""
    return _early is not None and _early.raise_now


def loop_started() -> None:
    """From here on the command's early handlers only note a signal (a launcher whose ranks
    decide, or the training loop, which installs its own)."""
    if _early is not None:
        _early.raise_now = False


def uninstall_early() -> None:
    """The handlers as they were before :func:`install_early` (a command run in-process, by
    the Python API or a test, leaves the caller's handlers as it found them)."""
    global _early
    if _early is not None:
        _early.restore()
        _early = None
