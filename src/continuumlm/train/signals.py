"""Stopping on a signal: SIGINT or SIGTERM ends training after the current step, with a
checkpoint; so does a scheduler's warning signal (``train.requeue_signals``, SIGUSR1 and
SIGUSR2 by default), after which the command exits with status 75, "requeue me". Every rank
under torchrun agrees on whether to stop, and why, before any stops."""

from __future__ import annotations

import signal

import torch

from . import distributed as D


class StopSignals:
    """Installed for the training loop (and restored after it). The first signal asks the
    loop to stop after the current step; a second SIGINT stops at once (the last checkpoint
    stays intact)."""

    def __init__(self, requeue: list[str] | tuple[str, ...] = ()) -> None:
        self.requeue = tuple(requeue)
        self.requested: str | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, *(getattr(signal, n) for n in self.requeue)):
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                break

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

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
