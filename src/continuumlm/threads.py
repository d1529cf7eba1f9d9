"""How many intra-op threads torch runs this process's work on: the thread policy.

torch starts one intra-op thread per core and parallelizes each large enough operation over
them; every parallel region ends at a barrier that waits for all of its threads. On a machine
whose cores other processes want too, one of ours is often descheduled, and the others spin
at the barrier until it runs again: this project's small matrices then run 15-50x slower on
two threads than on one (bench/threads.py measures it). On a quiet machine the same threads
are worth having (decoding and the demo's training are faster on two cores than on one).

So the policy looks at the machine, not only at the work: ``auto`` takes as many threads as
there are cores that are idle or already ours, measured from ``/proc/stat`` (the cores this
process may run on) against this process's own CPU time, and looks again every few seconds
while a long piece of work runs (a training loop, a token stream, an evaluation). A count the
user chose is kept: ``--threads N`` / ``train.threads = N`` / ``threads=N``, the environment
variables ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS``, or a ``torch.set_num_threads`` call made
after this module was imported. torch's thread count is a setting of the whole process; the
library's own calls (``generate(threads=...)``) put back the count they found when they end.

torch's ``set_num_threads`` sets the OpenMP count of the calling thread, so the policy is
applied by the thread that does the work (``poll()`` inside its loop), never from a thread of
its own. Nothing in the standard library or torch reads how busy the machine's cores are,
hence the few lines of ``/proc/stat`` reading here.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError

AUTO = "auto"
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Another process's use of a core beyond this share makes that core not ours: at 0.25, one
# busy process (0.67-1 core of use) takes a core away, and short-lived background work
# (a shell, a file system daemon, pytest's own bookkeeping) does not.
SPARE_SHARE = 0.25
INTERVAL_S = 5.0   # how often a long piece of work looks at the machine again
MIN_WINDOW_S = 0.1  # the shortest window a first decision is measured over


# torch's count before the policy touched it, read when this module is imported with torch
# loaded already (else at the first policy), so a later torch.set_num_threads is the user's;
# and the count the policy set last. Process-wide, as torch's count itself is.
_counts: dict[str, int] = {}


def _note_torch_count() -> None:
    if "at_import" not in _counts and "torch" in sys.modules:
        _counts["at_import"] = sys.modules["torch"].get_num_threads()


_note_torch_count()  # no torch import here: the config layer reads parse_threads without it


def parse_threads(value, where: str = "threads") -> int | str:
    """``"auto"`` or a positive whole number (also given as text, from a flag); anything else is
    a ConfigError naming ``where``."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        if text.isdigit() and int(text) > 0:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"{where} = {value!r}: give 'auto' (threads from how busy the machine's "
                      f"cores are) or a positive number of intra-op threads, e.g. 1.")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" (no quota) or "200000 100000" (2 cores' worth)
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


@dataclass(frozen=True)
class CpuSample:
    """Idle seconds summed over this process's cores (None where /proc/stat cannot be read),
    this process's CPU seconds, and when."""

    idle_s: float | None
    own_s: float
    wall_s: float


def read_idle_seconds() -> float | None:
    """Idle and I/O-wait time of the cores this process may run on, in seconds since boot
    (Linux's /proc/stat); None elsewhere."""
    try:
        allowed = os.sched_getaffinity(0)
        lines = open("/proc/stat").read().splitlines()
        tick = os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):
        return None
    idle = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and int(name[3:]) in allowed:
            idle += int(fields[3]) + int(fields[4])  # idle, iowait
    return idle / tick


def sample(read_idle: Callable[[], float | None] = read_idle_seconds) -> CpuSample:
    return CpuSample(read_idle(), time.process_time(), time.monotonic())


def available_cores(before: CpuSample, after: CpuSample) -> float | None:
    """Cores that were idle or ours between two samples (None when idle time is unknown)."""
    wall = after.wall_s - before.wall_s
    if before.idle_s is None or after.idle_s is None or wall <= 0:
        return None
    return max(0.0, (after.idle_s - before.idle_s) + (after.own_s - before.own_s)) / wall


def threads_for(available: float, cores: int) -> int:
    """The thread count for ``available`` cores of ``cores``: every core whose other use stays
    below SPARE_SHARE, at least one."""
    return max(1, min(cores, math.floor(available + SPARE_SHARE)))


@dataclass(frozen=True)
class Choice:
    threads: int
    reason: str

    def __str__(self) -> str:
        return f"{self.threads} thread{'s' * (self.threads != 1)} ({self.reason})"


class ThreadPolicy:
    """Decides and applies torch's intra-op thread count for one piece of work.

    ``setting``: ``"auto"`` (the default: from the machine, unless the user chose a count, see
    the module's text) or a positive count. ``work`` names the work in messages ("training",
    "decoding", ...). Create it when the work's set-up starts, so that the first decision is
    measured over the set-up (model loading, data) instead of a wait; ``apply()`` at the start
    of the work, ``poll()`` inside its loop (a clock read unless INTERVAL_S has passed),
    ``restore()`` at its end (a library call; a command may leave the count in place).
    """

    def __init__(self, setting: int | str = AUTO, work: str = "work", *,
                 interval_s: float = INTERVAL_S,
                 read_idle: Callable[[], float | None] = read_idle_seconds,
                 cores: int | None = None):
        self.setting = parse_threads(setting)
        self.work = work
        self.interval_s = interval_s
        self.read_idle = read_idle
        self.cores = cores or usable_cores()
        self.choice: Choice | None = None
        self.changes = 0  # how often auto changed the count while the work ran
        self._found: int | None = None  # torch's count before apply(), put back by restore()
        self._last = sample(read_idle)
        import torch  # noqa: F401 - loaded, so that torch's own count is noted before any change

        _note_torch_count()

    # -------------------------------------------------------------- deciding

    def _users_choice(self) -> Choice | None:
        import torch

        if self.setting != AUTO:
            return Choice(self.setting, "as set")
        for name in ENV_VARS:
            if os.environ.get(name, "").strip():
                return Choice(torch.get_num_threads(), f"{name}={os.environ[name].strip()}")
        now = torch.get_num_threads()
        if now not in (_counts["at_import"], _counts.get("applied")):
            return Choice(now, "set by torch.set_num_threads")
        return None

    def decide(self) -> Choice:
        """The count for now: the user's, else from the cores measured idle (or ours) since
        the last look."""
        if (chosen := self._users_choice()) is not None:
            return chosen
        if time.monotonic() - self._last.wall_s < MIN_WINDOW_S:
            time.sleep(MIN_WINDOW_S - (time.monotonic() - self._last.wall_s))
        now = sample(self.read_idle)
        avail = available_cores(self._last, now)
        self._last = now
        if avail is None:
            return Choice(self.cores, f"auto: {self.cores} usable cores, load unknown")
        n = threads_for(avail, self.cores)
        busy = self.cores - min(avail, self.cores)
        if n == self.cores:
            return Choice(n, f"auto: {self.cores} usable cores, quiet")
        return Choice(n, f"auto: other processes use {busy:.1f} of {self.cores} cores")

    # -------------------------------------------------------------- applying

    def apply(self) -> Choice:
        import torch

        if self._found is None:
            self._found = torch.get_num_threads()
        self.choice = self.decide()
        _set(self.choice.threads)
        return self.choice

    def poll(self) -> None:
        """Look at the machine again when INTERVAL_S has passed (auto only); cheap otherwise."""
        if self.setting != AUTO or time.monotonic() - self._last.wall_s < self.interval_s:
            return
        choice = self.decide()
        if self.choice is None or choice.threads != self.choice.threads:
            self.changes += 1
            _set(choice.threads)
        self.choice = choice

    def restore(self) -> None:
        if self._found is not None:
            _set(self._found)
            self._found = None


def _set(n: int) -> None:
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    _counts["applied"] = n
