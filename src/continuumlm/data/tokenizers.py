"""Tokenizers: ``char``, ``word`` (whitespace, PTB style) and ``bpe`` (byte-level, trained locally
with the ``tokenizers`` library). Every tokenizer saves to and loads from ``tokenizer.json``."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from ..errors import DataError

TOKENIZER_FILE = "tokenizer.json"
FORMAT = "continuumlm-tokenizer"

class CharTokenizer:
    """One id per character. A vocabulary built from the training text may end with ``<unk>``
    (the only entry longer than one character), standing for characters found outside the
    training text but not in it (data.unknown_chars = "unk")."""

    kind = "char"
    eos_id = None
    UNK = "<unk>"

    def __init__(self, vocab: list[str]):
        self.vocab = vocab
        self.stoi = {c: i for i, c in enumerate(vocab)}
        self.unk_id = self.stoi.get(self.UNK)

    @classmethod
    def train(cls, text: str, vocab_size: int | None = None) -> CharTokenizer:
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        if self.unk_id is not None:
            get, unk = self.stoi.get, self.unk_id
            return [get(c, unk) for c in text]
        try:
            return [self.stoi[c] for c in text]
        except KeyError:
            unknown = sorted(set(text) - self.stoi.keys())
            raise DataError(
                f"characters {unknown!r} are not in this model's vocabulary of {len(self.vocab)} "
                f"characters (built from its training text); remove them, or for a new model set "
                f"data.vocab_source = \"all\" to build the vocabulary from the whole corpus.") from None

    def decode(self, ids) -> str:
        return "".join(self.vocab[i] for i in ids)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "type": self.kind, "vocab": self.vocab}

class WordTokenizer:
    """Whitespace words with ``<eos>`` at every line end; words outside the vocabulary map to
    ``<unk>`` (the usual Penn Treebank practice)."""

    kind = "word"
    EOS, UNK = "<eos>", "<unk>"

    def __init__(self, vocab: list[str]):
        if vocab[:2] != [self.EOS, self.UNK]:
            raise DataError("a word vocabulary must start with <eos>, <unk>.")
        self.vocab = vocab
        self.stoi = {w: i for i, w in enumerate(vocab)}
        self.eos_id, self.unk_id = 0, 1

    @classmethod
    def train(cls, text: str, vocab_size: int | None = None) -> WordTokenizer:
        counts = Counter(text.split())
        counts.pop(cls.EOS, None)
        counts.pop(cls.UNK, None)
        limit = None if vocab_size is None else max(vocab_size - 2, 0)
        # most_common breaks ties by first occurrence; sort for a run-independent order
        words = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
        return cls([cls.EOS, cls.UNK] + [w for w, _ in words])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def words(self, text: str) -> list[str]:
        out: list[str] = []
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # a final newline ends the last line, it does not start a new one
        for line in lines:
            out.extend(line.split())
            out.append(self.EOS)
        return out

    def encode(self, text: str) -> list[int]:
        get, unk = self.stoi.get, self.unk_id
        return [get(w, unk) for w in self.words(text)]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            w = self.vocab[i]
            out.append("\n" if w == self.EOS else w + " ")
        return "".join(out)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "type": self.kind, "vocab": self.vocab}

# A place where ASCII whitespace follows a non-space character. The byte-level pre-tokenizer
# (GPT-2's pattern) never puts such a pair in one pre-token (a pre-token holding a non-space
# character ends at it; a whitespace pre-token holds whitespace only), and what it makes of the
# text on either side does not depend on the other side, so text cut at such places
# pre-tokenizes, and therefore encodes, exactly as the whole text does. (Cutting after every
# newline would not: "\n" followed by indentation is one pre-token, which training then learns
# as a merge that encoding line by line could never produce.)
_SAFE_CUT = re.compile(r"(?<=[^\s])(?=[ \t\r\n])")
WHITESPACE_CUTS = " \t\r\n"


def _pieces(text: str, size: int = 1 << 14) -> list[str]:
    """``text`` cut into pieces of at least ``size`` characters (but the last) at safe places."""
    out, start = [], 0
    while len(text) - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start:m.start()])
        start = m.start()
    out.append(text[start:])
    return out

class BPETokenizer:
    """Byte-level BPE from the ``tokenizers`` library; any text encodes, nothing is unknown."""

    kind = "bpe"
    EOS = "<|endoftext|>"

    def __init__(self, tok):
        ids = set(tok.get_vocab(with_added_tokens=True).values())
        if ids and (min(ids) != 0 or max(ids) + 1 != len(ids)):
            # the model's embedding has vocab_size rows: an id at or past it could not be looked
            # up (a hole, or an added token numbered past the vocabulary)
            raise DataError(f"the BPE tokenizer numbers its {len(ids):,} tokens from {min(ids)} "
                            f"to {max(ids)}, not 0 to {len(ids) - 1}: ids with holes cannot index "
                            f"the model's embedding. Renumber the vocabulary (and added tokens) "
                            f"without gaps, or let prepare train a tokenizer (--tokenizer bpe).")
        self.tok = tok
        self.eos_id = tok.token_to_id(self.EOS)

    @classmethod
    def train(cls, text: str, vocab_size: int | None = None) -> BPETokenizer:
        return cls.train_pieces(_pieces(text), vocab_size)

    @classmethod
    def train_pieces(cls, pieces, vocab_size: int | None = None) -> BPETokenizer:
        """Train from an iterator of texts (each cut where pre-tokenization allows)."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size or 4096, special_tokens=[cls.EOS], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(pieces, trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @staticmethod
    def check_text(text: str) -> None:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates, e.g. undecodable bytes from argv
            raise DataError(f"the text holds {text[e.start:e.end]!r} at offset {e.start}, which "
                            f"is not valid Unicode (bytes that were not UTF-8); pass UTF-8 "
                            f"text.") from None

    def encode(self, text: str) -> list[int]:
        self.check_text(text)
        # Pieces in a batch (much faster than one huge string), cut as training cut them
        out: list[int] = []
        for enc in self.tok.encode_batch(_pieces(text), add_special_tokens=False):
            out.extend(enc.ids)
        return out

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()

    def cuttable(self) -> str | None:
        """None when text may be cut at whitespace without changing its encoding (a byte-level
        pre-tokenizer with GPT-2's pattern and no normalizer, as this class trains); otherwise
        what stands in the way."""
        d = json.loads(self.to_json())
        pre, norm = d.get("pre_tokenizer") or {}, d.get("normalizer")
        if norm is not None:
            return f"its normalizer ({norm.get('type')})"
        if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) \
                or pre.get("add_prefix_space"):
            return f"its pre-tokenizer ({pre.get('type') or 'none'})"
        return None

KINDS = {"char": CharTokenizer, "word": WordTokenizer, "bpe": BPETokenizer}

def train_tokenizer(kind: str, text: str, vocab_size: int | None = None):
    if not text:
        raise DataError("cannot build a tokenizer from empty text: the training split is empty.")
    return KINDS[kind].train(text, vocab_size)

def tokenizer_json(tok) -> str:
    return tok.to_json() if isinstance(tok, BPETokenizer) else json.dumps(tok.to_dict())

def save_tokenizer(tok, directory: str | Path) -> Path:
    path = Path(directory) / TOKENIZER_FILE
    path.write_text(tokenizer_json(tok), encoding="utf-8")
    return path

def load_tokenizer(path: str | Path):
    """Load a ``tokenizer.json`` (a folder holding one, or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing; every checkpoint stores its tokenizer there.")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); the tokenizer file is corrupt.") from None
    if isinstance(d, dict) and d.get("format") == FORMAT and d.get("type") in ("char", "word"):
        vocab = d.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab) or not vocab:
            raise DataError(f"{path}: 'vocab' must be a non-empty list of strings.")
        return KINDS[d["type"]](vocab)
    if isinstance(d, dict) and "model" in d:
        from tokenizers import Tokenizer

        try:
            return BPETokenizer(Tokenizer.from_str(text))
        except Exception as e:  # the library raises plain Exception subclasses
            raise DataError(f"{path} is not a tokenizer the tokenizers library can read: {e}") from None
    raise DataError(f"{path} is not a ContinuumLM or tokenizers-library tokenizer file.")
