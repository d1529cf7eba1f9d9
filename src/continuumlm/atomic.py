"""Folders written whole or not at all: the one writer behind ``LanguageModel.save_pretrained``
and the Hugging Face adapter's (a checkpoint's step folder is such a folder, renamed into place
by ``runs/checkpoint.py``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_folder(directory: str | Path, last: tuple[str, ...] = ("config.json",)) -> Iterator[Path]:
    """Yield a new temporary folder beside ``directory`` to write into. When the block ends
    without an error, every file in it is flushed to disk and it takes ``directory``'s place:
    renamed into place when ``directory`` does not exist, else its files moved in one by one,
    the ``last`` names last (a folder whose ``config.json`` is there has its other files).
    On an error the temporary folder is removed and ``directory`` is left as it was."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # as a folder made by mkdir (mkdtemp's is 0700)
        if not directory.exists():
            os.replace(tmp, directory)
        else:
            names = sorted(p.name for p in tmp.iterdir())
            for name in [n for n in names if n not in last] + [n for n in last if n in names]:
                os.replace(tmp / name, directory / name)
            fsync_dir(directory)
        fsync_dir(directory.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
