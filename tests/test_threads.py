"""The thread policy (continuumlm.threads): what it decides from a measured machine, that a
user's count is kept, and that generation and training apply it and put back what they found."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import run_cli, small_model
from continuumlm import threads as T
from continuumlm.errors import ConfigError


@pytest.fixture
def policy_free(monkeypatch):
    """No user's count in force: no environment variable, torch's count taken as its own."""
    for name in T.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    found = torch.get_num_threads()
    monkeypatch.setitem(T._counts, "at_import", found)
    monkeypatch.delitem(T._counts, "applied", raising=False)
    yield
    torch.set_num_threads(found)


class FakeIdle:
    """/proc/stat's idle seconds of a machine with ``cores`` cores of which ``busy`` are kept
    busy by other processes (the test process itself uses next to nothing while it sleeps)."""

    def __init__(self, cores: int, busy: float):
        self.cores, self.busy = cores, busy
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return (time.monotonic() - self.t0) * (self.cores - self.busy)


@pytest.mark.parametrize("text,want", [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (1, 1)])
def test_parse_threads(text, want):
    assert T.parse_threads(text) == want


@pytest.mark.parametrize("bad", [0, -1, "0", "two", "", 1.5, True, None])
def test_parse_threads_refuses(bad):
    with pytest.raises(ConfigError, match="'auto'.*positive number"):
        T.parse_threads(bad, "train.threads")


@pytest.mark.parametrize("available,cores,want", [
    (2.0, 2, 2), (1.9, 2, 2), (1.76, 2, 2),   # background noise below a quarter core
    (1.7, 2, 1), (1.33, 2, 1), (0.6, 2, 1), (0.0, 2, 1),  # one busy process takes a core
    (12.5, 16, 12), (16.0, 16, 16), (40.0, 16, 16)])
def test_threads_for(available, cores, want):
    assert T.threads_for(available, cores) == want


def test_available_cores_counts_idle_and_own_time():
    a = T.CpuSample(idle_s=100.0, own_s=5.0, wall_s=10.0)
    b = T.CpuSample(idle_s=100.5, own_s=6.0, wall_s=11.0)  # half a core idle, one ours
    assert T.available_cores(a, b) == pytest.approx(1.5)
    assert T.available_cores(T.CpuSample(None, 0, 0), b) is None


@pytest.mark.parametrize("busy,want", [(0.0, 2), (0.1, 2), (1.0, 1), (1.4, 1), (2.0, 1)])
def test_auto_follows_the_measured_machine(policy_free, busy, want):
    p = T.ThreadPolicy("auto", read_idle=FakeIdle(2, busy), cores=2)
    choice = p.apply()
    assert choice.threads == want and torch.get_num_threads() == want
    assert ("quiet" in choice.reason) == (want == 2)


def test_unknown_load_keeps_every_core(policy_free):
    choice = T.ThreadPolicy("auto", read_idle=lambda: None, cores=3).apply()
    assert choice.threads == 3 and "load unknown" in choice.reason


def test_poll_looks_again_and_changes_the_count(policy_free):
    idle = FakeIdle(2, 0.0)
    p = T.ThreadPolicy("auto", read_idle=idle, cores=2, interval_s=0.05)
    assert p.apply().threads == 2
    idle.busy = 1.5  # another job starts
    time.sleep(0.06)
    p.poll()
    assert (p.choice.threads, torch.get_num_threads(), p.changes) == (1, 1, 1)
    idle.busy = 0.0  # ... and ends
    time.sleep(0.06)
    p.poll()
    assert (p.choice.threads, torch.get_num_threads(), p.changes) == (2, 2, 2)


def test_poll_is_a_clock_read_between_looks(policy_free):
    calls = []

    def read():
        calls.append(1)
        return 0.0

    p = T.ThreadPolicy("auto", read_idle=read, cores=2, interval_s=60)
    p.apply()
    n = len(calls)
    for _ in range(1000):
        p.poll()
    assert len(calls) == n


def test_a_fixed_count_is_applied_and_restored(policy_free):
    found = torch.get_num_threads()
    p = T.ThreadPolicy(1, read_idle=FakeIdle(2, 0.0), cores=2)
    assert str(p.apply()) == "1 thread (as set)"
    assert torch.get_num_threads() == 1
    p.restore()
    assert torch.get_num_threads() == found


def test_the_environment_is_kept_under_auto(policy_free, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)  # what torch made of it at start-up
    choice = T.ThreadPolicy("auto", read_idle=FakeIdle(2, 0.0), cores=2).apply()
    assert (choice.threads, choice.reason) == (1, "OMP_NUM_THREADS=1")


def test_a_users_set_num_threads_is_kept_under_auto(policy_free):
    n = 3 if torch.get_num_threads() != 3 else 2
    torch.set_num_threads(n)
    choice = T.ThreadPolicy("auto", read_idle=FakeIdle(2, 0.0), cores=2).apply()
    assert choice.threads == n and "set_num_threads" in choice.reason
    # the policy's own earlier setting is not taken for the user's
    T._set(1)
    assert T.ThreadPolicy("auto", read_idle=FakeIdle(2, 0.0), cores=2).apply().threads == 2


def test_generate_applies_threads_and_puts_back_what_it_found(policy_free):
    model = small_model()
    torch.set_num_threads(2)
    T._counts["applied"] = 2  # as if the policy had set it: auto may change it
    seen = []
    stream = model.generate_stream(torch.tensor([[1, 2, 3]]), 4, greedy=True, threads=1)
    for _ in stream:
        seen.append(torch.get_num_threads())
    assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2
    # None (the library's default) leaves the count alone
    model.generate(torch.tensor([[1, 2, 3]]), 3, greedy=True)
    assert torch.get_num_threads() == 2
    with pytest.raises(ConfigError, match="positive number"):
        model.generate(torch.tensor([[1]]), 2, threads=0)


def test_auto_sees_real_busy_processes(policy_free):
    """Measured, not faked: with as many busy processes as this process's cores, auto leaves
    one thread."""
    cores = T.usable_cores()
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        p = T.ThreadPolicy("auto")
        time.sleep(0.5)
        choice = p.apply()
    finally:
        for s in spin:
            s.kill()
            s.wait()
    assert choice.threads == 1, choice


def test_cli_threads_flag(tmp_path, tiny_corpus):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nhidden_size = 16\nnum_heads = 2\nnum_layers = 1\n'
                   f'max_seq_len = 16\n[data]\ndataset = "text"\npath = "{tiny_corpus}"\n'
                   f'[train]\nmax_steps = 3\nbatch_size = 2\nseq_len = 8\n'
                   f'eval_interval = 3\neval_iters = 1\nlog_interval = 1\nwarmup_steps = 1\n'
                   f'device = "cpu"\n')
    r = run_cli("train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "1 thread (as set)" in r.stdout
    # not a terminal: progress comes as lines (the last step always has one)
    assert "step 3/3: loss" in r.stdout and "tokens/s, 1 thread, 0 s left" in r.stdout
    assert 'threads = 1' in (tmp_path / "run" / "config.toml").read_text()
    r = run_cli("eval", "--checkpoint", str(tmp_path / "run"), "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "1 discrete layer; 1 thread (as set)" in r.stdout
    r = run_cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "the",
                "--max-new-tokens", "4", "--threads", "1")
    timing = next(line for line in r.stderr.splitlines() if line.startswith("generated"))
    assert r.returncode == 0, r.stderr
    assert timing.endswith("; 1 thread (as set); torch's own CPU kernels (oneDNN off)"), timing
    for bad in ("0", "many"):
        r = run_cli("generate", "--checkpoint", str(tmp_path / "run"), "--threads", bad)
        assert r.returncode == 2 and "--threads" in r.stderr and "positive number" in r.stderr
    r = run_cli("train", "--config", str(cfg), "--out", str(tmp_path / "run2"),
                "--set", "train.threads=-2")
    assert r.returncode == 2 and "train.threads = -2" in r.stderr


def test_the_test_suite_runs_on_its_threads():
    """conftest.py: one thread unless $CONTINUUMLM_TEST_THREADS says otherwise (under load,
    the suite's small models on two threads ran 8x slower)."""
    want = int(os.environ.get("CONTINUUMLM_TEST_THREADS", "1"))
    assert torch.get_num_threads() == want and os.environ.get("OMP_NUM_THREADS") == str(want)
