"""Prepared corpora on disk: ``meta.json``, ``tokenizer.json`` and one token file per split,
read through ``np.memmap`` (nothing is loaded whole; the processes of a job share the pages)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import DataError
from .tokenizers import load_tokenizer

# the format this module reads and data/prepare.py writes
FORMAT = "continuumlm-prepared"
VERSION = 1
META_FILE = "meta.json"


def _bad(folder: Path, what: str) -> DataError:
    return DataError(f"{folder} is not a usable prepared corpus: {what}. Prepare it again "
                     f"(continuumlm prepare ... --out {folder} --force).")


def read_meta(folder: str | Path) -> dict:
    """``meta.json`` of a prepared folder, checked against the files beside it."""
    folder = Path(folder)
    path = folder / META_FILE
    if not path.is_file():
        parts = sorted(p.name for p in folder.glob("*.part")) if folder.is_dir() else []
        if parts:
            raise DataError(f"{folder} holds an unfinished preparation ({', '.join(parts[:3])}: "
                            f"prepare was interrupted); run prepare again, which starts over.")
        raise DataError(f"{folder} has no {META_FILE}, so it is not a prepared corpus; make one "
                        f"with `continuumlm prepare --input SRC --out {folder}` (or point "
                        f"data.path at the folder prepare wrote).")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(folder, f"{META_FILE} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _bad(folder, f"{META_FILE} is not a ContinuumLM prepared-corpus description")
    if meta.get("version") != VERSION:
        raise DataError(f"{folder} was prepared by another version of ContinuumLM (format "
                        f"version {meta.get('version')!r}; this one reads {VERSION}); prepare it "
                        f"again with this version (continuumlm prepare ... --out {folder} "
                        f"--force).")
    try:
        dtype = np.dtype(meta["dtype"])
        for st in meta["splits"].values():
            f = folder / st["file"]
            if not f.is_file():
                raise _bad(folder, f"{st['file']} is missing")
            want = int(st["tokens"]) * dtype.itemsize
            have = f.stat().st_size
            if have != want:
                raise _bad(folder, f"{st['file']} has {have:,} bytes but {META_FILE} says "
                                   f"{st['tokens']:,} {dtype.name} tokens ({want:,} bytes): the "
                                   f"file was truncated or replaced")
        if not (folder / meta["tokenizer"]["file"]).is_file():
            raise _bad(folder, f"{meta['tokenizer']['file']} is missing")
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(folder, f"{META_FILE} lacks or garbles {e}") from None
    return meta


def meta_digest(folder: str | Path) -> str:
    return hashlib.sha256((Path(folder) / META_FILE).read_bytes()).hexdigest()


class Prepared:
    """An opened prepared corpus: ``tokenizer``, ``splits`` (name -> 1-D memmap of ids)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        self.tokenizer = load_tokenizer(self.folder / self.meta["tokenizer"]["file"])
        # the file's bytes, as prepare hashed them: not the library's re-serialization, which
        # changes between tokenizers releases (BPE merges became pairs in 0.20)
        digest = hashlib.sha256((self.folder / self.meta["tokenizer"]["file"]).read_bytes()
                                ).hexdigest()
        if digest != self.meta["tokenizer"]["sha256"]:
            raise _bad(self.folder, f"{self.meta['tokenizer']['file']} is not the tokenizer the "
                                    f"token files were encoded with (its sha256 differs)")
        dtype = np.dtype(self.meta["dtype"])
        self.splits: dict[str, np.ndarray] = {}
        for name, st in self.meta["splits"].items():
            n = int(st["tokens"])
            self.splits[name] = (np.memmap(self.folder / st["file"], dtype=dtype, mode="r",
                                           shape=(n,)) if n else np.zeros(0, dtype))
        self.fingerprint = {name: st["text_sha256"] for name, st in self.meta["splits"].items()}
        self.digest = meta_digest(self.folder)
