"""tiktoken encodings (``--tokenizer tiktoken:gpt2``) as byte-level BPE ``tokenizers`` models.

A tiktoken encoding is a table of byte strings and their ranks: the rank is the token id, and
BPE merges the adjacent pair whose concatenation ranks lowest. The ``tokenizers`` library
applies an ordered list of merges instead; the two agree when every token of rank r is made by
the merge ranked r, whose halves are what BPE with the lower ranks splits it into. So the
merges are read off the ranks, the byte strings are spelled in GPT-2's byte-to-character
alphabet, and the result encodes exactly as tiktoken does (checked on a probe text before it is
used). Once converted, a prepared folder's ``tokenizer.json`` is an ordinary byte-level BPE
file: training, evaluation and the Hugging Face export need no tiktoken.

Only encodings with GPT-2's pre-tokenizer pattern (gpt2, r50k_base, p50k_base) are taken:
``prepare`` cuts long texts where that pattern never joins characters, and the byte-level
pre-tokenizer of ``tokenizers`` is that pattern. tiktoken offers no public accessor for an
encoding's table; its README builds new encodings from ``_mergeable_ranks``, ``_pat_str`` and
``_special_tokens``, which is what is read here.
"""

from __future__ import annotations

import os

from ..errors import DataError

PREFIX = "tiktoken:"
# GPT-2's pattern as tiktoken writes it (r50k_pat_str), and as GPT-2 released it
GPT2_PATTERNS = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
)
PROBE = ("Hello world! It's 2024: naïve café, 東京 and emoji 🙂.\n\n  indented\tline\r\n"
         "numbers 1234567 and symbols <>{}[] ...the END")


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map: printable bytes stand for themselves, the rest are moved
    to characters from 256 on, so every byte string is spelled in printable characters."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _halves(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two parts BPE with the ranks below ``rank`` leaves of ``token``."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, where = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best):
                best, where = r, i
        if where is None:
            break
        parts[where:where + 2] = [parts[where] + parts[where + 1]]
    if len(parts) != 2:
        raise DataError(f"the tiktoken table is not a BPE table: the token {token!r} (rank "
                        f"{rank}) is not made by one merge of tokens ranked below it.")
    return parts[0], parts[1]


def encoding(name: str):
    """The tiktoken encoding ``name``, or a DataError saying why it is not available."""
    try:
        import tiktoken
    except ImportError:
        raise DataError(f"--tokenizer {PREFIX}{name} needs the tiktoken package: pip install "
                        f"tiktoken (or 'continuumlm[corpora]').") from None
    if name not in tiktoken.list_encoding_names():
        raise DataError(f"--tokenizer {PREFIX}{name}: tiktoken has no encoding {name!r}; it "
                        f"has {', '.join(sorted(tiktoken.list_encoding_names()))}.")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - a download (requests, OSError) on a closed network
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") \
            or "the system temp folder's data-gym-cache"
        raise DataError(f"--tokenizer {PREFIX}{name}: tiktoken could not load the encoding's "
                        f"files ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                        f"tiktoken downloads them on first use and keeps them in "
                        f"$TIKTOKEN_CACHE_DIR ({cache}). Fetch them once where the network is "
                        f"open and copy that folder here.") from None


def from_tiktoken(name: str):
    """A BPETokenizer that encodes exactly as the tiktoken encoding ``name``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from .tokenizers import BPETokenizer

    enc = encoding(name)
    if enc._pat_str not in GPT2_PATTERNS:
        raise DataError(f"--tokenizer {PREFIX}{name}: its pre-tokenizer pattern is not GPT-2's, "
                        f"so a text cut where prepare cuts it could encode differently from "
                        f"the whole; prepare takes gpt2, r50k_base and p50k_base (or train a "
                        f"byte-level BPE with --tokenizer bpe).")
    ranks: dict[bytes, int] = dict(enc._mergeable_ranks)
    specials: dict[str, int] = dict(enc._special_tokens)
    spell = byte_alphabet()

    def text(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges = []
    for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(b) > 1:
            left, right = _halves(ranks, b, r)
            merges.append((text(left), text(right)))
    vocab.update(specials)
    ids = sorted(vocab.values())
    if ids != list(range(len(ids))):
        raise DataError(f"--tokenizer {PREFIX}{name}: its token ids are not 0..{len(ids) - 1} "
                        f"without gaps, which a model's embedding table needs.")
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    out = BPETokenizer(tok)
    if out.encode(PROBE) != enc.encode_ordinary(PROBE):
        raise DataError(f"--tokenizer {PREFIX}{name}: the converted tokenizer does not encode "
                        f"as tiktoken does; it cannot be used.")
    if out.eos_id is None:
        raise DataError(f"--tokenizer {PREFIX}{name}: the encoding has no <|endoftext|> token "
                        f"to separate documents with.")
    return out
