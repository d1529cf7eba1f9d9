"""tiktoken encodings in prepare (``--tokenizer tiktoken:NAME``): the converted byte-level BPE
encodes exactly as tiktoken on awkward text, through the real plugin mechanism of tiktoken
(``tiktoken_ext``) and the command line, and every way it cannot be used says why.

No encoding of tiktoken's own is available offline (it downloads them on first use), so the
tests build one: the ranks of a byte-level BPE trained here, registered as a tiktoken plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from continuumlm.data import tiktoken_bpe as TB
from continuumlm.data.tokenizers import BPETokenizer
from continuumlm.errors import DataError

tiktoken = pytest.importorskip("tiktoken")

TEXT = ("The quick brown fox jumps over the lazy dog. It's a test, isn't it? We've 12345 "
        "numbers and naïve café\nUnicode: 東京, emoji 🙂🙂, tabs\tand  double  spaces.\n\n"
        "  indented line\r\nthe end of the line; the the the thethe theory\n") * 6


def ranks_of(bpe: BPETokenizer) -> tuple[dict[bytes, int], int]:
    """The trained tokenizer's table as tiktoken ranks (id = rank), and its end-of-text id."""
    back = {c: b for b, c in TB.byte_alphabet().items()}
    vocab = json.loads(bpe.to_json())["model"]["vocab"]
    ranks = {bytes(back[c] for c in tok): i for tok, i in vocab.items()
             if tok != BPETokenizer.EOS}
    return ranks, bpe.eos_id


@pytest.fixture(scope="module")
def table():
    return ranks_of(BPETokenizer.train(TEXT, 400))


def make_encoding(table, pat=TB.GPT2_PATTERNS[0], name="continuumlm_test"):
    ranks, eos = table
    return tiktoken.Encoding(name=name, pat_str=pat, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": eos})


def test_converted_table_encodes_as_tiktoken(table, monkeypatch):
    enc = make_encoding(table)
    monkeypatch.setattr(TB, "encoding", lambda name: enc)
    tok = TB.from_tiktoken("continuumlm_test")
    for text in (TEXT, "x", "", " leading space", "trailing  \n", "🙂" * 7, TEXT[::-1]):
        assert tok.encode(text) == enc.encode_ordinary(text), text[:40]
        assert tok.decode(enc.encode_ordinary(text)) == text
    assert tok.eos_id == table[1] and tok.cuttable() is None  # prepare may cut its texts


def test_prepare_through_tiktokens_plugin_mechanism(table, tmp_path):
    """A tiktoken_ext plugin (how tiktoken finds encodings) on the path of a real
    `continuumlm prepare` process: the token files hold tiktoken's ids of each split."""
    ranks, eos = table
    plugin = tmp_path / "plugins" / "tiktoken_ext"
    plugin.mkdir(parents=True)
    (tmp_path / "ranks.json").write_text(json.dumps({b.hex(): r for b, r in ranks.items()}))
    (plugin / "continuumlm_test_enc.py").write_text(
        "import json\n"
        f"RANKS = {{bytes.fromhex(k): v for k, v in json.load(open({str(tmp_path / 'ranks.json')!r})).items()}}\n"
        "ENCODING_CONSTRUCTORS = {'continuumlm_test': lambda: {'name': 'continuumlm_test', "
        f"'pat_str': {TB.GPT2_PATTERNS[0]!r}, 'mergeable_ranks': RANKS, "
        f"'special_tokens': {{'<|endoftext|>': {eos}}}}}}}\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 3, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    cli = str(Path(sys.executable).parent / "continuumlm")
    r = subprocess.run([cli, "prepare", "--input", str(corpus), "--tokenizer",
                        "tiktoken:continuumlm_test", "--out", str(tmp_path / "out"), "--quiet"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    enc = make_encoding(table)
    text = corpus.read_bytes().decode("utf-8")  # as prepare reads it: \r\n kept
    n_train = int(len(text) * 0.9)
    for split, part in (("train", text[:n_train]), ("val", text[n_train:])):
        ids = np.fromfile(tmp_path / "out" / f"{split}.bin", dtype=meta["dtype"]).tolist()
        assert ids == enc.encode_ordinary(part), split
    # the prepared folder's tokenizer.json is an ordinary byte-level BPE file
    from continuumlm.data.tokenizers import load_tokenizer

    assert load_tokenizer(tmp_path / "out").encode(TEXT) == enc.encode_ordinary(TEXT)


def test_what_cannot_be_used_says_why(table, monkeypatch):
    with pytest.raises(DataError, match="has no encoding 'nope'; it has .*gpt2"):
        TB.encoding("nope")
    monkeypatch.setattr(TB, "encoding", lambda name: make_encoding(
        table, pat=r"""\s+|\S+"""))  # a pattern other than GPT-2's (as cl100k_base's)
    with pytest.raises(DataError, match="pattern is not GPT-2's"):
        TB.from_tiktoken("other")
    monkeypatch.undo()

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="could not load the encoding's files .*TIKTOKEN_CACHE_DIR"):
        TB.encoding("gpt2")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match="pip install tiktoken"):
        TB.encoding("gpt2")


def test_cli_refusals(tmp_path):
    from conftest import run_cli

    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    r = run_cli("prepare", "--input", corpus, "--tokenizer", "tiktoken:nope", "--out",
                tmp_path / "o")
    assert r.returncode == 2 and "has no encoding 'nope'" in r.stderr
    r = run_cli("prepare", "--input", corpus, "--tokenizer", "tiktoken:gpt2", "--vocab-size",
                "100", "--out", tmp_path / "o")
    assert r.returncode == 2 and "no effect with a tiktoken encoding" in r.stderr
    assert not (tmp_path / "o").exists()
