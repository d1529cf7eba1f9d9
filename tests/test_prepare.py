"""Out-of-core preparation: streamed encoding equals whole-text encoding, every source format,
prepare -> train -> resume -> eval, interrupted and bad input."""

from __future__ import annotations

import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli
from continuumlm.config import DataConfig
from continuumlm.data import BatchSampler, eval_batches, prepare_data
from continuumlm.data import encode as E
from continuumlm.data import prepare as P
from continuumlm.data import sources as S
from continuumlm.data.shards import Prepared, read_meta
from continuumlm.data.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer
from continuumlm.errors import DataError


def awkward_text(n_lines: int = 400, seed: int = 0) -> str:
    """Lines with indentation, blank lines, runs of spaces, multi-byte characters and one long
    line without a newline-cut in it: every kind of place a streamed encoder must not cut."""
    g = np.random.default_rng(seed)
    words = ["def", "return", "x", "  y", "é", "中文", "🙂", "\t", "a.b", "'s", "42", "(", ")"]
    out = []
    for i in range(n_lines):
        indent = " " * int(g.integers(0, 9))
        body = " ".join(g.choice(words, int(g.integers(0, 12))))
        out.append(indent + body + ("\n\n" if i % 17 == 0 else "\n"))
    out.insert(n_lines // 2, "long " * 3000 + "\n")
    out.insert(n_lines // 3, "".join(f"    indented {i} \r\n" for i in range(200)))  # CRLF
    out.insert(n_lines // 4, " = heading = \n \n" * 50 + "中文没有空格" * 300 + "\r\n")
    return "".join(out)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 97 bytes (multi-byte characters split between them) and encoding chunks of
    500 characters, so the cutting logic runs many times on a small text."""
    monkeypatch.setattr(S, "BLOCK_BYTES", 97)
    monkeypatch.setattr(E, "CHUNK_CHARS", 500)
    monkeypatch.setattr(E, "MAX_BUFFER_CHARS", 4000)


def plan_for(path: Path, **kw) -> P.Plan:
    return P.Plan({"all": S.expand([str(path)])}, **kw)


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_streamed_encoding_equals_the_whole_texts(kind, tmp_path, tiny_blocks):
    text = awkward_text()
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    n = int(len(text) * 0.8)
    parts = {"train": text[:n], "val": text[n:]}
    tok = {"char": CharTokenizer, "word": WordTokenizer, "bpe": BPETokenizer}[kind].train(
        parts["train"] if kind != "char" else text, 300 if kind == "bpe" else None)
    meta, _ = P.prepare_folder(tmp_path / "out", plan_for(tmp_path / "c.txt", train_fraction=0.8),
                               P.TokenizerSpec(given=tok), quiet=True)
    prepared = Prepared(tmp_path / "out")
    for split, part in parts.items():
        ids = np.asarray(prepared.splits[split]).tolist()
        assert ids == tok.encode(part), split
        if kind != "word":
            assert tok.decode(ids) == part
    assert meta["splits"]["train"]["chars"] == n


@pytest.mark.parametrize("workers", ["1", "3"])
def test_word_chunks_encoded_by_worker_processes_equal_one_process(workers, tmp_path,
                                                                   tiny_blocks, monkeypatch):
    """The word tokenizer's chunks go to worker processes (results written in order,
    a bounded number in flight); the token files equal those of one process and the whole
    text's encoding, lines cut inside included."""
    from concurrent.futures import ProcessPoolExecutor

    monkeypatch.setenv("CONTINUUMLM_PREPARE_WORKERS", workers)
    submitted = []
    real = ProcessPoolExecutor.submit
    monkeypatch.setattr(ProcessPoolExecutor, "submit",
                        lambda self, *a, **k: submitted.append(a[1]) or real(self, *a, **k))
    text = awkward_text(seed=3)
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    n = int(len(text) * 0.8)
    tok = WordTokenizer.train(text[:n])
    P.prepare_folder(tmp_path / "out", plan_for(tmp_path / "c.txt", train_fraction=0.8),
                     P.TokenizerSpec(given=tok), quiet=True)
    prepared = Prepared(tmp_path / "out")
    for split, part in (("train", text[:n]), ("val", text[n:])):
        assert np.asarray(prepared.splits[split]).tolist() == tok.encode(part), split
    if workers == "1":
        assert not submitted
    else:  # most of the text went through the workers
        assert sum(len(t) for t in submitted) > 0.8 * len(text)


def test_prepared_tokenizer_equals_the_in_memory_one(tmp_path, tiny_blocks):
    """A training text within the sample bound trains the tokenizer on all of it: the same
    vocabulary and merges as training on the text in one piece."""
    text = awkward_text()
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    P.prepare_folder(tmp_path / "out", plan_for(tmp_path / "c.txt"),
                     P.TokenizerSpec("bpe", 400), quiet=True)
    ours = Prepared(tmp_path / "out").tokenizer
    assert ours.to_json() == BPETokenizer.train(text[:int(len(text) * 0.9)], 400).to_json()


def test_a_folder_prepared_by_an_older_tokenizers_release_still_opens(tmp_path, tiny_blocks):
    """tokenizers 0.20 writes BPE merges as pairs, earlier releases as "a b" strings: a folder
    holding the older file (hashed as written) opens, and a cache folder that does not open is
    prepared again instead of being taken as complete; a file that was edited is refused."""
    (tmp_path / "c.txt").write_text(awkward_text(), encoding="utf-8")
    out = tmp_path / "out"
    P.prepare_folder(out, plan_for(tmp_path / "c.txt"), P.TokenizerSpec("bpe", 300), quiet=True)
    tok_file, meta_file = out / "tokenizer.json", out / "meta.json"
    data = json.loads(tok_file.read_text())
    merges = data["model"]["merges"]
    assert merges and isinstance(merges[0], list)
    data["model"]["merges"] = [" ".join(m) for m in merges]  # the older release's spelling
    older = json.dumps(data)
    tok_file.write_text(older, encoding="utf-8")
    meta = json.loads(meta_file.read_text())
    import hashlib

    meta["tokenizer"]["sha256"] = hashlib.sha256(older.encode()).hexdigest()
    meta_file.write_text(json.dumps(meta))
    Prepared(out)  # opens
    assert P._complete(out)
    edited = data["model"]["merges"]
    edited[0], edited[1] = edited[1], edited[0]  # another merge order: another tokenizer
    tok_file.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(DataError, match="not the tokenizer the token files were encoded with"):
        Prepared(out)
    assert not P._complete(out)


@pytest.mark.parametrize("elsewhere", ["same disk", "another disk"])
def test_force_through_a_symlinked_out(tmp_path, elsewhere):
    """--out as a symlink (data/ptb -> /scratch/...): --force builds beside the target, or in
    place when that is another file system, and the link stays a link to the new corpus."""
    import shutil
    import tempfile

    if elsewhere == "another disk":
        shm = Path("/dev/shm")
        if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
            pytest.skip("no second file system here")
        real = Path(tempfile.mkdtemp(dir=shm)) / "corpus"
    else:
        real = tmp_path / "disk" / "corpus"
    try:
        real.mkdir(parents=True)
        link = tmp_path / "link"
        link.symlink_to(real)
        src = write_source("text", tmp_path / "src")
        args = ["prepare", "--input", src, "--tokenizer", "char", "--out", link]
        assert run_cli(*args, "--val-fraction", "0.3").returncode == 0
        r = run_cli(*args, "--val-fraction", "0.2", "--force")
        assert r.returncode == 0, r.stderr
        assert link.is_symlink() and read_meta(real)["split_rule"]["train_fraction"] == \
            pytest.approx(0.8)
        assert not list(real.parent.glob(".corpus.prepare-*"))
    finally:
        if elsewhere == "another disk":
            shutil.rmtree(real.parent, ignore_errors=True)


def test_an_unreadable_source_is_a_data_error(tmp_path, monkeypatch):
    """Hashing a source that cannot be read (permissions) names the file, exit status 2."""
    src = write_source("text", tmp_path / "src")

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(S, "sha256_file", refuse)
    r = run_cli("prepare", "--input", src, "--tokenizer", "char", "--out", tmp_path / "out")
    assert r.returncode == 2 and "cannot be read (Permission denied)" in r.stderr, r.stderr


def test_sampled_tokenizer_is_seeded(tmp_path, tiny_blocks):
    (tmp_path / "c.txt").write_text(awkward_text(3000), encoding="utf-8")
    plan = plan_for(tmp_path / "c.txt")
    counts = P.count(plan)
    spec = P.TokenizerSpec("bpe", 300, sample_chars=5000, seed=3)
    a, b = (P.build_tokenizer(plan, counts, spec).to_json() for _ in range(2))
    other = P.build_tokenizer(plan, counts, P.TokenizerSpec("bpe", 300, sample_chars=5000, seed=4))
    assert a == b and a != other.to_json()


DOCS = ["first document\nwith two lines\n", "second, é 中\n", "third\n", "fourth one\n" * 5]


def write_source(kind: str, d: Path, docs=DOCS, field="text") -> str:
    """Write ``docs`` as a source of ``kind``; returns what --input names."""
    d.mkdir(parents=True, exist_ok=True)
    if kind == "text":
        (d / "c.txt").write_text("".join(docs))
        return str(d / "c.txt")
    if kind in ("folder", "glob"):
        for i, doc in enumerate(docs):  # sorted order: a/0.txt, a/1.txt, b/...
            sub = d / ("a" if i < 2 else "b")
            sub.mkdir(exist_ok=True)
            (sub / f"{i}.txt").write_text(doc)
        (d / ".hidden.txt").write_text("never read\n")
        return str(d) if kind == "folder" else str(d / "*" / "*.txt")
    if kind == "gz":
        with gzip.open(d / "c.txt.gz", "wt") as f:
            f.write("".join(docs))
        return str(d / "c.txt.gz")
    if kind in ("jsonl", "jsonl.gz"):
        lines = "".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(docs))
        if kind == "jsonl":
            (d / "c.jsonl").write_text(lines + "\n")  # a blank line is skipped
            return str(d / "c.jsonl")
        with gzip.open(d / "c.jsonl.gz", "wt") as f:
            f.write(lines)
        return str(d / "c.jsonl.gz")
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"id": list(range(len(docs))), field: docs})
    if kind == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, d / "c.parquet", row_group_size=2)
        return str(d / "c.parquet")
    writer = pa.ipc.new_stream if kind == "arrow-stream" else pa.ipc.new_file
    with pa.OSFile(str(d / "c.arrow"), "wb") as sink, writer(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    return str(d / "c.arrow")


FORMATS = ["text", "folder", "glob", "gz", "jsonl", "jsonl.gz", "parquet", "arrow-stream",
           "arrow-file"]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_source_format_prepares_its_text(kind, tmp_path):
    src = write_source(kind, tmp_path / "src")
    r = run_cli("prepare", "--input", src, "--tokenizer", "char", "--val-fraction", "0.3",
                "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    p = Prepared(tmp_path / "out")
    text = "".join(DOCS)  # every document ends with a newline: nothing is put between them
    decoded = p.tokenizer.decode(np.concatenate([p.splits["train"], p.splits["val"]]))
    assert decoded == text
    assert p.meta["splits"]["train"]["chars"] == int(len(text) * 0.7)
    single = kind in ("text", "gz")
    assert (p.meta["splits"]["train"]["documents"] + p.meta["splits"]["val"]["documents"]
            == (2 if single else len(DOCS) + 1))  # the document cut by the split counts twice
    assert all(len(s["sha256"]) == 64 for s in p.meta["sources"])


def test_bpe_documents_are_joined_by_end_of_text(tmp_path):
    src = write_source("jsonl", tmp_path / "src", docs=["no newline", "ends\n", "last"])
    P.prepare_folder(tmp_path / "out", P.Plan({"train": S.expand([src]), "val": S.expand([src])}),
                     P.TokenizerSpec("bpe", 300), quiet=True)
    p = Prepared(tmp_path / "out")
    ids = np.asarray(p.splits["train"]).tolist()
    eos = p.tokenizer.eos_id
    assert ids.count(eos) == 2
    assert p.tokenizer.decode(ids) == "no newline<|endoftext|>ends\n<|endoftext|>last"


def test_char_vocabulary_maps_characters_outside_the_training_text_to_unk(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("abcabcabc" * 10 + "xyz!")
    ds = prepare_data(DataConfig(dataset="text", path=str(tmp_path / "c.txt"),
                                 train_fraction=0.9), quiet=True)
    tok = ds.tokenizer
    assert tok.vocab[-1] == "<unk>" and tok.vocab[:-1] == ["a", "b", "c"]
    val = np.asarray(ds.splits["val"]).tolist()
    assert val.count(tok.unk_id) == 4 and len(val) == 94 - int(94 * 0.9)
    assert "4 characters of the val split are not in the char vocabulary" in capsys.readouterr().err
    with pytest.raises(DataError, match="outside the training split"):
        prepare_data(DataConfig(dataset="text", path=str(tmp_path / "c.txt"),
                                unknown_chars="error"))
    allv = prepare_data(DataConfig(dataset="text", path=str(tmp_path / "c.txt"),
                                   vocab_source="all"))
    assert "<unk>" not in allv.tokenizer.vocab and len(allv.tokenizer.vocab) == 7


def test_raw_text_corpora_are_prepared_once(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text(awkward_text())
    cfg = DataConfig(dataset="text", path=str(tmp_path / "c.txt"), tokenizer="bpe",
                     vocab_size=300)
    first = prepare_data(cfg)
    assert isinstance(first.splits["train"], np.memmap)

    def no_encoding(*a, **k):
        raise AssertionError("encoded again")

    monkeypatch.setattr(P, "encode_splits", no_encoding)
    again = prepare_data(cfg)
    assert again.folder == first.folder
    resumed = prepare_data(cfg, tokenizer=first.tokenizer)  # a resumed run's own tokenizer
    assert resumed.folder == first.folder and resumed.fingerprint == first.fingerprint
    monkeypatch.undo()
    other = BPETokenizer.train(awkward_text(seed=5), 280)  # another tokenizer: encoded anew
    assert prepare_data(cfg, tokenizer=other).folder != first.folder


def test_batches_from_a_memmap_equal_those_from_a_tensor(tmp_path):
    (tmp_path / "c.txt").write_text(awkward_text())
    ds = prepare_data(DataConfig(dataset="text", path=str(tmp_path / "c.txt")))
    mm = ds.splits["train"]
    t = torch.from_numpy(np.asarray(mm, dtype=np.int64))
    a, b = BatchSampler(mm, 4, 16, seed=1), BatchSampler(t, 4, 16, seed=1)
    for _ in range(3):
        for x, y in zip(a.next(), b.next()):
            assert x.dtype == y.dtype == torch.int64 and torch.equal(x, y)
    for (x1, y1), (x2, y2) in zip(eval_batches(mm, 7, 3), eval_batches(t, 7, 3)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_a_vocabulary_over_65536_uses_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    (tmp_path / "c.txt").write_text("\n".join(" ".join(words[i:i + 10])
                                              for i in range(0, 70_000, 10)) + "\n")
    r = run_cli("prepare", "--input", tmp_path / "c.txt", "--tokenizer", "word",
                "--vocab-source", "all", "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    p = Prepared(tmp_path / "out")
    assert p.meta["dtype"] == "uint32" and p.tokenizer.vocab_size == 70_002
    assert p.splits["val"].dtype == np.uint32 and int(np.max(p.splits["val"])) > 65_535
    assert p.tokenizer.decode(p.splits["train"][:3].tolist()) == "w0 w1 w2 "
    x, _ = BatchSampler(p.splits["val"], 2, 8, seed=0).next()
    assert int(x.max()) > 65_535
    r = run_cli("prepare", "--input", tmp_path / "c.txt", "--tokenizer", "word", "--dtype",
                "uint16", "--vocab-source", "all", "--out", tmp_path / "o16")
    assert r.returncode == 2 and "--dtype uint32" in r.stderr
    assert not (tmp_path / "o16" / "meta.json").exists()


def tiny_run(prepared: Path, out: Path, *extra) -> list[str]:
    return ["train", "--out", out, "--quiet", "--set", "data.dataset=prepared",
            "--set", f"data.path={prepared}", "--set", "model.hidden_size=16",
            "--set", "model.num_heads=2", "--set", "model.num_layers=1",
            "--set", "train.batch_size=2", "--set", "train.seq_len=8",
            "--set", "train.max_steps=6", "--set", "train.eval_interval=3",
            "--set", "train.eval_iters=1", "--set", "train.checkpoint_interval=3",
            "--set", "train.log_interval=1", "--set", "train.device=cpu", *extra]


def test_prepare_train_resume_eval(tmp_path):
    src = write_source("jsonl", tmp_path / "src", docs=[awkward_text(60, seed=i) for i in range(6)])
    prep = tmp_path / "prep"
    r = run_cli("prepare", "--input", src, "--tokenizer", "bpe", "--vocab-size", "300",
                "--test-fraction", "0.1", "--out", prep)
    assert r.returncode == 0, r.stderr
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli(*tiny_run(prep, full)).returncode == 0
    assert run_cli(*tiny_run(prep, cut, "--set", "train.max_steps=3")).returncode == 0
    r = run_cli("train", "--out", cut, "--resume", "--quiet", "--set", "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    from continuumlm.train.logging import read_metrics

    def losses(run):
        return {e["step"]: e["loss"] for e in read_metrics(run) if "loss" in e}

    assert losses(full) == losses(cut)
    r = run_cli("eval", "--checkpoint", cut, "--split", "test", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["results"][0]["tokens"] > 0
    # the folder prepared again from other text: the run refuses to resume on it
    other = write_source("text", tmp_path / "other", docs=[awkward_text(300, seed=9)])
    r = run_cli("prepare", "--input", other, "--tokenizer", "bpe", "--vocab-size", "300",
                "--test-fraction", "0.1", "--out", prep, "--force")
    assert r.returncode == 0, r.stderr
    r = run_cli("train", "--out", cut, "--resume", "--quiet", "--set", "train.max_steps=9")
    assert r.returncode == 2 and "another tokenizer" in r.stderr


def test_resume_refuses_a_prepared_folder_with_other_text(tmp_path):
    docs = [awkward_text(80, seed=i) for i in range(3)]
    src = write_source("jsonl", tmp_path / "src", docs=docs)
    prep = tmp_path / "prep"
    assert run_cli("prepare", "--input", src, "--tokenizer", "char", "--vocab-source", "all",
                   "--out", prep).returncode == 0
    run = tmp_path / "run"
    assert run_cli(*tiny_run(prep, run, "--set", "train.max_steps=3")).returncode == 0
    tok_json = (prep / "tokenizer.json").read_text()
    # same tokenizer, other text
    src2 = write_source("jsonl", tmp_path / "src2", docs=[d[::-1] for d in docs])
    assert run_cli("prepare", "--input", src2, "--tokenizer", prep / "tokenizer.json",
                   "--out", tmp_path / "prep2").returncode == 0
    assert (tmp_path / "prep2" / "tokenizer.json").read_text() == tok_json
    for name in ("meta.json", "train.bin", "val.bin"):
        os.replace(tmp_path / "prep2" / name, prep / name)
    r = run_cli("train", "--out", run, "--resume", "--quiet", "--set", "train.max_steps=6")
    assert r.returncode == 2 and "differs from the one" in r.stderr


def test_rerunning_prepare(tmp_path):
    src = write_source("text", tmp_path / "src")
    out = tmp_path / "out"
    args = ["prepare", "--input", src, "--tokenizer", "char", "--val-fraction", "0.3",
            "--out", out]
    assert run_cli(*args).returncode == 0
    r = run_cli(*args)
    assert r.returncode == 0 and "nothing to do" in r.stdout
    r = run_cli(*args[:-3], "0.4", "--out", out)
    assert r.returncode == 2 and "--force" in r.stderr
    assert read_meta(out)["split_rule"]["train_fraction"] == pytest.approx(0.7)  # kept
    # --force from an input that cannot be read: refused, and the corpus there is kept whole
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    r = run_cli("prepare", "--input", bad, "--tokenizer", "char", "--out", out, "--force")
    assert r.returncode == 2, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".out.prepare-*"))  # nothing left beside it
    r = run_cli(*args[:-3], "0.4", "--out", out, "--force")  # a good one replaces it
    assert r.returncode == 0, r.stderr
    assert read_meta(out)["split_rule"]["train_fraction"] == pytest.approx(0.6)
    (out / "notes.txt").write_text("mine")
    os.remove(out / "meta.json")
    r = run_cli(*args)
    assert r.returncode == 2 and "notes.txt" in r.stderr and (out / "notes.txt").is_file()


KILLER = """
import sys, time
from continuumlm.data import prepare as P
real = P._Encoder._encode
def slow(self, text):
    out = real(self, text)
    sys.stdout.write("chunk\\n"); sys.stdout.flush()
    time.sleep(0.5)
    return out
P._Encoder._encode = slow
from continuumlm.data import encode as E
E.CHUNK_CHARS = 2000
from continuumlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_prepare_leaves_nothing_that_loads(tmp_path):
    (tmp_path / "c.txt").write_text(awkward_text(600))
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", KILLER, "prepare", "--input", str(tmp_path / "c.txt"),
           "--tokenizer", "char", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.stdout.readline() == "chunk\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "train.bin.part").is_file() and not (out / "meta.json").exists()
    with pytest.raises(DataError, match="unfinished"):
        Prepared(out)
    r = run_cli("eval", "--checkpoint", tmp_path / "none")  # unrelated: just a usage error
    assert r.returncode == 2
    r = run_cli(*cmd[3:])  # the rerun starts over
    assert r.returncode == 0, r.stderr
    assert not list(out.glob("*.part"))
    p = Prepared(out)
    with open(tmp_path / "c.txt", encoding="utf-8", newline="") as f:  # keep its \r\n
        text = f.read()
    assert p.tokenizer.decode(np.asarray(p.splits["train"])) == text[:p.meta["splits"]["train"]["chars"]]


def test_a_full_disk_during_prepare_is_a_disk_error(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text(awkward_text())
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    def full_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if str(path).endswith(".bin.part") else f

    monkeypatch.setattr(E, "open", full_open, raising=False)  # where the splits are written
    r = run_cli("prepare", "--input", tmp_path / "c.txt", "--tokenizer", "char",
                "--out", tmp_path / "out")
    assert r.returncode == 74 and "No space left" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def _nonutf8(d: Path):
    (d / "bad.txt").write_bytes(b"good text\n" * 10 + b"\xff\xfe oops")
    return ["--input", d / "bad.txt"], "bad.txt is not valid UTF-8: byte 0xff at byte offset 100"


def _binary(d: Path):
    (d / "a.bin").write_bytes(b"ELF\0\1\2")
    return ["--input", d / "a.bin"], "NUL byte at byte offset 3"


def _empty(d: Path):
    (d / "e.txt").write_text("")
    return ["--input", d / "e.txt"], "the corpus is empty"


def _no_match(d: Path):
    return ["--input", str(d / "*.nothing")], "matches no file"


def _no_field(d: Path):
    (d / "c.jsonl").write_text(json.dumps({"body": "x", "id": 1}) + "\n")
    return ["--input", d / "c.jsonl"], "no 'text' field (it has 'body', 'id')"


def _no_column(d: Path):
    src = write_source("parquet", d / "pq", field="content")
    return ["--input", src], "no 'text' column (it has 'id', 'content')"


@pytest.mark.parametrize("case", [_nonutf8, _binary, _empty, _no_match, _no_field, _no_column])
def test_bad_sources_exit_2(case, tmp_path):
    args, needle = case(tmp_path)
    r = run_cli("prepare", *args, "--tokenizer", "char", "--out", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.parametrize("damage, needle", [
    (lambda out: _edit_meta(out, version=99), "another version"),
    (lambda out: (out / "val.bin").write_bytes((out / "val.bin").read_bytes()[:-2]),
     "val.bin has"),
    (lambda out: (out / "meta.json").unlink(), "no meta.json"),
])
def test_a_damaged_prepared_folder_is_refused(damage, needle, tmp_path):
    src = write_source("text", tmp_path / "src")
    out = tmp_path / "out"
    assert run_cli("prepare", "--input", src, "--tokenizer", "char", "--val-fraction", "0.3",
                   "--out", out).returncode == 0
    damage(out)
    r = run_cli(*tiny_run(out, tmp_path / "run"))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def _edit_meta(out: Path, **kw):
    meta = json.loads((out / "meta.json").read_text())
    meta.update(kw)
    (out / "meta.json").write_text(json.dumps(meta))


def test_prepare_a_config_into_the_cache_that_train_reads(tmp_path, tiny_corpus, monkeypatch):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\ndataset = "text"\npath = "{tiny_corpus}"\ntokenizer = "word"\n')
    r = run_cli("prepare", "--config", cfg)
    assert r.returncode == 0, r.stderr
    folder = Path(r.stdout.split("prepared ")[1].split(":")[0])
    from continuumlm.config import load_config

    monkeypatch.setattr(P, "encode_splits", lambda *a, **k: pytest.fail("encoded again"))
    assert prepare_data(load_config(str(cfg)).data).folder == folder


CONCURRENT = """
import sys
from continuumlm.config import DataConfig
from continuumlm.data import prepare_data
ds = prepare_data(DataConfig(dataset="text", path=sys.argv[1], tokenizer="bpe", vocab_size=300),
                  quiet=False)
print(ds.folder, len(ds.splits["train"]))
"""


def test_processes_preparing_one_corpus_take_turns(tmp_path):
    """The ranks of a job start together: one prepares the corpus, the others wait for it and
    open the same folder."""
    (tmp_path / "c.txt").write_text(awkward_text(4000))
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", CONCURRENT, str(tmp_path / "c.txt")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("encoded" in err for _, err in outs) == 1
    assert outs[0][0] == outs[1][0]
    folder = Path(outs[0][0].split()[0])
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]


def test_review_refusals(tmp_path):
    """A tokenizer whose encoding depends on where text is cut, an --out inside the inputs,
    another tool's token files, --dtype in the cache."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = write_source("text", tmp_path / "src")
    meta_tok = Tokenizer(models.BPE())
    meta_tok.pre_tokenizer = pre_tokenizers.Metaspace()
    meta_tok.save(str(tmp_path / "sp.json"))
    r = run_cli("prepare", "--input", src, "--tokenizer", tmp_path / "sp.json",
                "--out", tmp_path / "o1")
    assert r.returncode == 2 and "pre-tokenizer (Metaspace)" in r.stderr
    r = run_cli("prepare", "--input", tmp_path / "src", "--tokenizer", "char",
                "--out", tmp_path / "src" / "prepared")
    assert r.returncode == 2 and "inside the input folder" in r.stderr
    # a byte-level BPE whose added <|endoftext|> sits past the vocabulary (id 300 of 257):
    # its ids were written, and training then failed on an embedding lookup
    from tokenizers import AddedToken, decoders

    from continuumlm.data.tiktoken_bpe import byte_alphabet

    vocab = {ch: b for b, ch in byte_alphabet().items()}
    vocab["<|endoftext|>"] = 300
    gap = Tokenizer(models.BPE(vocab, []))
    gap.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gap.decoder = decoders.ByteLevel()
    gap.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    gap.save(str(tmp_path / "gap.json"))
    r = run_cli("prepare", "--input", src, "--tokenizer", tmp_path / "gap.json",
                "--out", tmp_path / "o2")
    assert r.returncode == 2 and "from 0 to 300, not 0 to 256" in r.stderr, r.stderr
    assert not (tmp_path / "o2" / "meta.json").exists()
    theirs = tmp_path / "nanogpt"
    theirs.mkdir()
    (theirs / "train.bin").write_bytes(b"\0\1" * 10)
    r = run_cli("prepare", "--input", src, "--tokenizer", "char", "--out", theirs)
    assert r.returncode == 2 and "another tool's" in r.stderr
    assert (theirs / "train.bin").read_bytes() == b"\0\1" * 10  # kept
    out = tmp_path / "o2"
    assert run_cli("prepare", "--input", src, "--tokenizer", "char", "--out", out).returncode == 0
    r = run_cli("prepare", "--input", src, "--tokenizer", "char", "--dtype", "uint32",
                "--out", out)
    assert r.returncode == 2 and "--force" in r.stderr  # another preparation, not "nothing to do"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\ndataset = "text"\npath = "{src}"\n')
    r = run_cli("prepare", "--config", cfg, "--dtype", "uint32")
    assert r.returncode == 2 and "apply to --out" in r.stderr
