"""Corpora, tokenizers and batches: from a [data] config section to token-id tensors."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError
from .batches import BatchSampler, eval_batches, eval_window_starts
from .corpora import CORPORA, cache_dir, resolve_file
from .prepare import Plan, TokenizerSpec, plan_key, prepare_cached, source_digests, warn_unknown
from .shards import Prepared
from .sources import Source, expand
from .tokenizers import (
    TOKENIZER_FILE,
    load_tokenizer,
    save_tokenizer,
    tokenizer_json,
    train_tokenizer,
)

__all__ = [
    "CORPORA", "BatchSampler", "Dataset", "TOKENIZER_FILE", "changed_splits", "corpus_name",
    "eval_batches", "eval_window_starts", "load_tokenizer", "prepare_data", "resolve_file",
    "save_tokenizer", "tokenizer_spec", "train_tokenizer",
]


@dataclass
class Dataset:
    tokenizer: object
    splits: dict[str, np.ndarray | torch.Tensor]
    """split name -> 1-D token ids: a read-only memmap of a prepared folder (or, built by
    hand, an in-memory array or tensor); windows are cut by :mod:`.batches`."""
    fingerprint: dict[str, str] = field(default_factory=dict)
    """split name -> sha256 of its text: what a resumed run or an evaluation compares with the
    text a run was trained on (a corpus file edited or replaced in between)."""
    folder: Path | None = None
    """The prepared folder the splits are mapped from."""
    meta_digest: str | None = None
    """sha256 of that folder's meta.json (recorded in checkpoints)."""


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


def _plan(dcfg) -> Plan:
    """The sources and split rule of a raw-text [data] section."""
    common = dict(text_field=dcfg.text_field, errors=dcfg.errors)
    if dcfg.dataset == "text":
        if not dcfg.path:
            raise DataError('data.dataset = "text" needs data.path pointing to a UTF-8 text file '
                            '(or a folder or glob of text, JSON Lines, Parquet or Arrow files).')
        return Plan({"all": expand([dcfg.path])}, dcfg.train_fraction, dcfg.test_fraction,
                    dcfg.train_chars, **common)
    files = CORPORA[dcfg.dataset]
    if dcfg.path and len(files) > 1 and Path(dcfg.path).expanduser().is_file():
        names = ", ".join(cf.name for cf in files.values())
        raise DataError(f"data.path = {dcfg.path!r} is one file, but data.dataset = "
                        f"{dcfg.dataset!r} has a file per split ({names}); point data.path at "
                        f"the folder that holds them, or use data.dataset = \"text\" for a "
                        f"single file.")
    splits = {split: [Source(resolve_file(cf, dcfg.path), "text")] for split, cf in files.items()}
    if "all" in splits:
        return Plan(splits, dcfg.train_fraction, dcfg.test_fraction, dcfg.train_chars, **common)
    return Plan(splits, **common)


def tokenizer_spec(dcfg, tokenizer=None) -> TokenizerSpec:
    return TokenizerSpec(kind=dcfg.tokenizer, vocab_size=dcfg.vocab_size,
                         vocab_source=dcfg.vocab_source, unknown_chars=dcfg.unknown_chars,
                         sample_chars=dcfg.tokenizer_sample_chars, given=tokenizer)


def _same_tokenizer(a, b) -> bool:
    return tokenizer_json(a) == tokenizer_json(b)


def prepare_data(dcfg, tokenizer=None, quiet: bool = True) -> Dataset:
    """The corpus of a [data] section, tokenized and memory-mapped.

    A prepared folder (dataset "prepared") is opened as it is. Any other corpus is prepared
    once into ``$CONTINUUMLM_CACHE/prepared/KEY`` (KEY: the sources' sha256, the split rule and
    the tokenizer settings) and opened from there. ``tokenizer`` (a resumed or evaluated run's)
    encodes the text instead of one trained from the settings; the cached preparation made with
    the settings is reused when its tokenizer is that very one.
    """
    if dcfg.dataset == "prepared":
        if not dcfg.path:
            raise DataError('data.dataset = "prepared" needs data.path: the folder '
                            '`continuumlm prepare --out DIR` wrote.')
        prepared = Prepared(Path(dcfg.path).expanduser())
        if tokenizer is not None and not _same_tokenizer(tokenizer, prepared.tokenizer):
            raise DataError(f"{dcfg.path} was prepared with another tokenizer than this run's "
                            f"(its tokenizer.json differs from the checkpoint's), so its token "
                            f"ids mean other things; point data.path at the prepared folder the "
                            f"run was trained on.")
        return Dataset(tokenizer or prepared.tokenizer, prepared.splits, prepared.fingerprint,
                       prepared.folder, prepared.digest)
    plan = _plan(dcfg)
    root = cache_dir() / "prepared"
    spec = tokenizer_spec(dcfg)
    log = None if quiet else (lambda m: print(f"prepare: {m}", file=sys.stderr))
    if tokenizer is not None:
        trained = root / plan_key(plan, spec, source_digests(plan))[:32]
        try:
            prepared = Prepared(trained)
        except DataError:
            prepared = None
        if prepared is None or not _same_tokenizer(tokenizer, prepared.tokenizer):
            prepared = Prepared(prepare_cached(root, plan, tokenizer_spec(dcfg, tokenizer),
                                               quiet=quiet, log=log))
        tok = tokenizer
    else:
        prepared = Prepared(prepare_cached(root, plan, spec, quiet=quiet, log=log))
        tok = prepared.tokenizer
    warn_unknown(prepared.meta)
    return Dataset(tok, prepared.splits, prepared.fingerprint, prepared.folder, prepared.digest)
