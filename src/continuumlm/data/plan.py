"""What a preparation reads and makes: the plan (sources per split, split fractions, the
tokenizer to train), the counting pass over the sources, the walk that cuts them into splits,
and the tokenizer built from them (passes 1 and 2 of ``prepare.py``'s three)."""


from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError
from .shards import FORMAT, VERSION
from .sources import Source, documents, file_digest
from .tokenizers import (
    BPETokenizer,
    CharTokenizer,
    WordTokenizer,
    _pieces,
    tokenizer_json,
)

SPLIT_NAMES = ("train", "val", "test")
DEFAULT_SAMPLE_CHARS = 64_000_000


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
