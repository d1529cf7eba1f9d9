"""Stopping on a signal: SIGINT or SIGTERM ends training after the current step, with a
checkpoint; every rank under torchrun agrees before any stops."""

from __future__ import annotations

import signal

import torch

from . import distributed as D


class StopSignals:
    """Installed for the training loop (and restored after it). The first SIGINT or SIGTERM
    asks the loop to stop after the current step; a second SIGINT stops at once (the last
    checkpoint stays intact)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def install(self) -> None:
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: leave signals alone
                break

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def agreed_stop(self, dist: D.DistEnv, device: torch.device) -> str | None:
        """The signal to stop for, decided on every rank alike (a collective under torchrun)."""
        if dist.any(self.requested is not None, device):
            return self.requested or "SIGTERM"
        return None
