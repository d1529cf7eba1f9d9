"""Faults inflicted on purpose: kills, signals, corrupt checkpoints, NaNs, full disks, bad input."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import run_cli, write_tiny_corpus
from continuumlm import CheckpointError, load_config
from continuumlm.errors import TrainingError
from continuumlm.train import Trainer
from continuumlm.train.logging import read_metrics

CLI = str(Path(sys.executable).parent / "continuumlm")


def write_cfg(tmp_path, corpus, steps=40, ckpt=5, **extra):
    # lr_decay_steps is fixed so that a run started with a larger max_steps (to be killed
    # mid-way) follows the same schedule as the reference run
    body = f"""
[model]
hidden_size = 32
num_heads = 2
num_layers = 2
dropout = 0.1
[data]
dataset = "text"
path = "{corpus}"
[train]
max_steps = {steps}
lr_decay_steps = 40
batch_size = 4
seq_len = 16
warmup_steps = 2
log_interval = 1
eval_interval = 10
eval_iters = 2
checkpoint_interval = {ckpt}
device = "cpu"
"""
    for k, v in extra.items():
        body += f"{k} = {v}\n"
    p = tmp_path / "cfg.toml"
    p.write_text(body)
    return p


def losses(run):
    return {e["step"]: e["loss"] for e in read_metrics(run) if "loss" in e}


def _wait_for(path: Path, timeout=120):
    t0 = time.time()
    while not path.exists():
        if time.time() - t0 > timeout:
            raise TimeoutError(path)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 40-step run (its config and losses), trained once for the tests that
    kill, damage and resume runs of the same config."""
    d = tmp_path_factory.mktemp("reference")
    cfg = write_cfg(d, write_tiny_corpus(d / "tiny.txt"))
    with pytest.MonkeyPatch.context() as mp:  # the autouse cache isolation is per test
        mp.setenv("CONTINUUMLM_CACHE", str(d / "cache"))
        r = run_cli("train", "--config", cfg, "--out", d / "ref")
    assert r.returncode == 0, r.stderr
    return cfg, losses(d / "ref")


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(reference, tmp_path):
    cfg, ref = reference
    out = tmp_path / "killed"
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), "--set",
                          "train.max_steps=100000"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _wait_for(out / "checkpoints" / "step-00000015")
    p.send_signal(signal.SIGKILL)
    p.wait()
    r = run_cli("train", "--config", cfg, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    got = losses(out)
    assert got == ref  # every step once, and bit-identical to the uninterrupted run


def signal_during_training(cfg, out: Path, sig: int, after_steps: int = 7):
    """Train ``cfg`` (open-ended, no periodic checkpoint) in a child, send it ``sig`` once
    ``after_steps`` losses are logged; returns (exit status, stdout, stderr)."""
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), "--set",
                          "train.max_steps=100000", "--set", "train.checkpoint_interval=1000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "metrics.jsonl")
    while len(losses(out)) < after_steps:
        time.sleep(0.05)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=120)
    return p.returncode, stdout, stderr


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(reference, tmp_path):
    cfg, ref = reference
    out = tmp_path / "term"
    returncode, stdout, stderr = signal_during_training(cfg, out, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, stderr  # saved, but not a finished run
    assert "--resume" in stdout
    saved = (out / "checkpoints" / "last").resolve().name
    assert int(saved.split("-")[1]) >= 7


def test_resume_calls_a_refused_run_config_refused_not_damaged(tiny_corpus, tmp_path):
    """Intact checkpoints whose run.json this version cannot read (another version wrote it,
    or it was edited) are not damaged: the error says so, and what to do."""
    from continuumlm.runs.checkpoint import _write_manifest

    cfg = write_cfg(tmp_path, tiny_corpus, steps=10)
    out = tmp_path / "run"
    r = run_cli("train", "--config", cfg, "--out", out, "--quiet")
    assert r.returncode == 0, r.stderr
    for ckpt in (out / "checkpoints").glob("step-*"):
        run = json.loads((ckpt / "run.json").read_text())
        run["model"]["a_key_from_another_version"] = 1
        (ckpt / "run.json").write_text(json.dumps(run))
        _write_manifest(ckpt, int(ckpt.name.split("-")[1]))
    r = run_cli("train", "--out", out, "--resume", "--set", "train.max_steps=20")
    assert r.returncode == 2, r.stderr
    assert "refused by this version" in r.stderr and "a_key_from_another_version" in r.stderr
    assert "damaged" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("damage", ["truncated", "truncated_no_manifest", "state_no_manifest"])
def test_corrupt_last_checkpoint_falls_back(reference, tmp_path, damage):
    """With its manifest the damage is caught by the checksums; without one (a folder put
    together by hand) by reading the weights and checking the trainer state's entries."""
    cfg, ref = reference
    out = tmp_path / "corrupt"
    r = run_cli("train", "--config", cfg, "--out", out, "--set", "train.max_steps=20")
    assert r.returncode == 0, r.stderr
    last = (out / "checkpoints" / "last").resolve()
    assert last.name == "step-00000020"
    w = last / "model.safetensors"
    if damage.startswith("truncated"):
        w.write_bytes(w.read_bytes()[:-100])
    else:
        torch.save({"step": 20}, last / "trainer_state.pt")
    if damage.endswith("no_manifest"):
        (last / "manifest.json").unlink()
    r = run_cli("train", "--config", cfg, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr
    assert "step-00000020" in r.stderr and "damaged" in r.stderr and "step-00000015" in r.stderr
    assert losses(out) == ref


def test_stale_temporary_checkpoint_is_ignored(tiny_corpus, tmp_path):
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=10))
    out = tmp_path / "run"
    Trainer(cfg, out, quiet=True).run()
    stale = out / "checkpoints" / ".tmp-step-00000015-999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    cfg.train.max_steps = 15
    Trainer(cfg, out, resume=True, quiet=True).run()
    assert not stale.exists()


def test_missing_file_and_bad_manifest_are_named(tiny_corpus, tmp_path):
    from continuumlm.runs.checkpoint import verify_checkpoint

    out = tmp_path / "run"
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=5)), out, quiet=True).run()
    ck = (out / "checkpoints" / "last").resolve()
    (ck / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        verify_checkpoint(ck)
    (ck / "manifest.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="manifest.json is corrupt"):
        verify_checkpoint(ck)


def test_training_checkpoint_without_manifest_is_loaded_with_a_warning(tiny_corpus, tmp_path,
                                                                       capsys):
    """Every training checkpoint is written with its manifest, so one without has lost it: say
    that its files load unverified. A save_pretrained folder never had one: no warning."""
    from continuumlm.runs.checkpoint import load_model_and_tokenizer, verify_checkpoint

    out = tmp_path / "run"
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=5)), out, quiet=True).run()
    ck = (out / "checkpoints" / "last").resolve()
    verify_checkpoint(ck)
    assert capsys.readouterr().err == ""
    (ck / "manifest.json").unlink()
    model, _, _ = load_model_and_tokenizer(ck)
    err = capsys.readouterr().err
    assert "warning:" in err and "no manifest.json" in err and str(ck) in err
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    verify_checkpoint(plain)
    assert capsys.readouterr().err == ""


def test_nan_steps_are_skipped_then_training_stops(tiny_corpus, tmp_path):
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=40, ckpt=5, max_bad_steps=3))
    out = tmp_path / "run"
    trainer = Trainer(cfg, out, quiet=True)
    calls = {"n": 0}

    def poison(module, inputs, output):  # layer 1 starts emitting NaN after 12 steps
        calls["n"] += 1
        return output * float("nan") if trainer.step >= 12 else output

    trainer.model.depth.layers[1].register_forward_hook(poison)
    with pytest.raises(TrainingError, match=r"3 consecutive steps up to step 15.*layer 1"):
        trainer.run()
    assert (out / "checkpoints" / "last").resolve().name == "step-00000010"
    weights = torch.cat([p.flatten() for p in trainer.model.parameters()])
    assert torch.isfinite(weights).all()  # no update was applied from a bad step


def test_a_skipped_step_logs_its_own_nfe_not_the_diagnostic_pass_s(tiny_corpus, tmp_path):
    """A bad step's culprit is found by one more forward: the step's logged forward and
    backward NFE are the training pass's (the backward count read 0 after that forward)."""
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=4, ckpt=100),
                      ["model.depth=ode", "model.num_layers=1", "model.ode_solver=euler",
                       "model.ode_steps=3", "model.ode_grad=checkpoint"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)

    def poison(module, inputs, output):
        return output * float("inf") if trainer.step == 2 and module.training else output

    trainer.model.depth.blocks[0].register_forward_hook(poison)
    assert trainer.run()["skipped_steps"] == 1
    rows = [e for e in read_metrics(tmp_path / "run") if "loss" in e]
    assert not math.isfinite(rows[2]["loss"])
    assert [(e["nfe"], e["nfe_backward"]) for e in rows] == [(3, 3)] * 4


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_single_bad_step_is_skipped_and_counted(tiny_corpus, tmp_path, dtype):
    """fp16 too: its gradient scaler had unscaled the skipped step, and the next step's
    unscale_ raised (the run ended with a traceback at the first bad step)."""
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=12, ckpt=100),
                      [f"train.dtype={dtype}"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)

    def poison(module, inputs, output):
        return output * float("inf") if trainer.step == 5 and module.training else output

    trainer.model.depth.layers[0].register_forward_hook(poison)
    result = trainer.run()
    assert result["skipped_steps"] == 1 and result["step"] == 12


def test_disk_full_while_saving_keeps_previous_checkpoint(tiny_corpus, tmp_path, monkeypatch):
    import continuumlm.runs.checkpoint as ck

    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=20, ckpt=5))
    out = tmp_path / "run"
    trainer = Trainer(cfg, out, quiet=True)
    real_save = ck.torch.save
    calls = {"n": 0}

    def full_disk(obj, f, *a, **kw):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ck.torch, "save", full_disk)
    with pytest.raises(TrainingError, match=r"No space left.*step-00000005, is intact.*"
                                            r"--resume auto"):
        trainer.run()
    last = (out / "checkpoints" / "last").resolve()
    assert last.name == "step-00000005"
    ck.verify_checkpoint(last)
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_each_step_is_saved_once(tiny_corpus, tmp_path, monkeypatch):
    """A checkpoint step that is also evaluated and improves was saved twice (periodic, then
    best), and the second save replaced the folder `last` pointed at."""
    import continuumlm.train.checkpointer as tr

    saved = []
    real = tr.save_checkpoint
    monkeypatch.setattr(tr, "save_checkpoint", lambda root, step, *a, **kw: (
        saved.append((step, kw.get("best"))), real(root, step, *a, **kw))[1])
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=20, ckpt=5)), tmp_path / "run",
            quiet=True).run()
    assert [s for s, _ in saved] == [5, 10, 15, 20]
    assert dict(saved)[10] is True  # step 10's evaluation improved on step 0's: saved as best


def test_a_crash_while_a_step_is_saved_again_is_recovered(tiny_corpus, tmp_path):
    """SIGKILL between moving a step's old copy aside and putting the new one in place (with
    keep_checkpoints = 1 that copy is the only one): --resume moves it back and goes on. The
    old code deleted it first, and the run could be neither resumed nor restarted."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=10, ckpt=5, keep_checkpoints=1)
    out = tmp_path / "run"
    Trainer(load_config(cfg), out, quiet=True).run()
    root = out / "checkpoints"
    (root / "step-00000010").rename(root / ".old-step-00000010-999")
    (root / ".tmp-step-00000010-999").mkdir()  # the new copy, half written
    (root / ".tmp-step-00000010-999" / "config.json").write_text("{")
    r = run_cli("train", "--out", out, "--resume", "--set", "train.max_steps=12")
    assert r.returncode == 0, r.stderr
    assert "resuming at step 10" in r.stdout + r.stderr
    assert sorted(p.name for p in root.iterdir()) == ["best", "last", "step-00000012"] or \
        sorted(p.name for p in root.iterdir()) == ["best", "last", "step-00000010",
                                                   "step-00000012"]


def test_a_failed_resave_puts_the_old_copy_back(tiny_corpus, tmp_path, monkeypatch):
    import continuumlm.runs.checkpoint as ck

    trainer = Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=4)), tmp_path / "run",
                      quiet=True)
    first = trainer.save()
    real = ck.os.rename

    def failing(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(ck.os, "rename", failing)
    with pytest.raises(TrainingError, match="No space left"):
        trainer.save()
    assert (first / "manifest.json").is_file()  # the old copy is whole and in place
    ck.verify_checkpoint(first)
    assert (tmp_path / "run" / "checkpoints" / "last").resolve() == first
    assert not list(first.parent.glob(".old-*")) and not list(first.parent.glob(".tmp-*"))


def test_consecutive_bad_steps_carry_over_a_resume(tiny_corpus, tmp_path):
    """max_bad_steps counts across a resume: the interrupted run stops where the
    uninterrupted one does (it restarted the count and went 2 steps further)."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=40, ckpt=100, max_bad_steps=3)
    out = tmp_path / "run"

    def poisoned(max_steps, resume):
        c = load_config(cfg, [f"train.max_steps={max_steps}"])
        trainer = Trainer(c, out, resume=resume, quiet=True)
        trainer.model.depth.layers[1].register_forward_hook(
            lambda m, i, o: o * float("nan") if trainer.step >= 12 and m.training else o)
        return trainer

    assert poisoned(14, False).run()["skipped_steps"] == 2  # steps 13 and 14
    with pytest.raises(TrainingError, match=r"3 consecutive steps up to step 15"):
        poisoned(40, True).run()


def test_tensorboard_agrees_with_the_metrics_after_a_resume(tiny_corpus, tmp_path):
    """purge_step hid the events kept at the resume step (its training update): TensorBoard
    lacked step 15's loss after resuming from step 15."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = write_cfg(tmp_path, tiny_corpus, steps=15)
    out = tmp_path / "run"
    Trainer(load_config(cfg), out, quiet=True).run()
    Trainer(load_config(cfg, ["train.max_steps=20"]), out, resume=True, quiet=True).run()
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, key in (("train/loss", "loss"), ("val/val_loss", "val_loss")):
        tb = {}
        for e in acc.Scalars(tag):
            tb.setdefault(e.step, []).append(e.value)
        jsonl = {e["step"]: e[key] for e in read_metrics(out) if key in e}
        assert sorted(tb) == sorted(jsonl), tag
        assert all(len(v) == 1 and v[0] == pytest.approx(jsonl[s]) for s, v in tb.items()), tag


def test_unwritable_output_folder_is_detected_before_training(tiny_corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = write_cfg(tmp_path, tiny_corpus)
    r = run_cli("train", "--config", str(cfg), "--out", str(blocker / "run"))
    assert r.returncode == 2 and "cannot write to the run folder" in r.stderr
    # the advice fits the cause (it said "free some space" for every error)
    assert "a part of that path is a file" in r.stderr and "space" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "€€"], "not in this model's vocabulary"),
    (["--max-new-tokens", "0"], "must be positive"),
    (["--top-p", "1.5"], "top_p must lie in (0, 1]"),
    (["--temperature", "-1"], "temperature must be a positive finite number"),
    (["--temperature", "inf"], "temperature must be a positive finite number"),
    (["--greedy", "--top-p", "1.5"], "top_p must lie in (0, 1]"),  # was passed over
    (["--device", "cuda:7"], "--device = 'cuda"),  # named train.device, not the flag given
])
def test_generation_input_errors(tiny_corpus, tmp_path, args, needle):
    out = tmp_path / "run"
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=2)), out, quiet=True).run()
    r = run_cli("generate", "--checkpoint", str(out), "--prompt", "the", *args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == ""  # refused before the prompt is echoed


def test_tokenizer_that_does_not_match_checkpoint(tiny_corpus, tmp_path):
    from continuumlm.train import load_model_and_tokenizer

    out = tmp_path / "run"
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=2)), out, quiet=True).run()
    ck = (out / "checkpoints" / "last").resolve()
    tok = ck / "tokenizer.json"
    d = json.loads(tok.read_text())
    d["vocab"] = d["vocab"][:-3]
    tok.write_text(json.dumps(d))
    (ck / "manifest.json").unlink()  # as if the folder were assembled by hand
    with pytest.raises(CheckpointError, match="tokenizer .* has .* tokens but the model expects"):
        load_model_and_tokenizer(ck)


def test_weights_with_nan_are_refused_by_eval_and_generate(tiny_corpus, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "run"
    Trainer(load_config(write_cfg(tmp_path, tiny_corpus, steps=2)), out, quiet=True).run()
    ck = (out / "checkpoints" / "last").resolve()
    weights = load_file(ck / "model.safetensors")
    name = sorted(weights)[0]
    weights[name][0] = float("nan")
    save_file(weights, ck / "model.safetensors")
    (ck / "manifest.json").unlink()  # as if the weights were written by hand
    for cmd in (["generate", "--prompt", "the"], ["eval"]):
        r = run_cli(*cmd, "--checkpoint", str(out), "--which", "last")
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"non-finite values (NaN or inf) in {name}" in r.stderr


def test_a_corpus_changed_after_training_is_caught_on_resume_and_eval(tiny_corpus, tmp_path):
    """The run records each split's sha256: a resume refuses other text (it would silently
    train on it), an evaluation says its figures are not the run's; same text, no word."""
    out = tmp_path / "run"
    cfg = write_cfg(tmp_path, tiny_corpus, steps=2)
    Trainer(load_config(cfg), out, quiet=True).run()
    r = run_cli("eval", "--checkpoint", str(out))
    assert r.returncode == 0 and "differs" not in r.stderr, r.stderr
    text = tiny_corpus.read_text()
    tiny_corpus.write_text(text[:-200] + text[-200:].replace("cat", "mat"))  # the val part
    r = run_cli("eval", "--checkpoint", str(out))
    assert r.returncode == 0 and "warning: the val split's text differs" in r.stderr
    assert str(tiny_corpus) in r.stderr
    r = run_cli("train", "--out", str(out), "--resume", "--set", "train.max_steps=4")
    assert r.returncode == 2 and "the text of the val split differs" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    tiny_corpus.write_text(text)  # restored: the run goes on
    r = run_cli("train", "--out", str(out), "--resume", "--set", "train.max_steps=4")
    assert r.returncode == 0, r.stderr


def test_min_lr_above_lr_trains_with_a_warning(tiny_corpus, tmp_path, capsys):
    """Lowering train.lr below the default min_lr must not stop a run (a refusal did); the
    rising schedule is said once."""
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=2), ["train.lr=5e-5"])
    assert Trainer(cfg, tmp_path / "run", quiet=True).run()["step"] == 2
    assert "warning: train.min_lr (0.0001) is larger than train.lr (5e-05)" in \
        capsys.readouterr().err


def test_warmup_past_the_decay_horizon_trains_with_a_warning(tiny_corpus, tmp_path, capsys):
    """A warm-up as long as the run leaves no cosine decay: said once, the run goes on; a
    warm-up below the horizon says nothing."""
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=3),
                      ["train.warmup_steps=3", "train.lr_decay_steps=3"])
    assert Trainer(cfg, tmp_path / "run", quiet=True).run()["step"] == 3
    err = capsys.readouterr().err
    assert "warning: train.warmup_steps (3) is not below the end of the cosine decay " \
        "(train.lr_decay_steps = 3)" in err, err
    assert err.count("warning:") == 1
    # a run that ends inside its warm-up, before a later decay horizon, is said too
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=2), ["train.warmup_steps=5"])
    assert Trainer(cfg, tmp_path / "run_short", quiet=True).run()["step"] == 2
    assert "train.warmup_steps (5) is not below train.max_steps (2)" in capsys.readouterr().err
    cfg = load_config(write_cfg(tmp_path, tiny_corpus, steps=3))
    assert Trainer(cfg, tmp_path / "run3", quiet=True).run()["step"] == 3
    assert "warmup" not in capsys.readouterr().err


def test_a_changed_test_split_does_not_stop_a_resume(data_dir, tmp_path):
    """Training reads train and val only: a PTB test file changed since the run started is
    eval's warning, not a refusal to resume."""
    import shutil

    if not (data_dir / "ptb.train.txt").is_file():
        pytest.skip("PTB not available")
    ptb = tmp_path / "ptb"
    ptb.mkdir()
    for split in ("train", "valid", "test"):
        shutil.copy(data_dir / f"ptb.{split}.txt", ptb)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nhidden_size = 16\nnum_heads = 2\nnum_layers = 1\n'
                   f'[data]\ndataset = "ptb"\npath = "{ptb}"\ntokenizer = "word"\n'
                   f'[train]\nmax_steps = 2\nbatch_size = 2\nseq_len = 8\neval_iters = 1\n'
                   f'device = "cpu"\n')
    out = tmp_path / "run"
    Trainer(load_config(cfg), out, quiet=True).run()
    with open(ptb / "ptb.test.txt", "a") as f:
        f.write(" the cat sat on the mat \n")
    r = run_cli("train", "--out", str(out), "--resume", "--set", "train.max_steps=3")
    assert r.returncode == 0, r.stderr
    # the checkpoint written before the change (the resumed run's records the new text)
    r = run_cli("eval", "--checkpoint", str(out / "checkpoints" / "step-00000002"),
                "--split", "test", "--max-windows", "2")
    assert r.returncode == 0, r.stderr
    assert "the test split's text differs" in r.stderr and f"the folder {ptb}" in r.stderr


def test_no_pickle_on_the_loading_path():
    src = Path(__file__).resolve().parents[1] / "src" / "continuumlm"
    for f in src.rglob("*.py"):
        text = f.read_text()
        assert "pickle.load" not in text, f
        for line in text.splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{f}: {line.strip()}"


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_experiment_quick_runs_end_to_end(data_dir, tmp_path):
    """`continuumlm experiment ptb --quick`: every run of the experiment at smoke size, its JSON,
    the n-gram references and a rendered results page, all outside the committed results."""
    import os

    if not (data_dir / "ptb.train.txt").is_file():
        pytest.skip("PTB not available")
    cli = str(Path(sys.executable).parent / "continuumlm")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CONTINUUMLM_DATA": str(data_dir)}
    r = subprocess.run([cli, "experiment", "ptb", "--quick", "--quick-dir", str(tmp_path)],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")}
    assert {"ptb-transformer_seed42", "ptb-ode_rk4_seed42", "ptb-ode_rk4_wide_seed42",
            "ptb-ngram"} <= set(results)
    assert all("test_loss_full_split" in v for k, v in results.items() if "seed" in k)
    assert results["ptb-ode_rk4_seed42"]["final_step"] == 6
    page = (tmp_path / "docs" / "results.md").read_text()
    assert "Penn Treebank" in page and "ode_rk4_wide" in page
    # a second run skips what exists
    r = subprocess.run([cli, "experiment", "ptb", "--quick", "--quick-dir", str(tmp_path)],
                       cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.count("skip ") == 3


def test_experiment_command_lists():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from experiment import EXPERIMENTS, ORDER, commands

    assert set(ORDER) == set(EXPERIMENTS)
    full = commands("shakespeare", quick=False)
    baby = next(c for c in full if "transformer_baby.toml" in c[1])
    assert baby[baby.index("--seeds") + 1:] == ["1337", "1", "2"]
    quick = commands("shakespeare", quick=True)
    assert len(quick) == len(full)
    qbaby = next(c for c in quick if "transformer_baby.toml" in c[1])
    assert "train.max_steps=6" in qbaby and qbaby[qbaby.index("--seeds") + 1] == "1337"
    assert commands("bench", quick=True) == []  # machine-wide timings have no smoke size
    assert commands("bench", quick=False, done={"ode_cost", "mfu"}) == [
        [f"{b}.py"] for b in ("ode_memory", "deltanet_kernels", "mixer_step", "decode_speed",
                              "scale", "keep_freed_memory", "threads", "data_scale",
                              "hf_generate",
                              "adaptive_grads", "seminorm_run")]
    repo = Path(__file__).resolve().parents[1]
    for name in ORDER:  # every config and script named exists
        for cmd in commands(name, quick=False):
            assert (repo / "bench" / cmd[0]).is_file(), cmd
            assert all((repo / a).is_file() for a in cmd[1:] if a.startswith("configs/")), cmd


def test_experiment_outside_a_checkout_is_a_clear_error(tmp_path):
    r = run_cli("experiment", "ptb", cwd=tmp_path)
    assert r.returncode == 2 and "checkout" in r.stderr


def test_device_names_are_checked():
    from continuumlm import ConfigError
    from continuumlm.train import pick_device

    for bad in ("foo", "cuda:99", "meta"):
        with pytest.raises(ConfigError, match="device"):
            pick_device(bad)
    assert pick_device("cpu").type == "cpu"


def test_missing_best_points_to_last(tmp_path):
    from continuumlm.runs.checkpoint import resolve_checkpoint

    (tmp_path / "checkpoints" / "last").mkdir(parents=True)
    (tmp_path / "checkpoints" / "last" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="--which last"):
        resolve_checkpoint(tmp_path, "best")
    assert resolve_checkpoint(tmp_path, "last") == tmp_path / "checkpoints" / "last"


@pytest.mark.parametrize("files", [[], "abc", {"/etc/hostname": "0" * 64},
                                   {"../x": "0" * 64}])
def test_malformed_manifest_is_a_checkpoint_error(tmp_path, files):
    from continuumlm.runs.checkpoint import verify_checkpoint

    (tmp_path / "manifest.json").write_text(json.dumps({"files": files}))
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(tmp_path)


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_train_seeds_never_reuses_a_run_made_with_other_settings(tiny_corpus, tmp_path):
    """bench/train_seeds.py names results by config and seed. A recorded result, or an
    unfinished run folder, made with other --set options is refused, not skipped or resumed."""
    import os

    repo = Path(__file__).resolve().parents[1]
    sets = [f"data.path={tiny_corpus}", "data.dataset=text", "model.hidden_size=16",
            "model.num_heads=2", "model.num_layers=1", "train.batch_size=2", "train.seq_len=8",
            "train.max_steps=2", "train.warmup_steps=1", "train.eval_interval=2",
            "train.eval_iters=1", "train.checkpoint_interval=2", "train.device=cpu"]
    env = {**os.environ, "CONTINUUMLM_RUNS_DIR": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}

    def seeds(*extra, flags=()):
        return subprocess.run(
            [sys.executable, str(repo / "bench" / "train_seeds.py"),
             "configs/shakespeare_char/transformer_baby.toml", "--seeds", "3", "--out",
             str(tmp_path / "results"), "--max-windows", "4", *flags,
             *sum((["--set", s] for s in [*sets, *extra]), [])],
            cwd=repo, env=env, capture_output=True, text=True, timeout=300)

    r = seeds()
    assert r.returncode == 0, r.stderr[-2000:]
    result = tmp_path / "results" / "shakespeare_char-transformer_baby_seed3.json"
    assert json.loads(result.read_text())["overrides"] == sets
    assert "skip" in seeds().stdout  # the same command again: done already
    r = seeds("train.lr=0.01")
    assert r.returncode != 0 and "--force" in r.stderr and "train.lr=0.01" in r.stderr
    result.unlink()  # as if the run had been interrupted before it was recorded
    r = seeds("train.lr=0.01")
    assert r.returncode != 0 and "other settings (train.lr)" in r.stderr, r.stderr
    assert not result.exists()
    r = seeds()  # its own settings: resumed and recorded again
    assert r.returncode == 0 and json.loads(result.read_text())["final_step"] == 2, r.stderr
    assert "resume" in r.stdout and json.loads(result.read_text())["wall_seconds"] is None
    r = seeds(flags=["--force"])  # trained again from scratch, not re-recorded from the folder
    assert r.returncode == 0, r.stderr
    assert "resume" not in r.stdout and json.loads(result.read_text())["wall_seconds"] > 0


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_what_to_do(tmp_path):
    from continuumlm.train.trainer import find_resumable

    (tmp_path / "config.toml").write_text("[train]\nmax_steps = 10\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.2}\n')
    with pytest.raises(CheckpointError, match="(?s)stopped before.*Delete"):
        find_resumable(tmp_path)
    with pytest.raises(CheckpointError, match="start the run without --resume"):
        find_resumable(tmp_path / "empty")


def test_help_and_usage_errors_do_not_import_torch():
    """`continuumlm --help`, a command's --help and a bad flag answer without importing torch
    (seconds): the package loads the model, and with it torch, on first use only."""
    code = ("import sys\n"
            "from continuumlm.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['train', '--bogus']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == (0 if '--help' in argv else 2), (argv, e.code)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from continuumlm import LanguageModel\n"
            "assert 'torch' in sys.modules and LanguageModel.__name__ == 'LanguageModel'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_every_module_imports_first():
    """Each module of the package imports in a fresh interpreter, whichever comes first (an
    import cycle shows only when the module on it is the first one loaded). One child per
    module, forked after torch is loaded, so the test takes seconds."""
    code = ("import importlib, os, sys, torch\n"
            "from pathlib import Path\n"
            "import continuumlm  # the package itself loads config and errors, no model\n"
            "root = Path(continuumlm.__file__).parent\n"
            "names = sorted('.'.join(('continuumlm',) + f.relative_to(root).with_suffix('').parts)\n"
            "               .removesuffix('.__init__') for f in root.rglob('*.py')\n"
            "               if f.name != '__main__.py')\n"
            "loaded = sorted(k for k in sys.modules if k.startswith('continuumlm.'))\n"
            "assert {m.split('.')[1] for m in loaded} == {'config', 'errors', 'registry'}, loaded\n"
            "bad, running = [], {}\n"
            "def reap():\n"
            "    pid, status = os.wait()\n"
            "    if status:\n"
            "        bad.append(running[pid])\n"
            "    del running[pid]\n"
            "for name in names:\n"
            "    if len(running) >= (os.cpu_count() or 1):  # one child per core at a time\n"
            "        reap()\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        try:\n"
            "            importlib.import_module(name)\n"
            "        except BaseException as e:\n"
            "            print(name, type(e).__name__, e, file=sys.stderr)\n"
            "            os._exit(1)\n"
            "        os._exit(0)\n"
            "    running[pid] = name\n"
            "while running:\n"
            "    reap()\n"
            "assert len(names) > 20 and not bad, sorted(bad)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
