"""[data]: the corpus and its tokenizer (DataConfig)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .checks import _strict, _validate


@dataclass
class DataConfig:
    """Which corpus, how it is tokenized and split."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    dataset: str = "tinyshakespeare"
    """"tinyshakespeare", "ptb" (Mikolov's splits), "text" (data.path: a text file, a folder or
    a glob of text, JSON Lines, Parquet or Arrow files, split by train_fraction or train_chars)
    or "prepared" (data.path: a folder written by ``continuumlm prepare``). Every corpus but a
    prepared one is prepared once into the user cache and memory-mapped from there."""
    path: str | None = None
    """A text file, folder or glob (dataset "text"), a corpus file, a folder with the PTB files,
    or a prepared folder (dataset "prepared")."""
    tokenizer: str = "char"
    """"char", "word" (whitespace words, <unk> and <eos>) or "bpe" (byte-level, trained on the
    training split, or a seeded sample of it of tokenizer_sample_chars characters)."""
    vocab_size: int | None = None
    """Vocabulary cap for word (most frequent words kept, rest <unk>) and bpe tokenizers."""
    vocab_source: str = "train"
    """Build the tokenizer from the training split ("train") or the whole corpus ("all")."""
    unknown_chars: str = "unk"
    """Char tokenizer: characters outside the training split but not in it map to an extra
    <unk> token, with a warning that counts them ("unk"), or stop the run ("error")."""
    train_fraction: float = 0.9
    """Share of the text that trains (the rest validates), when train_chars is not set."""
    test_fraction: float = 0.0
    """Share of the text, at its end, kept as a test split (dataset "text")."""
    train_chars: int | None = None
    """If set, the first ``train_chars`` characters train and the rest validate (CAT's split)."""
    errors: str = "strict"
    """How non-UTF-8 bytes are handled: "strict" stops with the byte offset, "replace" goes on."""
    text_field: str = "text"
    """The text field of JSON Lines records and the text column of Parquet/Arrow files."""
    tokenizer_sample_chars: int = 64_000_000
    """Word/bpe tokenizers train on the whole training text up to this many characters, and on
    a seeded sample of that size (blocks of about 1 MB) of a larger one."""

    def __post_init__(self) -> None:
        _validate(self, "data")
        n = self.vocab_size if _strict() else None
        if n is not None and self.tokenizer == "char":
            raise ConfigError(
                f"data.vocab_size = {n} has no effect with data.tokenizer = 'char', whose "
                f"vocabulary is every character of the corpus; remove it, or use the 'word' or "
                f"'bpe' tokenizer to cap the vocabulary.")
        least = {"word": 3, "bpe": 257}.get(self.tokenizer, 0)
        if n is not None and n < least:
            raise ConfigError(
                f"data.vocab_size = {n} is too small for the {self.tokenizer} tokenizer: "
                + ("its vocabulary holds <eos> and <unk> besides the words it keeps, so "
                   "anything under 3 turns every word into <unk>" if self.tokenizer == "word"
                   else "its vocabulary holds the 256 bytes and <|endoftext|> before any merge")
                + f"; use at least {least}, or leave it out for "
                + ("every word of the training text." if self.tokenizer == "word" else "4096."))
