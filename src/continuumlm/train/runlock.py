"""One job per run folder: an advisory lock (``fcntl.flock`` on ``.run.lock`` in the folder),
held by the job for its whole life and released by the kernel when the process ends, also
after a crash or SIGKILL: on a local disk a stale lock never blocks a resume. A second job in a
folder that a running job holds stops at once (exit status 2) with a message naming the holder.

Who holds it: a single process, or the one-node launcher of ``--nproc N`` (its ranks inherit
``CONTINUUMLM_RUN_LOCK``, take nothing, and are stopped when the launcher dies); under torchrun,
SLURM-started ranks or ``--nnodes`` launchers, rank 0 holds it, and every other rank checks
before doing anything that no other job holds the folder, then waits until rank 0 has it ready
(:func:`ready`: rank 0 alone clears what a run that died early left). flock works on local file
systems and on NFS, where Linux takes it through the lock manager (a crashed node's lock lasts
until the server's lease ends); on a file system without locks it is a no-op (said once)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..errors import ContinuumLMError
from ..runs.folder import LOCK, unwritable_folder

LOCK_NAME = LOCK
INHERITED = "CONTINUUMLM_RUN_LOCK"  # set by a launcher that holds the lock for its ranks
_held: dict[str, int] = {}  # lock path -> open descriptor, kept for the life of the process
_created: set[Path] = set()  # run folders that taking the lock created


class RunFolderBusy(ContinuumLMError):
    """Another job holds the run folder (exit status 2)."""


def job_identity(environ=None) -> str:
    """What every process of one job shares and two jobs do not: torchrun's run id, or SLURM's
    job, step and restart count (a requeued job keeps its id), or the rendezvous address."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun {env['TORCHELASTIC_RUN_ID']}"
    if env.get("SLURM_JOB_ID"):
        return (f"slurm {env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', 'batch')}"
                f"+{env.get('SLURM_RESTART_COUNT', '0')}")
    if env.get("MASTER_ADDR"):
        return f"rendezvous {env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}"
    return f"process {socket.gethostname()}:{os.getpid()}"


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that has not yet said who it is"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"{holder.get('command', 'a job')} (pid {holder.get('pid')} on "
            f"{holder.get('host')}, {holder.get('job')}, started {started})")


def _busy(out: Path, holder: dict) -> RunFolderBusy:
    return RunFolderBusy(
        f"{out} is in use by another job: {_describe(holder)}. Two jobs in one run folder would "
        f"interleave their checkpoints and metrics, so this one stops before touching it. Wait "
        f"for that job to end (or stop it), or train into another --out. The lock "
        f"({out / LOCK_NAME}) goes with the process that holds it, also when it crashes, so a "
        f"requeued job is never kept out by a dead one.")


def _write(fd: int, holder: dict) -> None:
    data = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)  # ranks on other nodes read it (through a shared file system's cache)


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path``: a lock taken on a file that its last
    holder removed (:func:`release_all`) guards nothing, so it is taken again on the new one."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def hold(out: Path, command: str, rank: int = 0, environ=None, wait_ready: float = 300.0) -> None:
    """Take (rank 0) or check (other ranks) the run folder's lock; raise :class:`RunFolderBusy`
    when another job holds it. A no-op when this process's launcher holds it already. Another
    rank also waits (up to ``wait_ready`` seconds) until rank 0 has got the folder ready
    (:func:`ready`): rank 0 alone clears what a run that died before its first checkpoint left,
    and the other ranks read the folder after it."""
    env = os.environ if environ is None else environ
    path = (out / LOCK_NAME).resolve()
    if env.get(INHERITED) == str(path) or str(path) in _held:
        return
    me = job_identity(env)
    try:
        if not out.exists():
            _created.add(out.resolve())
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise unwritable_folder(out, e) from None
    if rank == 0:
        _take(out, path, command, me)
    else:
        _check(out, path, me, wait_ready)


def _take(out: Path, path: Path, command: str, me: str) -> None:
    # a rank of this job that checks holds the lock shared for an instant: try again for a
    # moment before taking a held lock for another job's
    deadline = time.monotonic() + 3.0
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() > deadline:
                raise _busy(out, _holder(path)) from None
            time.sleep(0.05)
            continue
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                print(f"note: {out} is on a file system without locks; one job per run "
                      f"folder is not enforced there", flush=True)
                return
            raise
        if not _same_file(fd, path):  # removed by the holder we waited for: take the new one
            os.close(fd)
            continue
        _write(fd, {"command": command, "host": socket.gethostname(), "pid": os.getpid(),
                    "job": me, "started": time.time(), "ready": False})
        _held[str(path)] = fd
        return


def _check(out: Path, path: Path, me: str, wait_ready: float) -> None:
    """Another rank: the folder is free, or held by this job's rank 0 (which writes who it is
    at once, and that the folder is ready once it is)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        free = True
    except BlockingIOError:
        free = False
    except OSError:
        return  # no locks on this file system: rank 0 says so
    finally:
        os.close(fd)
    start = time.monotonic()
    while True:
        holder = _holder(path)
        if holder.get("job") == me and holder.get("ready"):
            return
        waited = time.monotonic() - start
        if holder.get("job") != me and not free and waited > 5.0:
            raise _busy(out, holder)
        if waited > wait_ready:
            raise RunFolderBusy(
                f"rank 0 of this job did not get the run folder {out} ready within "
                f"{wait_ready:.0f} s (its own error, printed by rank 0, says why); this rank "
                f"stops too.")
        time.sleep(0.1)


def ready(out: Path) -> None:
    """Rank 0 (or a single process): the folder is ready for the other ranks to read."""
    path = (out / LOCK_NAME).resolve()
    fd = _held.get(str(path))
    if fd is not None:
        holder = _holder(path)
        _write(fd, {**holder, "ready": True})


def inherit_env(out: Path) -> dict[str, str]:
    """The variable a launcher that holds ``out``'s lock gives its ranks."""
    return {INHERITED: str((out / LOCK_NAME).resolve())}


def release_all() -> None:
    """Give up every lock this process holds (the end of a command; a process that exits gives
    them up anyway). A folder that taking the lock created and nothing else used (a command
    refused before it wrote anything) goes again with its lock file."""
    while _held:
        path, fd = _held.popitem()
        folder = Path(path).parent
        try:
            if folder in _created and [p.name for p in folder.iterdir()] == [LOCK_NAME]:
                os.unlink(path)
                folder.rmdir()
        except OSError:
            pass
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
    _created.clear()
