"""Training on a shared cluster: one command for a job's first start and every requeue
(--resume auto), a scheduler's warning signal turned into a checkpoint and exit status 75,
time-based checkpoints, and full disks reported in one paragraph with exit status 74."""

from __future__ import annotations

import errno
import signal
import subprocess
import time

import pytest

from conftest import run_cli
from continuumlm import ConfigError, load_config
from continuumlm.errors import DISK_STATUS, REQUEUE_STATUS
from continuumlm.runs.checkpoint import load_model_and_tokenizer, verify_checkpoint
from continuumlm.train import Trainer
from test_reliability import (  # noqa: F401 - reference: a fixture
    CLI,
    _wait_for,
    losses,
    reference,
    signal_during_training,
    write_cfg,
)


def _steps(out):
    return sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))


# ------------------------------------------------------------------ --resume auto

def test_resume_auto_starts_an_empty_folder_and_continues_one_with_checkpoints(tiny_corpus,
                                                                               tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=6, ckpt=3)
    out = tmp_path / "run"
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto", "--quiet")
    assert r.returncode == 0, r.stderr
    assert _steps(out) == [3, 6]
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto", "--set",
                "train.max_steps=9")
    assert r.returncode == 0, r.stderr
    assert "resuming at step 6" in r.stdout and 9 in _steps(out)
    # and without --config: the run's own settings
    r = run_cli("train", "--out", out, "--resume", "auto", "--set", "train.max_steps=10")
    assert r.returncode == 0 and "resuming at step 9" in r.stdout, r.stderr


def test_resume_auto_restarts_its_own_run_that_died_before_its_first_checkpoint(tiny_corpus,
                                                                               tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=4, ckpt=100)
    out = tmp_path / "run"
    Trainer(load_config(cfg), out, quiet=True)  # writes config.toml and metrics.jsonl, then dies
    assert (out / "config.toml").is_file() and not _steps(out)
    r = run_cli("train", "--config", cfg, "--out", out, "--resume")
    assert r.returncode == 2 and "nothing to resume" in r.stderr  # plain --resume refuses
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "starting the run again" in r.stdout and _steps(out) == [4]


def test_resume_auto_restarts_a_run_killed_during_its_first_save(tiny_corpus, tmp_path,
                                                                 monkeypatch):
    """The step of the first save is logged before that save runs: a run killed there has
    no checkpoint and was neither resumable nor cleared (every requeue failed, status 2)."""
    import continuumlm.train.checkpointer as ck
    from continuumlm.train.logging import read_metrics

    cfg = write_cfg(tmp_path, tiny_corpus, steps=6, ckpt=3)
    out = tmp_path / "run"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies inside its first save

    with monkeypatch.context() as m:
        m.setattr(ck.Checkpointer, "save", killed)
        with pytest.raises(KeyboardInterrupt):
            Trainer(load_config(cfg), out, quiet=True).run()
    assert max(e["step"] for e in read_metrics(out)) == 3 and not _steps(out)
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert "starting the run again" in r.stdout and _steps(out)[-1] == 6


def test_resume_auto_refuses_another_runs_folder(tiny_corpus, tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=4)
    out = tmp_path / "run"
    Trainer(load_config(cfg, ["model.hidden_size=16"]), out, quiet=True)  # another run's files
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 2 and "already holds config.toml" in r.stderr, r.stderr
    assert (out / "config.toml").is_file()  # nothing of it was removed
    empty = tmp_path / "empty"
    r = run_cli("train", "--out", empty, "--resume", "auto")
    assert r.returncode == 2 and "no --config to start the run from" in r.stderr
    r = run_cli("train", "--config", cfg, "--out", empty, "--resume", "always")
    assert r.returncode == 2 and "--resume takes no value or 'auto'" in r.stderr


# ------------------------------------------------------------------ scheduler signals

@pytest.mark.slow
def test_sigusr1_saves_exits_75_and_resume_auto_reproduces_the_run(reference, tmp_path):  # noqa: F811
    cfg, ref = reference
    out = tmp_path / "usr1"
    returncode, stdout, stderr = signal_during_training(cfg, out, signal.SIGUSR1)
    assert returncode == REQUEUE_STATUS, stderr
    assert "stopped by SIGUSR1" in stdout and "--resume auto" in stdout
    saved = int((out / "checkpoints" / "last").resolve().name.split("-")[1])
    assert saved >= 7
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 0, r.stderr
    assert losses(out) == ref  # every step once, bit-identical to the uninterrupted run


def test_requeue_signals_are_configurable(tiny_corpus, tmp_path):
    with pytest.raises(ConfigError, match="may list SIGUSR1 and SIGUSR2"):
        load_config(None, ["train.requeue_signals=['SIGKILL']"])
    assert load_config(None, ["train.requeue_signals=[]"]).train.requeue_signals == []


@pytest.mark.slow  # two processes, twice
def test_sigusr1_under_two_processes_saves_and_exits_75(tiny_corpus, tmp_path):
    """The launcher (--nproc) passes the scheduler's signal on to the ranks; they agree, save
    after the current step and all exit 75, which the launcher reports."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "two"
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), "--nproc", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "metrics.jsonl", timeout=180)
    while len(losses(out)) < 3:
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    stdout, stderr = p.communicate(timeout=180)
    assert p.returncode == REQUEUE_STATUS, stdout[-2000:] + stderr[-2000:]
    last = (out / "checkpoints" / "last").resolve()
    verify_checkpoint(last)
    saved = int(last.name.split("-")[1])
    assert saved >= 3
    # the requeued job: the same command with --resume auto, to a few steps further; it
    # continues the losses an uninterrupted two-process run gives
    end = saved + 4
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(out), "--nproc", "2",
                        "--resume", "auto", "--set", f"train.max_steps={end}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    ref = tmp_path / "ref"
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(ref), "--nproc", "2",
                        "--set", f"train.max_steps={end}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6, abs=0)


# ------------------------------------------------------------------ time-based checkpoints

def test_checkpoint_minutes_saves_by_wall_time(tiny_corpus, tmp_path, monkeypatch):
    import continuumlm.train.checkpointer as C

    clock = [0.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: clock[0])
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=12, ckpt=1000),
                      ["train.checkpoint_minutes=1", "train.eval_interval=1000"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    real = trainer.train_step

    def step():  # each step takes 25 s on this clock: a save is due every third step
        clock[0] += 25
        return real()

    trainer.train_step = step
    trainer.run()
    # saved at 3, 6, 9 (75 s after the last save each time) and at the end; 3 kept
    assert _steps(tmp_path / "run") == [6, 9, 12]


# ------------------------------------------------------------------ full disks

def _enospc():
    return OSError(errno.ENOSPC, "No space left on device")


def _assert_disk_failure(r, out, what):
    assert r.returncode == DISK_STATUS, r.stderr
    assert "Traceback" not in r.stderr and what in r.stderr, r.stderr
    assert ("No space left on device" in r.stderr or "needed" in r.stderr) and \
        "--resume auto" in r.stderr
    last = out / "checkpoints" / "last"
    if last.exists():  # whatever last points at is complete and loads
        verify_checkpoint(last.resolve())
        load_model_and_tokenizer(out, "last")


def test_a_full_disk_while_saving_safetensors_is_one_paragraph(tiny_corpus, tmp_path,
                                                              monkeypatch):
    import safetensors.torch as st
    from safetensors import SafetensorError

    calls = {"n": 0}
    real = st.save_model

    def full(*a, **kw):
        calls["n"] += 1
        if calls["n"] >= 2:  # safetensors reports the OS error in its own exception type
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                                     "StorageFull, message: \"No space left on device\" })")
        return real(*a, **kw)

    monkeypatch.setattr(st, "save_model", full)
    out = tmp_path / "run"
    r = run_cli("train", "--config", write_cfg(tmp_path, tiny_corpus, steps=20, ckpt=5),
                "--out", out)
    _assert_disk_failure(r, out, "could not write the checkpoint of step 10")
    assert (out / "checkpoints" / "last").resolve().name == "step-00000005"
    assert "step-00000005, is intact" in r.stderr
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the half-written folder is gone


def test_too_little_free_space_refuses_a_save_before_writing(tiny_corpus, tmp_path,
                                                             monkeypatch):
    import collections

    import continuumlm.train.checkpointer as C

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    out = tmp_path / "run"
    r = run_cli("train", "--config", write_cfg(tmp_path, tiny_corpus, steps=10, ckpt=5),
                "--out", out)
    _assert_disk_failure(r, out, "could not write the checkpoint of step 5")
    assert "needs about" in r.stderr and "free" in r.stderr and not _steps(out)
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("site", ["metrics", "tensorboard"])
def test_a_full_disk_while_logging_is_one_paragraph(tiny_corpus, tmp_path, monkeypatch, site):
    import continuumlm.train.logging as L

    real_init = L.MetricsLogger.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        if site == "metrics":
            real_write, n = self.file.write, {"n": 0}

            class Full:
                def __getattr__(self_, name):
                    return getattr(real_write.__self__, name)

                def write(self_, text):
                    n["n"] += 1
                    if n["n"] > 8:
                        raise _enospc()
                    return real_write(text)

            self.file = Full()
        elif self.tb is not None:
            def add_scalar(*a, **kw):
                raise _enospc()
            self.tb.add_scalar = add_scalar

    monkeypatch.setattr(L.MetricsLogger, "__init__", init)
    out = tmp_path / "run"
    r = run_cli("train", "--config", write_cfg(tmp_path, tiny_corpus, steps=20, ckpt=5),
                "--out", out)
    _assert_disk_failure(r, out, "metrics.jsonl" if site == "metrics" else "TensorBoard events")


def test_a_full_disk_while_torch_saves_the_trainer_state_is_one_paragraph(tiny_corpus, tmp_path,
                                                                          monkeypatch):
    """torch.save reports a short write as a RuntimeError (seen on a full tmpfs): the
    optimizer state, most of a checkpoint, is written by it."""
    import continuumlm.runs.checkpoint as ck

    real, calls = ck.torch.save, {"n": 0}

    def full(*a, **kw):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 "
                               "vs 598")
        return real(*a, **kw)

    monkeypatch.setattr(ck.torch, "save", full)
    out = tmp_path / "run"
    r = run_cli("train", "--config", write_cfg(tmp_path, tiny_corpus, steps=20, ckpt=5),
                "--out", out)
    assert r.returncode == DISK_STATUS and "unexpected pos" in r.stderr, r.stderr
    assert (out / "checkpoints" / "last").resolve().name == "step-00000005"


def test_resume_auto_keeps_the_files_of_a_run_that_got_past_its_first_save(tiny_corpus,
                                                                          tmp_path):
    """A run of the same config whose checkpoints were removed (after an export, say) is not
    a run that died before its first checkpoint: its metrics stay, the trainer refuses."""
    import shutil

    cfg = write_cfg(tmp_path, tiny_corpus, steps=6, ckpt=3)
    out = tmp_path / "run"
    assert run_cli("train", "--config", cfg, "--out", out, "--quiet").returncode == 0
    shutil.rmtree(out / "checkpoints")
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 2 and "already holds" in r.stderr, r.stderr
    assert (out / "metrics.jsonl").is_file() and (out / "config.toml").is_file()
    # a dangling `last` counts as checkpoints: resuming says what is wrong, nothing is cleared
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "last").symlink_to("step-00000003")
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto")
    assert r.returncode == 2 and (out / "metrics.jsonl").is_file(), r.stderr


@pytest.mark.slow  # two processes
def test_a_full_disk_under_two_processes_stops_every_rank_with_74(tiny_corpus, tmp_path):
    """Rank 0 alone writes; the others must learn of its failure (not wait for it in a
    collective) so that the launcher reports 74. The disk is made full in the ranks by a
    plugin module that fakes the free space."""
    import os

    (tmp_path / "fulldisk.py").write_text(
        "import collections\n"
        "import continuumlm.train.checkpointer as C\n"
        "usage = collections.namedtuple('usage', 'total used free')\n"
        "C.shutil.disk_usage = lambda p: usage(10**9, 10**9 - 1000, 1000)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = tmp_path / "run"
    r = subprocess.run([CLI, "train", "--config",
                        str(write_cfg(tmp_path, tiny_corpus, steps=10, ckpt=5)), "--out",
                        str(out), "--nproc", "2", "--plugin", "fulldisk"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == DISK_STATUS, r.stdout[-2000:] + r.stderr[-2000:]
    assert "could not write the checkpoint of step 5" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_full_disk_when_a_resumed_run_rewrites_its_metrics_is_one_paragraph(tiny_corpus,
                                                                             tmp_path,
                                                                             monkeypatch):
    """A requeued job on a full disk meets it first where the resume trims metrics.jsonl."""
    import continuumlm.train.logging as L

    cfg = write_cfg(tmp_path, tiny_corpus, steps=6, ckpt=3)
    out = tmp_path / "run"
    assert run_cli("train", "--config", cfg, "--out", out, "--quiet").returncode == 0

    def full(self, step):
        raise _enospc()

    monkeypatch.setattr(L.MetricsLogger, "_truncate", full)
    r = run_cli("train", "--config", cfg, "--out", out, "--resume", "auto", "--set",
                "train.max_steps=8")
    _assert_disk_failure(r, out, "could not write metrics.jsonl")
