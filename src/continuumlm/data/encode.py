"""The encoding pass of a preparation: the splits streamed through the tokenizer in chunks cut
only where the encoding does not change, word-level chunks spread over worker processes, each
split written to ``SPLIT.bin.part``."""


from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import DataError
from .plan import Counts, Plan, _codepoints, walk
from .tokenizers import (
    WHITESPACE_CUTS,
    BPETokenizer,
    CharTokenizer,
    WordTokenizer,
    _pieces,
)

PART = ".part"
CHUNK_CHARS = 4_000_000        # text per encoding call
MAX_BUFFER_CHARS = 64_000_000  # text held while looking for a place to cut it


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
