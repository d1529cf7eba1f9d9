import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch

from continuumlm import LanguageModel, ModelConfig
from continuumlm.testing import check_cached_decoding

# The suite's models are small: one intra-op thread is about as fast as two on a quiet
# machine, and on one shared with other jobs two threads spin at torch's barriers (make test
# ran 8x slower; bench/threads.py --suite). The environment variable reaches the commands the
# tests start in processes of their own. $CONTINUUMLM_TEST_THREADS sets another count.
TEST_THREADS = int(os.environ.get("CONTINUUMLM_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(TEST_THREADS)
torch.set_num_threads(TEST_THREADS)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own user cache, so nothing leaks between tests or into ~/.cache;
    and torch's oneDNN switch back as it was (the command line's generate and serve, run in
    this process by run_cli, set it for the process)."""
    monkeypatch.setenv("CONTINUUMLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    torch.manual_seed(0)
    onednn = torch.backends.mkldnn.enabled
    yield
    torch.backends.mkldnn.enabled = onednn


@pytest.fixture
def data_dir(monkeypatch) -> Path:
    env = os.environ.get("CONTINUUMLM_DATA")
    d = Path(env) if env else SHARED_DATA
    if not (d / "tinyshakespeare.txt").is_file():
        pytest.skip("corpora not available; set CONTINUUMLM_DATA")
    # what the test runs (a config naming a corpus) finds them where this fixture did
    monkeypatch.setenv("CONTINUUMLM_DATA", str(d))
    return d


def write_tiny_corpus(p: Path) -> Path:
    """A small generated text corpus at ``p``: deterministic, a few thousand characters."""
    words = ["alpha", "beta", "gamma", "delta", "the", "cat", "sat", "on", "a", "mat"]
    g = torch.Generator().manual_seed(1)
    lines = []
    for _ in range(200):
        n = int(torch.randint(3, 9, (1,), generator=g))
        lines.append(" ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g)))
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture
def tiny_corpus(tmp_path) -> Path:
    return write_tiny_corpus(tmp_path / "tiny.txt")


def small_config(**kw) -> ModelConfig:
    base = dict(vocab_size=37, hidden_size=32, num_heads=4, num_layers=2, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)


def small_model(**kw) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(small_config(**kw)).eval()


# the check a plugin author runs too (continuumlm.testing)
assert_cached_decoding_exact = check_cached_decoding


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` run only where a CUDA device exists (bench/gpu_check.sh runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def run_cli(*args, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``continuumlm ARGS`` run in this process, as ``subprocess.run(..., capture_output=True,
    text=True)`` would report it (exit status, stdout, stderr), without an interpreter start-up
    and torch import (3-6 s on a 2-core machine) per call. An uncaught exception propagates and
    fails the test, as a traceback would. The console entry point itself, signals and
    multi-process runs are tested through real subprocesses."""
    from continuumlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors; sys.exit("message")
                if isinstance(e.code, str):
                    print(e.code, file=err)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["continuumlm", *map(str, args)], code, out.getvalue(),
                                       err.getvalue())


def train_tiny(corpus: Path, out: Path, *settings: str) -> Path:
    """Two training steps of a one-layer, 32-wide model on ``corpus`` into ``out``, with
    ``settings`` ("section.key=value") on top: a run folder for CLI tests."""
    from continuumlm.config import load_config
    from continuumlm.train import Trainer

    cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"',
                             "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
                             "model.ode_steps=3", "train.batch_size=2", "train.seq_len=16",
                             "train.max_steps=2", "train.eval_interval=2", "train.eval_iters=1",
                             "train.device=cpu", *settings])
    Trainer(cfg, out, quiet=True).run()
    return out
