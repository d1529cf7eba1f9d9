import hashlib

import pytest

from continuumlm.config import DataConfig
from continuumlm.data import corpora, prepare_data
from continuumlm.data.corpora import CorpusFile, resolve_file
from continuumlm.errors import DataError


def _cf(tmp_path, content: bytes, good=True):
    src = tmp_path / "remote" / "corpus.txt"
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(content)
    digest = hashlib.sha256(content if good else b"other").hexdigest()
    return CorpusFile("corpus.txt", src.as_uri(), digest)


def test_resolution_order(tmp_path, monkeypatch):
    cf = _cf(tmp_path, b"hello")
    own = tmp_path / "own.txt"
    own.write_bytes(b"mine, unchecked")
    env = tmp_path / "env"
    env.mkdir()
    (env / "corpus.txt").write_bytes(b"hello")
    monkeypatch.setenv("CONTINUUMLM_DATA", str(env))
    assert resolve_file(cf, str(own)) == own  # 1. data.path wins, even without a checksum
    assert resolve_file(cf) == env / "corpus.txt"  # 2. $CONTINUUMLM_DATA
    monkeypatch.setenv("CONTINUUMLM_DATA", str(tmp_path / "nowhere"))
    got = resolve_file(cf)  # 4. downloaded into the cache
    assert got == corpora.cache_dir() / "corpus.txt" and got.read_bytes() == b"hello"
    (tmp_path / "remote" / "corpus.txt").unlink()
    assert resolve_file(cf) == got  # 3. the cache, no download needed


def test_a_data_path_that_holds_no_file_is_an_error(tmp_path, monkeypatch):
    """A typo in data.path, or a folder lacking one of the corpus files, must not fall through
    to the canonical corpus ($CONTINUUMLM_DATA here holds it)."""
    cf = _cf(tmp_path, b"hello")
    env = tmp_path / "env"
    env.mkdir()
    (env / "corpus.txt").write_bytes(b"hello")
    monkeypatch.setenv("CONTINUUMLM_DATA", str(env))
    with pytest.raises(DataError, match=r"own_typo.txt does not exist.*remove data.path"):
        resolve_file(cf, str(tmp_path / "own_typo.txt"))
    (tmp_path / "own").mkdir()  # a folder without the file
    with pytest.raises(DataError, match=r"own/corpus.txt does not exist"):
        resolve_file(cf, str(tmp_path / "own"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="relative paths are read from the current folder"):
        resolve_file(cf, "typo.txt")


def test_an_unwritable_cache_is_a_data_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTINUUMLM_DATA", str(tmp_path / "env"))
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("CONTINUUMLM_CACHE", str(blocker / "cache"))
    with pytest.raises(DataError, match=r"cannot be downloaded into the cache folder .*a_file"):
        resolve_file(_cf(tmp_path, b"hello"))


def test_checksum_mismatch_in_data_dir(tmp_path, monkeypatch):
    cf = _cf(tmp_path, b"hello", good=False)
    env = tmp_path / "env"
    env.mkdir()
    (env / "corpus.txt").write_bytes(b"hello")
    monkeypatch.setenv("CONTINUUMLM_DATA", str(env))
    with pytest.raises(DataError, match="pinned checksum"):
        resolve_file(cf)


def test_download_with_bad_checksum_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("CONTINUUMLM_DATA", raising=False)
    cf = _cf(tmp_path, b"tampered", good=False)
    with pytest.raises(DataError, match="does not match its pinned sha256"):
        resolve_file(cf)
    assert not list(corpora.cache_dir().iterdir())  # no partial or bad file left behind


def test_failed_download_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTINUUMLM_DATA", str(tmp_path / "env"))
    cf = CorpusFile("corpus.txt", (tmp_path / "missing.txt").as_uri(), "0" * 64)
    with pytest.raises(DataError, match=r"could not download.*env/corpus.txt.*data.path"):
        resolve_file(cf)
    assert not list(corpora.cache_dir().iterdir())


def test_non_utf8_names_offset(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"good text\xff" + b" more good text" * 30)
    with pytest.raises(DataError, match="offset 9"):
        prepare_data(DataConfig(dataset="text", path=str(p)))
    ds = prepare_data(DataConfig(dataset="text", path=str(p), errors="replace"))
    assert "\ufffd" in ds.tokenizer.vocab


def test_empty_corpus(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare_data(DataConfig(dataset="text", path=str(p)))


def test_shared_corpora_resolve_and_split(data_dir, monkeypatch):
    monkeypatch.setenv("CONTINUUMLM_DATA", str(data_dir))
    ds = prepare_data(DataConfig())
    assert ds.tokenizer.vocab_size == 65
    n = len(ds.splits["train"]) + len(ds.splits["val"])
    assert n == 1115394 and len(ds.splits["train"]) == int(n * 0.9)
    cat = prepare_data(DataConfig(train_chars=50000, vocab_source="all"))
    assert len(cat.splits["train"]) == 50000 and cat.tokenizer.vocab_size == 65
    with pytest.raises(DataError, match="outside the training split.*vocab_source"):
        prepare_data(DataConfig(train_chars=50000, unknown_chars="error"))


def test_ptb_word_counts(data_dir, monkeypatch):
    monkeypatch.setenv("CONTINUUMLM_DATA", str(data_dir))
    ds = prepare_data(DataConfig(dataset="ptb", tokenizer="word"))
    assert ds.tokenizer.vocab_size == 10000
    assert {k: len(v) for k, v in ds.splits.items()} == {"train": 929589, "val": 73760, "test": 82430}


def test_one_file_for_a_corpus_with_a_file_per_split_is_refused(tmp_path):
    one = tmp_path / "ptb.test.txt"
    one.write_text("the cat sat\n")
    with pytest.raises(DataError, match="one file.*ptb.train.txt.*folder"):
        prepare_data(DataConfig(dataset="ptb", path=str(one), tokenizer="word"))
