"""Corpora, tokenizers and batches: from a [data] config section to token-id tensors."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .batches import BatchSampler, eval_batches, eval_window_starts
from .corpora import CORPORA, cache_dir, load_corpus_text, resolve_file
from .tokenizers import (
    TOKENIZER_FILE,
    encode_array,
    load_tokenizer,
    save_tokenizer,
    tokenizer_json,
    train_tokenizer,
)

__all__ = [
    "CORPORA", "BatchSampler", "Dataset", "TOKENIZER_FILE", "changed_splits", "corpus_name",
    "eval_batches", "eval_window_starts", "load_tokenizer", "prepare_data", "resolve_file",
    "save_tokenizer", "split_text", "train_tokenizer",
]


@dataclass
class Dataset:
    tokenizer: object
    splits: dict[str, torch.Tensor]  # split name -> 1-D int64 token ids
    fingerprint: dict[str, str] = field(default_factory=dict)
    """split name -> sha256 of its text: what a resumed run or an evaluation compares with the
    text a run was trained on (a corpus file edited or replaced in between)."""


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def corpus_name(dcfg) -> str:
    """How messages name a [data] section's corpus."""
    if not dcfg.path:
        return f"the {dcfg.dataset} corpus"
    return f"the {'folder' if Path(dcfg.path).is_dir() else 'file'} {dcfg.path}"


def changed_splits(recorded: dict[str, str] | None, data: Dataset) -> list[str]:
    """Splits whose text differs from ``recorded`` (a run's fingerprint); none when nothing
    was recorded (checkpoints written before fingerprints existed)."""
    return [name for name, digest in (recorded or {}).items()
            if name in data.fingerprint and data.fingerprint[name] != digest]


def split_text(texts: dict[str, str], dcfg) -> dict[str, str]:
    """Apply the configured train/val split to a single-file corpus."""
    if "all" not in texts:
        return texts
    text = texts["all"]
    if not text.strip():
        raise DataError("the corpus is empty; point data.path at a file that holds text.")
    n = dcfg.train_chars if dcfg.train_chars is not None else int(len(text) * dcfg.train_fraction)
    if not 0 < n < len(text):
        raise DataError(f"the split leaves an empty part: the corpus has {len(text)} characters "
                        f"and the training part would have {n}; adjust data.train_fraction or "
                        f"data.train_chars.")
    return {"train": text[:n], "val": text[n:]}


def encode_cached(tok, text: str) -> np.ndarray:
    """Encode text, caching the ids as .npy keyed by the text and the tokenizer."""
    key = hashlib.sha256(text.encode("utf-8", "surrogatepass") + b"\0" +
                         tokenizer_json(tok).encode()).hexdigest()[:24]
    path = cache_dir() / "encoded" / f"{key}.npy"
    if path.is_file():
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            path.unlink(missing_ok=True)  # a damaged cache entry is rebuilt below
    ids = encode_array(tok, text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".npy.part", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.save(f, ids, allow_pickle=False)
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an optimization; an unwritable cache folder costs only time
    return ids


def prepare_data(dcfg, tokenizer=None) -> Dataset:
    """Load the corpus, build (or reuse) the tokenizer and encode every split."""
    texts = split_text(load_corpus_text(dcfg.dataset, dcfg.path, dcfg.errors), dcfg)
    if not texts["train"].strip():
        raise DataError("the training split is empty; check data.path and the split settings.")
    if tokenizer is None:
        source = texts["train"] if dcfg.vocab_source == "train" else "\n".join(texts.values())
        tokenizer = train_tokenizer(dcfg.tokenizer, source, dcfg.vocab_size)
    splits = {}
    for name, text in texts.items():
        try:
            ids = encode_cached(tokenizer, text)
        except DataError as e:
            raise DataError(f"{name} split: {e}") from None
        splits[name] = torch.from_numpy(ids.astype(np.int64))
    return Dataset(tokenizer, splits, {name: text_digest(text) for name, text in texts.items()})

