"""The run folder: its layout (every name in it spelled here, once), what a new run may find
there, clearing a run that stopped before its first checkpoint, and the one-paragraph errors
of a folder that cannot be written. Below the checkpoint format, the checkpointer, resuming,
the metrics log and the folder lock, which all read their names from here.

    RUN/
      config.toml        the resolved config a run was started with
      metrics.jsonl      one JSON object per event
      tb/                TensorBoard events
      checkpoints/       step-NNNNNNNN/ folders; last and best point at complete ones
      result.json        an MQAR run's result (written after each evaluation)
      state.pt           an MQAR run of earlier versions' standalone loop
      .run.lock          the job that holds the folder (runlock.py)
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from pathlib import Path

from ..errors import ConfigError, DiskError, TrainingError

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
CHECKPOINTS = "checkpoints"
LAST, BEST = "last", "best"  # the links inside checkpoints/
RESULT = "result.json"
LEGACY_STATE = "state.pt"
LOCK = ".run.lock"
# what a new run would overwrite or mix into: another run's files, or a user's own config
FOREIGN = (CONFIG, METRICS, LEGACY_STATE, RESULT)


def checkpoints(out: Path) -> Path:
    return Path(out) / CHECKPOINTS


def has_checkpoints(out: Path) -> bool:
    """Whether a run folder holds what the trainer counts as checkpoints (a dangling `last`
    too: resuming says what is wrong with it)."""
    root = checkpoints(out)
    return (root / LAST).is_symlink() or any(root.glob("step-*")) \
        or any(root.glob(".old-step-*"))


def read_metrics(out: str | Path) -> list[dict]:
    path = Path(out) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def refuse_foreign_files(out: Path, what: str, names: tuple[str, ...] = FOREIGN) -> None:
    """A new run writes config.toml and appends to metrics.jsonl at the top of its folder: refuse
    a folder that already holds any of ``names`` (another run's files, or a user's own
    config.toml), so nothing there is overwritten or mixed in."""
    found = [n for n in names if (Path(out) / n).exists()]
    if found:
        raise ConfigError(
            f"{out} already holds {', '.join(found)}: files of another run, or your own. {what} "
            f"would overwrite {CONFIG} and append to {METRICS} there. Choose another "
            f"--out, or delete that folder if its contents are no longer needed.")


def absolute_data_path(data):
    """``data`` with its path absolute (as a run records it: `eval` and `--resume` then read
    the same file from any folder)."""
    if not data.path:
        return data
    return dataclasses.replace(data, path=str(Path(data.path).expanduser().absolute()))


def clear_unstarted_run(out: Path, cfg, first_save: int, why: str) -> bool:
    """Remove the files a run leaves before its first checkpoint (config.toml, metrics.jsonl,
    tb/) so that the same command starts it again, when they are this same run's: its
    config.toml describes ``cfg`` (the data path made absolute and the vocabulary size filled
    in, as the trainer records them) and its metrics log no step past ``first_save`` (a run
    that did had a checkpoint, since removed: the trainer refuses the folder). Anyone else's
    files are left for the trainer to refuse. Returns whether the files were removed."""
    from ..config import load_config, reading_saved_config
    from ..errors import ContinuumLMError

    saved_path = Path(out) / CONFIG
    if not saved_path.is_file() or any((Path(out) / n).exists() for n in (LEGACY_STATE, RESULT)):
        return False
    try:
        with reading_saved_config():  # a run's own file (an older version's names say nothing)
            saved = load_config(saved_path)
    except (ContinuumLMError, ValueError):
        return False
    now = dataclasses.replace(cfg, data=absolute_data_path(cfg.data))
    if now.model.vocab_size == 0:
        now.model = dataclasses.replace(now.model, vocab_size=saved.model.vocab_size)
    if now.to_dict() != saved.to_dict():
        return False
    try:
        steps = [e.get("step", 0) for e in read_metrics(out)] \
            if (Path(out) / METRICS).exists() else []
    except (OSError, ValueError):
        return False
    if any(isinstance(s, (int, float)) and s > first_save for s in steps):
        return False
    print(f"{out} holds no checkpoint ({why}); starting the run again", flush=True)
    saved_path.unlink()
    (Path(out) / METRICS).unlink(missing_ok=True)
    shutil.rmtree(Path(out) / TENSORBOARD, ignore_errors=True)
    return True


# ------------------------------------------------------------------ what to say when it fails

TASK_NAMES = {"lm": "language-modeling (continuumlm train)", "mqar": "MQAR (continuumlm mqar)"}
RESUMED_BY = {"lm": "continuumlm train --resume", "mqar": "the continuumlm mqar command"}


def continue_command(task: str, out) -> str:
    """What continues a stopped run of ``task`` in ``out``, for the messages that say so."""
    if task == "mqar":  # an MQAR run continues from its newest checkpoint by itself
        return f"the same `continuumlm mqar --config CONFIG --out {out}` command"
    return f"`continuumlm train --out {out} --resume auto`"


# what a full disk, a quota, a read-only mount or a failing disk raise
DISK_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "the file system is read-only", errno.EIO: "an I/O error"}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def disk_error(what: str, where: Path, e: BaseException, out: Path, need: int | None = None,
               task: str = "lm") -> DiskError:
    """One paragraph: what could not be written, where, why, the last complete checkpoint,
    the space a checkpoint needs, and the command that continues the run in ``out``."""
    last = checkpoints(out) / LAST
    kept = (f"the last complete checkpoint, {last.resolve()}, is intact" if last.exists()
            else "no checkpoint was written yet")
    why = getattr(e, "strerror", None) or DISK_ERRNOS.get(getattr(e, "errno", None)) or str(e)
    try:
        free = f"; {gib(shutil.disk_usage(where if where.exists() else out).free)} free there"
    except OSError:
        free = ""
    space = f"; a checkpoint of this run needs about {gib(need)}" if need else ""
    why = why.splitlines()[0] if why else type(e).__name__
    return DiskError(f"could not write {what} to {where} ({why}){free}{space}; {kept}. Free "
                     f"some space (or move the run folder to a larger disk) and continue with "
                     f"{continue_command(task, out)} (with the --nproc it was started with, if "
                     f"any)")


def unwritable_folder(out, e: OSError) -> Exception:
    """The one-paragraph error of a run folder that cannot be created or written (a disk
    fault is a DiskError, exit status 74; a wrong path a TrainingError)."""
    advice = {errno.ENOSPC: "free some space or choose another --out",
              errno.EDQUOT: "free some space or choose another --out",
              errno.ENOTDIR: "a part of that path is a file, not a folder; choose "
                             "another --out",
              errno.EEXIST: "a part of that path is a file, not a folder; choose "
                            "another --out",
              errno.EACCES: "you may not write there; choose a writable --out",
              errno.EPERM: "you may not write there; choose a writable --out",
              errno.EROFS: "that file system is read-only; choose a writable --out",
              }.get(e.errno, "choose a writable --out")
    kind = DiskError if e.errno in DISK_ERRNOS else TrainingError
    return kind(f"cannot write to the run folder {out} ({e.strerror or e}); {advice}.")
