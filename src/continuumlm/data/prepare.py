"""Out-of-core corpus preparation: sources -> tokenizer + one token file per split.

The engine behind ``continuumlm prepare`` and behind every raw-text config (which is prepared
once into the user cache and memory-mapped). Memory is bounded by a block of text, a chunk of
token ids and the tokenizer's training sample, whatever the corpus size.

Three passes over the sources:

1. *count*: characters per source (the split points of a single-stream corpus are character
   positions, as in the in-memory split of earlier versions: the first ``train_fraction`` of
   the characters train, then validation, then ``test_fraction`` test);
2. *sample* (only when a tokenizer is trained): the character set (char), or the training text
   itself when it is at most ``sample_chars`` characters, else a seeded sample of blocks of it
   (word, bpe);
3. *encode*: each split streamed through the tokenizer into ``SPLIT.bin.part``.

Files are written under temporary names and renamed at the end, ``meta.json`` last, so a folder
with a ``meta.json`` is complete and a prepare killed midway leaves nothing that loads.

Documents (the files of a folder, the records of a JSON Lines/Parquet/Arrow file) are joined
with ``<|endoftext|>`` (bpe) or so that each starts on a new line (char, word: a newline is put
after a document that does not end with one).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import DataError, DiskError
from .shards import FORMAT, META_FILE, VERSION, Prepared, read_meta
from .sources import Source, documents, file_digest
from .tokenizers import (
    TOKENIZER_FILE,
    WHITESPACE_CUTS,
    BPETokenizer,
    CharTokenizer,
    WordTokenizer,
    _pieces,
    tokenizer_json,
)

PART = ".part"
SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SAMPLE_CHARS = 64_000_000
CHUNK_CHARS = 4_000_000        # text per encoding call
MAX_BUFFER_CHARS = 64_000_000  # text held while looking for a place to cut it


@dataclass
class Plan:
    """What to prepare: sources per split, or one stream ("all") split by character position."""

    splits: dict[str, list[Source]]
    train_fraction: float = 0.9
    test_fraction: float = 0.0
    train_chars: int | None = None
    text_field: str = "text"
    errors: str = "strict"

    @property
    def stream(self) -> bool:
        return "all" in self.splits

    def describe(self) -> dict:
        if self.stream:
            rule = {"rule": "tail", "train_fraction": self.train_fraction,
                    "test_fraction": self.test_fraction, "train_chars": self.train_chars}
        else:
            rule = {"rule": "files"}
        return {**rule, "text_field": self.text_field, "errors": self.errors}


@dataclass
class TokenizerSpec:
    """How the tokenizer is made: trained (kind, vocab_size, ...) or given (an object)."""

    kind: str = "char"
    vocab_size: int | None = None
    vocab_source: str = "train"
    unknown_chars: str = "unk"
    sample_chars: int = DEFAULT_SAMPLE_CHARS
    seed: int = 0
    given: object | None = None

    def describe(self) -> dict:
        if self.given is not None:
            return {"given": hashlib.sha256(tokenizer_json(self.given).encode()).hexdigest()}
        return {"kind": self.kind, "vocab_size": self.vocab_size,
                "vocab_source": self.vocab_source, "unknown_chars": self.unknown_chars,
                "sample_chars": self.sample_chars, "seed": self.seed}


@dataclass
class Counts:
    chars: dict[str, int] = field(default_factory=dict)  # per split
    bounds: list[tuple[str, int]] = field(default_factory=list)  # stream: (split, end position)


def plan_key(plan: Plan, tok: TokenizerSpec, digests: list[tuple[str, str]],
             dtype: str = "auto") -> str:
    blob = json.dumps({"format": FORMAT, "version": VERSION, "sources": digests,
                       "plan": plan.describe(), "tokenizer": tok.describe(),
                       **({"dtype": dtype} if dtype != "auto" else {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_digests(plan: Plan) -> list[tuple[str, str]]:
    return [(split, file_digest(s.path)) for split, srcs in plan.splits.items() for s in srcs]


# ------------------------------------------------------------------------ walking the text

def count(plan: Plan) -> Counts:
    """Pass 1: characters per split (per stream, then the split points)."""
    c = Counts()
    for split, srcs in plan.splits.items():
        c.chars[split] = sum(len(b) for s in srcs
                             for doc in documents(s, plan.text_field, plan.errors) for b in doc)
    if not plan.stream:
        for split in plan.splits:
            if c.chars[split] == 0:
                raise DataError(f"the {split} split is empty: its sources "
                                f"({', '.join(str(s.path) for s in plan.splits[split])}) hold no "
                                f"text.")
        return c
    total = c.chars.pop("all")
    names = ", ".join(str(s.path) for s in plan.splits["all"][:3])
    if total == 0:
        raise DataError(f"the corpus is empty: {names}{' ...' if len(plan.splits['all']) > 3 else ''} "
                        f"hold{'s' if len(plan.splits['all']) == 1 else ''} no text; point the "
                        f"inputs (data.path) at files that hold text.")
    n_train = plan.train_chars if plan.train_chars is not None else int(total * plan.train_fraction)
    n_test = int(total * plan.test_fraction)
    n_val = total - n_train - n_test
    if n_train <= 0 or n_val <= 0 or (plan.test_fraction > 0 and n_test <= 0):
        raise DataError(f"the split leaves an empty part: the corpus has {total} characters and "
                        f"the training part would have {n_train}, validation {n_val}"
                        + (f", test {n_test}" if plan.test_fraction > 0 else "")
                        + "; adjust data.train_fraction or data.train_chars (--val-fraction, "
                          "--test-fraction), or use a longer corpus.")
    c.chars = {"train": n_train, "val": n_val}
    c.bounds = [("train", n_train), ("val", n_train + n_val)]
    if n_test:
        c.chars["test"] = n_test
        c.bounds.append(("test", total))
    return c


def walk(plan: Plan, counts: Counts) -> Iterator[tuple[str, str | None]]:
    """(split, text) blocks in order; ``(split, None)`` marks the start of a document in a split
    that already holds text (where a separator goes)."""
    if not plan.stream:
        for split, srcs in plan.splits.items():
            started = False
            for s in srcs:
                for doc in documents(s, plan.text_field, plan.errors):
                    if started:
                        yield split, None
                    started = True
                    for block in doc:
                        yield split, block
        return
    bounds, r, pos = counts.bounds, 0, 0
    started: set[str] = set()
    for s in plan.splits["all"]:
        for doc in documents(s, plan.text_field, plan.errors):
            new_doc = True
            for block in doc:
                while block:
                    split, end = bounds[r]
                    if pos >= end:
                        r += 1
                        continue
                    take, block = block[:end - pos], block[end - pos:]
                    if new_doc and split in started:
                        yield split, None
                    new_doc = False
                    started.add(split)
                    yield split, take
                    pos += len(take)


# ------------------------------------------------------------------------------ tokenizer

def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def build_tokenizer(plan: Plan, counts: Counts, spec: TokenizerSpec, log=None):
    """Pass 2: train the tokenizer on the vocabulary splits (or return the given one)."""
    if spec.given is not None:
        return spec.given
    vocab_splits = ["train"] if spec.vocab_source == "train" else list(counts.chars)
    if spec.kind == "char":
        seen = {s: np.zeros(0x110000, dtype=bool) for s in counts.chars}
        for split, text in walk(plan, counts):
            if text is None:
                seen[split][10] = True  # the newline that may join two documents
            else:
                seen[split][_codepoints(text)] = True
        vocab_mask = np.logical_or.reduce([seen[s] for s in vocab_splits])
        vocab = [chr(c) for c in np.flatnonzero(vocab_mask)]
        others = np.logical_or.reduce([seen[s] for s in seen]) & ~vocab_mask
        if others.any():
            unknown = [chr(c) for c in np.flatnonzero(others)]
            if spec.unknown_chars == "error":
                shown = unknown[:20]
                raise DataError(
                    f"characters {shown!r}{' ...' if len(unknown) > 20 else ''} occur outside the "
                    f"training split but not in it, so the char vocabulary built from the "
                    f"training text cannot encode them; set data.unknown_chars = \"unk\" to map "
                    f"them to <unk>, or data.vocab_source = \"all\" to build the vocabulary from "
                    f"the whole corpus.")
            vocab.append(CharTokenizer.UNK)
        return CharTokenizer(vocab)
    total = sum(counts.chars[s] for s in vocab_splits)
    keep = {s: [] for s in vocab_splits}
    if total <= spec.sample_chars:
        for split, text in walk(plan, counts):
            if split in keep:
                keep[split].append("\n" if text is None else text)
        texts = ["".join(keep[s]) for s in vocab_splits]
        text = texts[0] if len(texts) == 1 else "\n".join(texts)
        if spec.kind == "word":
            return WordTokenizer.train(text, spec.vocab_size)
        return BPETokenizer.train(text, spec.vocab_size)
    # a seeded sample of blocks (about a megabyte each) of the vocabulary splits
    rng = np.random.default_rng(spec.seed)
    p, got = spec.sample_chars / total, 0
    sample: list[str] = []
    t0 = time.time()
    for split, text in walk(plan, counts):
        if text is None or split not in keep:
            continue
        if rng.random() < p and got < spec.sample_chars:
            sample.append(text)
            got += len(text)
    if log:
        log(f"sampled {got:,} of {total:,} characters for the tokenizer "
            f"({time.time() - t0:.0f} s)")
    if spec.kind == "word":
        return WordTokenizer.train("\n".join(sample), spec.vocab_size)
    return BPETokenizer.train_pieces((p for block in sample for p in _pieces(block)),
                                     spec.vocab_size)


# ------------------------------------------------------------------------------- encoding

def dtype_for(vocab_size: int, requested: str = "auto") -> np.dtype:
    need = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    if vocab_size > 1 << 32:
        raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit 32-bit token ids.")
    if requested == "auto":
        return np.dtype(need)
    dt = np.dtype(requested)
    if vocab_size > np.iinfo(dt).max + 1:
        raise DataError(f"--dtype {requested} holds ids below {np.iinfo(dt).max + 1:,}, but the "
                        f"vocabulary has {vocab_size:,} tokens; use --dtype uint32 (or auto).")
    return dt


def _last_safe_cut(s: str) -> int:
    """The last place in ``s`` where byte-level BPE pre-tokenization can be cut without changing
    it (ASCII whitespace after a non-space character, see tokenizers._SAFE_CUT); 0 if none."""
    i = len(s)
    while i > 0:
        i = max(s.rfind(c, 0, i) for c in WHITESPACE_CUTS)
        if i <= 0:
            return 0
        if not s[i - 1].isspace():
            return i
    return 0


def _last_space_cut(s: str) -> int:
    """The last "x| y" (a space between two non-space characters): where the word tokenizer
    can cut inside a very long line without splitting a word."""
    i = len(s)
    while True:
        i = s.rfind(" ", 0, i)
        if i <= 0:
            return 0
        if i + 1 < len(s) and not s[i - 1].isspace() and not s[i + 1].isspace():
            return i


# The word tokenizer is plain Python (split and look up), so its chunks are encoded in worker
# processes (the char table is vectorized, bpe runs in the tokenizers library's threads).
_WORKER_TOKENIZER = None


def _start_word_worker(vocab: list[str]) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = WordTokenizer(vocab)


def _encode_words(text: str, dtype: str, trim: bool) -> np.ndarray:
    ids = np.asarray(_WORKER_TOKENIZER.encode(text), dtype=dtype)
    return ids[:-1] if trim else ids


def word_workers() -> int:
    """Processes that encode word-tokenizer chunks: $CONTINUUMLM_PREPARE_WORKERS (``prepare
    --workers``), else every core this process may use."""
    n = os.environ.get("CONTINUUMLM_PREPARE_WORKERS")
    if n:
        return max(1, int(n))
    # the cores this process may run on (a container's share, not the host's count)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


class _Encoder:
    """Streams text through a tokenizer, cutting it only where the encoding does not change.
    ``pool``: an executor that encodes word-tokenizer chunks (feed then yields futures)."""

    def __init__(self, tok, dtype, pool=None):
        self.tok, self.dtype = tok, dtype
        self.pool = pool if isinstance(tok, WordTokenizer) else None
        self.buf: list[str] = []
        self.n = 0
        self.last = "\n"
        self.unknown = 0
        if isinstance(tok, CharTokenizer):
            table = np.full(0x110000, -1, dtype=np.int64)
            for i, c in enumerate(tok.vocab):
                if len(c) == 1:
                    table[ord(c)] = i
            self.table = table

    def _encode(self, text: str) -> np.ndarray:
        tok = self.tok
        if isinstance(tok, CharTokenizer):
            ids = self.table[_codepoints(text)]
            bad = ids < 0
            if bad.any():
                if tok.unk_id is None:
                    tok.encode(text)  # raises the tokenizer's own message
                self.unknown += int(bad.sum())
                ids[bad] = tok.unk_id
            return ids.astype(self.dtype)
        if isinstance(tok, BPETokenizer):
            tok.check_text(text)
            encs = tok.tok.encode_batch(_pieces(text), add_special_tokens=False)
            if not encs:
                return np.zeros(0, self.dtype)
            return np.concatenate([np.asarray(e.ids, dtype=self.dtype) for e in encs])
        return np.asarray(tok.encode(text), dtype=self.dtype)

    def _cut(self, s: str) -> tuple[int, bool]:
        """Where to cut ``s`` (0: keep buffering), and whether the cut is inside a line."""
        if isinstance(self.tok, CharTokenizer):
            return len(s), False
        if isinstance(self.tok, WordTokenizer):
            k = s.rfind("\n") + 1
            if k == 0 and len(s) > MAX_BUFFER_CHARS:
                k = _last_space_cut(s)  # a very long line: cut between two of its words
                if k == 0:
                    raise DataError(f"a word of more than {MAX_BUFFER_CHARS:,} characters: the "
                                    f"word tokenizer cannot cut inside it; use the bpe or char "
                                    f"tokenizer for such text.")
                return k, True
            return k, False
        k = _last_safe_cut(s)
        if k == 0 and len(s) > MAX_BUFFER_CHARS:
            k = len(s)  # tens of megabytes without whitespace: cut anyway (not exact there)
        return k, False

    def feed(self, text: str) -> Iterator[np.ndarray]:
        self.buf.append(text)
        self.n += len(text)
        self.last = text[-1]
        if self.n >= CHUNK_CHARS:
            s = "".join(self.buf)
            k, inside_line = self._cut(s)
            if k:
                self.buf, self.n = [s[k:]], len(s) - k
                # the word tokenizer ends the cut line with <eos>; the line goes on
                if self.pool is not None:
                    yield self.pool.submit(_encode_words, s[:k], self.dtype.name, inside_line)
                    return
                ids = self._encode(s[:k])
                yield ids[:-1] if inside_line else ids
            else:
                self.buf = [s]

    def flush(self) -> Iterator[np.ndarray]:
        if self.n:
            s = "".join(self.buf)
            self.buf, self.n = [], 0
            yield self._encode(s)

    def separator(self) -> Iterator[np.ndarray]:
        if isinstance(self.tok, BPETokenizer) and self.tok.eos_id is not None:
            yield from self.flush()
            yield np.asarray([self.tok.eos_id], dtype=self.dtype)
        elif self.last != "\n":
            yield from self.feed("\n")


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="encode", disable=True if quiet else None,
                file=sys.stderr, leave=False)


def encode_splits(plan: Plan, counts: Counts, tok, folder: Path, dtype, quiet=False) -> dict:
    """Pass 3: write ``SPLIT.bin.part`` per split; returns each split's statistics."""
    stats: dict[str, dict] = {}
    files: dict[str, object] = {}
    encoders: dict[str, _Encoder] = {}
    total_bytes = sum(counts.chars.values())  # about a byte per character; for the bar only
    bar = _progress(total_bytes, quiet)
    limit = tok.vocab_size - 1  # the embedding's last row (BPE ids are checked gap-free)
    pool = None
    workers = word_workers()
    if isinstance(tok, WordTokenizer) and workers > 1 and total_bytes > 8 * CHUNK_CHARS:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # fork where there is one: a spawned worker would import the package (and torch with
        # it, seconds each) before its first chunk; a forked one runs only str.split and dict
        # lookups, nothing that could wait on a lock another thread of this process held
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                   initializer=_start_word_worker, initargs=(tok.vocab,))
    pending: list[tuple[str, object]] = []  # in order; futures while workers encode them

    def close(split: str) -> None:
        enc = encoders.pop(split)
        write(split, enc.flush())
        drain(0)
        stats[split]["unknown_chars"] = enc.unknown

    def write(split: str, arrays) -> None:
        for ids in arrays:
            pending.append((split, ids))
            # at most this many chunks in flight to worker processes; none kept without them
            drain(2 * workers if pool is not None else 0)

    def drain(keep: int) -> None:
        while len(pending) > keep:
            split, ids = pending.pop(0)
            if not isinstance(ids, np.ndarray):
                ids = ids.result()
            if ids.size and int(ids.max()) > limit:
                raise DataError(f"token id {int(ids.max())} is past the tokenizer's stated "
                                f"vocabulary of {tok.vocab_size:,}: the model could not look it "
                                f"up.")
            files[split].write(memoryview(np.ascontiguousarray(ids)))
            stats[split]["tokens"] += int(ids.size)

    try:
        for split, text in walk(plan, counts):
            if split not in files:
                for done in list(encoders):  # splits come one after another
                    close(done)
                files[split] = open(folder / f"{split}.bin{PART}", "wb")
                encoders[split] = _Encoder(tok, dtype, pool)
                stats[split] = {"file": f"{split}.bin", "tokens": 0, "chars": 0, "documents": 1,
                                "_sha": hashlib.sha256()}
            st = stats[split]
            if text is None:
                st["documents"] += 1
                st["_sha"].update(b"\0")
                write(split, encoders[split].separator())
                continue
            raw = text.encode("utf-8", "surrogatepass")
            st["_sha"].update(raw)
            st["chars"] += len(text)
            write(split, encoders[split].feed(text))
            bar.update(len(text))
        for split in list(encoders):
            close(split)
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        for f in files.values():
            f.close()
    for st in stats.values():
        st["text_sha256"] = st.pop("_sha").hexdigest()
    return stats


# --------------------------------------------------------------------------------- writing

def warn_unknown(meta: dict) -> None:
    """The warning of a char vocabulary that mapped characters to <unk> (every time a prepared
    corpus with such characters is opened)."""
    for split, st in meta["splits"].items():
        n = st.get("unknown_chars", 0)
        if n:
            print(f"warning: {n:,} characters of the {split} split are not in the char vocabulary "
                  f"(built from the training text) and are read as <unk>; set "
                  f"data.vocab_source = \"all\" to include them, or data.unknown_chars = "
                  f"\"error\" to refuse such text.", file=sys.stderr)


def _disk_error(what: Path, e: OSError) -> DiskError:
    return DiskError(f"preparing the corpus failed writing {what}: {e.strerror or e}; nothing in "
                     f"{what.parent} looks complete (meta.json is written last). Free space (or "
                     f"choose another --out on a disk with room) and run prepare again.")


def prepare_into(folder: Path, plan: Plan, spec: TokenizerSpec, key: str,
                 digests: list[tuple[str, str]], dtype: str = "auto", quiet: bool = False,
                 log=None) -> dict:
    """Prepare into an empty (or new) ``folder``; returns the meta it wrote."""
    log = log or (lambda m: None)
    t0 = time.time()
    counts = count(plan)
    log(f"read {sum(counts.chars.values()):,} characters in "
        f"{sum(len(v) for v in plan.splits.values())} source file(s) ({time.time() - t0:.0f} s)")
    t1 = time.time()
    tok = build_tokenizer(plan, counts, spec, log)
    if spec.given is None:
        log(f"{tok.kind} tokenizer of {tok.vocab_size:,} tokens ({time.time() - t1:.0f} s)")
    dt = dtype_for(tok.vocab_size, dtype)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tok_json = tokenizer_json(tok)
        (folder / (TOKENIZER_FILE + PART)).write_text(tok_json, encoding="utf-8")
        t2 = time.time()
        stats = encode_splits(plan, counts, tok, folder, dt, quiet)
    except OSError as e:
        raise _disk_error(folder / "train.bin", e) from None
    t3 = time.time()
    rate = sum(s["chars"] for s in stats.values()) / max(t3 - t2, 1e-9) / 1e6
    log(f"encoded {sum(s['tokens'] for s in stats.values()):,} tokens ({rate:.1f} M chars/s)")
    meta = {
        "format": FORMAT, "version": VERSION, "key": key, "dtype": dt.name,
        "vocab_size": tok.vocab_size,
        "tokenizer": {"file": TOKENIZER_FILE, "kind": tok.kind,
                      "sha256": hashlib.sha256(tok_json.encode()).hexdigest()},
        "splits": stats,
        "sources": [{"path": str(s.path), "split": split, "bytes": s.bytes, "sha256": d}
                    for s, (split, d) in zip((s for v in plan.splits.values() for s in v),
                                             digests)],
        "split_rule": plan.describe(),
        "tokenizer_settings": spec.describe(),
        "separator": ("<|endoftext|>" if tok.kind == "bpe" and tok.eos_id is not None
                      else "newline"),
        "seconds": {"count": round(t1 - t0, 3), "tokenizer": round(t2 - t1, 3),
                    "encode": round(t3 - t2, 3)},
    }
    try:
        for name in [TOKENIZER_FILE] + [st["file"] for st in stats.values()]:
            os.replace(folder / (name + PART), folder / name)
        tmp = folder / (META_FILE + PART)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / META_FILE)
    except OSError as e:
        raise _disk_error(folder / META_FILE, e) from None
    return meta


OUR_NAMES = {META_FILE, TOKENIZER_FILE, *(f"{s}.bin" for s in SPLIT_NAMES)}


def _ours(p: Path) -> bool:
    """A file prepare writes (or its temporary name); nothing else is ever deleted."""
    return p.is_file() and (p.name in OUR_NAMES or (p.name.endswith(PART)
                                                    and p.name[:-len(PART)] in OUR_NAMES))


def prepare_folder(out: Path, plan: Plan, spec: TokenizerSpec, dtype: str = "auto",
                   force: bool = False, quiet: bool = False, log=None) -> tuple[dict, bool]:
    """``continuumlm prepare --out``: (meta, prepared_now). An ``out`` that already holds this
    very preparation is kept; one holding another is refused unless ``force``; leftovers of an
    interrupted prepare (no meta.json) are cleared; a folder with other files is refused.
    ``force`` prepares again in any case."""
    digests = source_digests(plan)
    key = plan_key(plan, spec, digests, dtype)
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; name a folder (new or empty) to prepare into.")
    resolved = out.resolve()
    for srcs in plan.splits.values():
        for src in srcs:
            if resolved in src.path.resolve().parents:
                raise DataError(f"--out {out} lies inside an input ({src.path} is in it): a "
                                f"later prepare would read its own token files as text. "
                                f"Prepare into a folder outside the inputs.")
    if (out / META_FILE).is_file():
        try:
            meta = read_meta(out)
        except DataError as e:
            if not force:
                raise DataError(f"{e} (--force prepares it again in place)") from None
            meta = None
        if meta is not None and meta.get("key") == key and not force:
            return meta, False
        if meta is not None and not force:
            raise DataError(f"{out} already holds a prepared corpus of other inputs or settings "
                            f"(its meta.json); pass --force to replace it, or choose another "
                            f"--out.")
    # --force over a finished preparation builds beside it, unless --out is a mount point
    # (nothing can be renamed into it from its parent's file system): then in place, as below
    target = out.resolve()
    replacing = (force and (out / META_FILE).is_file()
                 and target.parent.stat().st_dev == target.stat().st_dev)
    if out.is_dir():
        foreign = [p.name for p in out.iterdir() if not _ours(p)]
        if foreign:
            raise DataError(f"--out {out} holds files prepare did not write ({', '.join(foreign[:5])}"
                            f"{' ...' if len(foreign) > 5 else ''}); prepare into a new or empty "
                            f"folder, so nothing of yours is overwritten.")
        ours = list(out.iterdir())
        interrupted = any(p.name.endswith(PART) for p in ours)
        if ours and not (force or interrupted or (out / META_FILE).is_file()):
            raise DataError(f"--out {out} holds {', '.join(sorted(p.name for p in ours))} but no "
                            f"meta.json and no unfinished .part files, so they may be another "
                            f"tool's (nanoGPT writes train.bin and val.bin too); pass --force "
                            f"to replace them, or prepare into another folder.")
        if not replacing:
            (out / META_FILE).unlink(missing_ok=True)  # first: the folder stops looking complete
            for p in ours:  # an earlier, interrupted or unfinished preparation
                p.unlink(missing_ok=True)
    if not replacing:
        return prepare_into(out, plan, spec, key, digests, dtype, quiet, log), True
    return _replace_preparation(out, plan, spec, key, digests, dtype, quiet, log), True


def _replace_preparation(out: Path, plan: Plan, spec: TokenizerSpec, key: str,
                         digests: list[tuple[str, str]], dtype: str, quiet: bool, log) -> dict:
    """--force over a finished preparation: build the new one beside it and move it in at the
    end, so that a prepare that fails (unreadable input, full disk) leaves the corpus that runs
    may still need as it was. Needs room for both while it runs."""
    target = out.resolve()  # --out may be a symlink to another disk: build beside its target
    for stale in target.parent.glob(f".{target.name}.prepare-*.tmp"):  # of a killed --force
        try:
            os.kill(int(stale.name.rsplit("-", 1)[1].split(".")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
    side = target.parent / f".{target.name}.prepare-{os.getpid()}.tmp"
    shutil.rmtree(side, ignore_errors=True)
    try:
        try:
            meta = prepare_into(side, plan, spec, key, digests, dtype, quiet, log)
        except (DataError, DiskError) as e:
            raise type(e)(f"{e} (the corpus in {out} is unchanged)") from None
        new = {p.name for p in side.iterdir()}
        try:
            (out / META_FILE).unlink(missing_ok=True)  # first: the folder stops looking complete
            for p in out.iterdir():
                if _ours(p) and p.name not in new:
                    p.unlink()
            for name in sorted(new - {META_FILE}) + [META_FILE]:  # meta.json last
                os.replace(side / name, target / name)
        except OSError as e:
            raise _disk_error(out / META_FILE, e) from None
    finally:
        shutil.rmtree(side, ignore_errors=True)
    return meta


def prepare_cached(root: Path, plan: Plan, spec: TokenizerSpec, quiet: bool = True,
                   log=None) -> Path:
    """Prepare into the cache folder ``root/KEY`` unless it is there already. The processes of
    a job on one machine take turns through a file lock (the first prepares, the others then
    find it done, without a collective's timeout); each builds into its own temporary folder
    renamed at the end, so where the lock does not reach (another machine on a shared file
    system) the first rename wins and no reader sees a half-written folder."""
    import fcntl

    digests = source_digests(plan)
    key = plan_key(plan, spec, digests)
    final = root / key[:32]
    if _complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{key[:32]}.lock", "w")
    except OSError as e:
        raise DataError(f"the data cache folder {root} cannot be written ({e.strerror or e}); set "
                        f"$CONTINUUMLM_CACHE to a writable folder with room for the prepared "
                        f"corpus.") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError:
            pass  # a file system without locks: the rename below still keeps readers safe
        if _complete(final):  # prepared by the process that held the lock
            return final
        shutil.rmtree(final, ignore_errors=True)  # damaged
        tmp = root / f".{key[:32]}.{socket.gethostname()}.{os.getpid()}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            prepare_into(tmp, plan, spec, key, digests, quiet=quiet, log=log)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _complete(final):
                    raise
        except DiskError as e:
            raise DiskError(f"{e} (the data cache is {root}; $CONTINUUMLM_CACHE moves it)") from None
        except OSError as e:
            raise DiskError(f"the prepared corpus could not be moved into the data cache {root} "
                            f"({e.strerror or e}); free space there or set $CONTINUUMLM_CACHE "
                            f"to another folder.") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _complete(folder: Path) -> bool:
    """A cache folder that opens as a prepared corpus (else it is prepared again)."""
    if not (folder / META_FILE).is_file():
        return False
    try:
        Prepared(folder)
        return True
    except DataError:  # damaged or not ours; a transient OSError is no reason to delete it
        return False
