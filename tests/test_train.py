import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from continuumlm import CheckpointError, ConfigError, load_config
from continuumlm.runs.checkpoint import load_trainer_state, verify_checkpoint
from continuumlm.train import Trainer
from continuumlm.train.logging import read_metrics
from continuumlm.train.optim import lr_at

CLI = str(Path(sys.executable).parent / "continuumlm")


def tiny_cfg(corpus, *extra):
    return load_config(None, [
        "data.dataset=text", f"data.path=\"{corpus}\"", "model.hidden_size=32", "model.num_heads=2",
        "model.num_layers=2", "model.dropout=0.1", "train.batch_size=4", "train.seq_len=16",
        "train.max_steps=12", "train.lr_decay_steps=12", "train.warmup_steps=2",
        "train.log_interval=1", "train.eval_interval=4", "train.eval_iters=2",
        "train.checkpoint_interval=3", "train.device=cpu", *extra])


def test_lr_schedule():
    t = load_config(None, ["train.max_steps=100", "train.warmup_steps=10", "train.lr=1.0",
                           "train.min_lr=0.1"]).train
    assert lr_at(0, t) == pytest.approx(1 / 11)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.55)
    assert lr_at(100, t) == pytest.approx(0.1) and lr_at(500, t) == 0.1


def test_resume_matches_uninterrupted_run(tiny_corpus, tmp_path):
    full = Trainer(tiny_cfg(tiny_corpus), tmp_path / "full", quiet=True)
    full.run()
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=6"), tmp_path / "cut", quiet=True).run()
    Trainer(tiny_cfg(tiny_corpus), tmp_path / "cut", resume=True, quiet=True).run()

    def losses(run):
        return {e["step"]: e["loss"] for e in read_metrics(run) if "loss" in e}

    a, b = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(b) == list(range(1, 13))  # no duplicated or missing steps after the resume
    assert a == b  # bit-identical on CPU
    vals = [e["step"] for e in read_metrics(tmp_path / "cut") if "val_loss" in e]
    assert vals == sorted(set(vals))
    pa = torch.cat([p.flatten() for p in full.model.parameters()])
    from continuumlm.train import load_model_and_tokenizer

    m, _, _ = load_model_and_tokenizer(tmp_path / "cut", "last")
    torch.testing.assert_close(torch.cat([p.flatten() for p in m.parameters()]), pa, rtol=0, atol=0)


def test_run_folder_layout_and_checkpoints(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus, "train.keep_checkpoints=2"), out, quiet=True).run()
    assert (out / "config.toml").is_file() and (out / "tb").is_dir()
    assert load_config(out / "config.toml").train.max_steps == 12
    ck = out / "checkpoints"
    for which in ("last", "best"):
        names = sorted(p.name for p in (ck / which).iterdir())
        assert names == ["config.json", "manifest.json", "model.safetensors", "run.json",
                         "tokenizer.json", "trainer_state.pt"]
    steps = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    assert len(steps) <= 3 and (ck / "last").resolve().name == "step-00000012"
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]  # no temp folders left
    events = read_metrics(out)
    train_ev = [e for e in events if "loss" in e]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(train_ev[0])
    assert any("val_loss" in e for e in events)
    # a fresh run never overwrites an existing one
    with pytest.raises(ConfigError, match="--resume"):
        Trainer(tiny_cfg(tiny_corpus), out, quiet=True)


def test_corrupt_checkpoint_detected(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=3"), out, quiet=True).run()
    ck = (out / "checkpoints" / "last").resolve()
    w = ck / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match the sha256"):
        verify_checkpoint(ck)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(tmp_path / "trainer_state.pt", "wb") as f:
        pickle.dump({"step": Evil()}, f)
    with pytest.raises(CheckpointError, match="refused"):
        load_trainer_state(tmp_path)
    assert not marker.exists()
    torch.save({"step": Evil()}, tmp_path / "trainer_state.pt")  # the format torch.save writes
    with pytest.raises(CheckpointError, match=r"refused \(it may be malicious\).*posix.system"):
        load_trainer_state(tmp_path)
    assert not marker.exists()
    # random bytes are called damaged, not malicious (the message blamed a pickle's objects)
    (tmp_path / "trainer_state.pt").write_bytes(bytes(range(256)) * 20)
    with pytest.raises(CheckpointError, match="damaged, or another kind of file") as info:
        load_trainer_state(tmp_path)
    assert "may be malicious" not in str(info.value)


def test_too_short_corpus(tmp_path):
    p = tmp_path / "short.txt"
    p.write_text("abcdefghij" * 2)
    from continuumlm.errors import DataError

    with pytest.raises(DataError, match="fewer than one window"):
        Trainer(tiny_cfg(p), tmp_path / "run", quiet=True)


def test_cli_smoke(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(f"""
[model]
hidden_size = 32
num_heads = 2
num_layers = 2
[data]
dataset = "text"
path = "{tiny_corpus}"
[train]
max_steps = 20
batch_size = 4
seq_len = 16
eval_interval = 10
eval_iters = 2
device = "cpu"
""")
    # the console script, as a user runs it (the other commands run in this process)
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "done: step 20" in r.stdout
    r = run_cli("eval", "--checkpoint", str(out), "--context-lengths", "8,16,100000", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [row["context"] for row in rows] == [8, 16, 100000]
    assert rows[0]["bpc"] > 0 and "unsupported" in rows[2]
    r = run_cli("generate", "--checkpoint", out, "--prompt", "the cat", "--max-new-tokens", "30",
                "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the cat") and len(r.stdout.rstrip("\n")) == len("the cat") + 30
    # decoding speed apart from the set-up (the prompt's forward, a compile): on stderr
    assert re.search(r"generated 30 tokens: first token [0-9.]+ s \(the 7-token prompt\); "
                     r"then 29 tokens in [0-9.]+ s, [0-9.]+ tokens/s", r.stderr), r.stderr
    r2 = run_cli("generate", "--checkpoint", out, "--prompt", "the cat", "--max-new-tokens",
                 "30", "--seed", "3", "--no-cache")
    assert r2.stdout == r.stdout
    greedy = ["generate", "--checkpoint", str(out), "--prompt", "the", "--max-new-tokens", "20",
              "--greedy"]
    r3, r4 = run_cli(*greedy), run_cli(*greedy, "--compile")
    assert r4.returncode == 0 and r4.stdout == r3.stdout, r4.stderr
    assert "decoding eagerly" not in r4.stderr  # the compiled graph ran
    # the one-token step compiles at its first call, the second token: set-up, not decoding
    assert re.search(r"generated 20 tokens: first token [0-9.]+ s \(the 3-token prompt\), "
                     r"second [0-9.]+ s \(the one-token step's first call, which compiles "
                     r"it\); then 18 tokens in [0-9.]+ s", r4.stderr), r4.stderr
    # graph replay records CUDA work: asked for on the CPU, refused by name (exit status 2)
    r5 = run_cli(*greedy, "--cuda-graph", "on")
    assert r5.returncode == 2 and "CUDA graphs record CUDA work" in r5.stderr, r5.stderr
    r6 = run_cli(*greedy, "--compile", "--no-cache")  # nothing cached to compile
    assert r6.returncode == 2 and "drop one of them" in r6.stderr, r6.stderr
    r = run_cli("train", "--out", str(out), "--resume", "--set", "train.max_steps=25")
    assert r.returncode == 0 and "done: step 25" in r.stdout, r.stderr
    # without lr_decay_steps the cosine's horizon moved with max_steps: said, with the fix
    assert "jumps from" in r.stderr and "train.lr_decay_steps = 20" in r.stderr, r.stderr


@pytest.mark.parametrize("args,needle", [
    (["train", "--config", "nope.toml"], "does not exist"),
    (["train", "--config", "configs/shakespeare_char/demo.toml", "--set", "model.num_head=3"],
     "did you mean 'num_heads'"),
    (["eval", "--checkpoint", "/nonexistent/run"], "does not exist"),
    (["generate", "--checkpoint", "."], "holds no checkpoint"),
    (["generate", "--checkpoint", ".", "--seed", "99999999999999999999"], "outside 0"),
])
def test_cli_user_errors_exit_2(args, needle):
    r = run_cli(*args, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_resume_truncation_skips_lines_that_are_not_events(tmp_path):
    from continuumlm.train.logging import MetricsLogger

    good = [{"step": 1, "loss": 2.0}, {"step": 2, "val_loss": 1.5}, {"step": 4, "loss": 1.0}]
    lines = [json.dumps(good[0]).encode(), b"[1, 2]", b'{"step": "x"}', b"\xff\xfe junk",
             json.dumps(good[1]).encode(), json.dumps(good[2]).encode()]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    MetricsLogger(tmp_path, resume_step=3, tensorboard=False).close()
    assert read_metrics(tmp_path) == good[:2]


@pytest.mark.parametrize("damage", ["optimizer", "sampler", "weights"])
def test_resume_from_a_checkpoint_changed_by_hand_is_a_checkpoint_error(tiny_corpus, tmp_path,
                                                                        damage):
    """A folder without manifest is not checksummed; what does not fit is still an error
    naming the folder, not a traceback from deep inside torch."""
    from safetensors.torch import save_model

    from continuumlm import LanguageModel

    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=3"), out, quiet=True).run()
    last = (out / "checkpoints" / "last").resolve()
    (last / "manifest.json").unlink()
    path = last / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    if damage == "optimizer":
        state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"][:1]
    elif damage == "sampler":
        for m in state["sampler"]["streams"]:
            state["sampler"]["streams"][m] = torch.zeros(3, dtype=torch.uint8)
    else:
        other = tiny_cfg(tiny_corpus, "model.hidden_size=16", "model.vocab_size=40")
        save_model(LanguageModel(other.model), str(last / "model.safetensors"))
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=str(last.name)):
        Trainer(tiny_cfg(tiny_corpus, "train.max_steps=6"), out, resume=True, quiet=True)


def test_resume_past_max_steps_is_refused_and_keeps_the_checkpoint(tiny_corpus, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=6"), out, quiet=True).run()
    last = (out / "checkpoints" / "last").resolve()
    before = {p.name: p.stat().st_mtime_ns for p in last.iterdir()}
    with pytest.raises(ConfigError, match="past train.max_steps = 4"):
        Trainer(tiny_cfg(tiny_corpus, "train.max_steps=4"), out, resume=True, quiet=True)
    assert {p.name: p.stat().st_mtime_ns for p in last.iterdir()} == before


def test_extending_a_run_keeps_its_final_evaluation(tiny_corpus, tmp_path):
    """A run that ended at a step off the eval_interval grid evaluated there; extending it with
    --resume does not evaluate at that step again, so that evaluation must stay in the log."""
    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=7", "train.eval_interval=5"), out,
            quiet=True).run()
    first = [(e["step"], e["val_loss"]) for e in read_metrics(out) if "val_loss" in e]
    assert [s for s, _ in first] == [0, 5, 7]
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=10", "train.eval_interval=5"), out,
            resume=True, quiet=True).run()
    after = [(e["step"], e["val_loss"]) for e in read_metrics(out) if "val_loss" in e]
    assert after[:3] == first and [s for s, _ in after] == [0, 5, 7, 10]
    # an evaluation the resumed run repeats (on the grid) is still logged once
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=12", "train.eval_interval=5"), out,
            resume=True, quiet=True).run()
    steps = [e["step"] for e in read_metrics(out) if "val_loss" in e]
    assert steps == [0, 5, 7, 10, 12]


def test_throughput_counts_training_time_only(tiny_corpus, tmp_path, monkeypatch):
    """tokens/s covers the training steps of its window: not the evaluations or checkpoint
    writes in between, and not steps counted before a pause with time measured after it. A
    fake clock makes the rate exact: each step takes 1 s, evaluations 10 s, saves 5 s."""
    import types

    import continuumlm.train.trainer as trainer_module

    now = [0.0]
    fake_time = types.SimpleNamespace(**{k: getattr(trainer_module.time, k)
                                         for k in dir(trainer_module.time) if not k.startswith("_")})
    fake_time.perf_counter = lambda: now[0]
    monkeypatch.setattr(trainer_module, "time", fake_time)
    for name, cost in (("train_step", 1.0), ("evaluate", 10.0), ("save", 5.0)):
        real = getattr(Trainer, name)

        def timed(self, *a, _real=real, _cost=cost, **kw):
            now[0] += _cost
            return _real(self, *a, **kw)

        monkeypatch.setattr(Trainer, name, timed)
    cfg = tiny_cfg(tiny_corpus, "train.log_interval=4", "train.eval_interval=5",
                   "train.checkpoint_interval=3")
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    rates = [e["tokens_per_s"] for e in read_metrics(tmp_path / "run") if "tokens_per_s" in e]
    assert len(rates) == 3
    assert rates == pytest.approx([cfg.train.batch_size * cfg.train.seq_len] * 3)


@pytest.mark.parametrize("command", ["train", "mqar"])
def test_encoder_mode_is_refused_by_the_trainers(tiny_corpus, tmp_path, command):
    """Both trainers optimize next-token prediction, which an encoder solves by reading the
    target: refused with exit 2 before any folder is written."""
    out = tmp_path / "run"
    args = [CLI, command, "--out", str(out), "--set", "model.mode=encoder"]
    if command == "train":
        args += ["--set", "data.dataset=text", "--set", f"data.path=\"{tiny_corpus}\""]
    else:
        args += ["--config", str(Path(__file__).resolve().parents[1] / "configs" / "mqar" /
                                 "softmax_kv16.toml")]
    r = run_cli(*args[1:])
    assert r.returncode == 2, r.stderr
    assert "model.mode = 'encoder'" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_extended_continuous_run_equals_a_straight_one(tiny_corpus, tmp_path):
    """The Sobolev penalty's annealing follows the learning rate's horizon (lr_decay_steps),
    so a continuous-mixer run extended with --resume and a larger max_steps trains exactly as
    one run to that step (annealing over max_steps changed the weights of every step)."""
    cat = ["model.mixer=continuous", "model.position=none", "model.cat_sob_lambda=0.05"]
    straight = tmp_path / "straight"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=8", *cat), straight, quiet=True).run()
    cut = tmp_path / "cut"
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=4", *cat), cut, quiet=True).run()
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=8", *cat), cut, resume=True, quiet=True).run()
    train = lambda d: [(e["loss"], e["penalty"]) for e in read_metrics(d) if "loss" in e]  # noqa: E731
    assert train(cut) == train(straight) and train(cut)[-1][1] > 0


def test_run_config_keeps_data_path_absolute(tiny_corpus, tmp_path, monkeypatch):
    """A relative data.path is stored absolute, so --resume and eval read the same file from
    any folder (before, eval elsewhere silently scored another corpus)."""
    from continuumlm.train.trainer import find_resumable

    monkeypatch.chdir(tiny_corpus.parent)
    out = tmp_path / "run"
    Trainer(tiny_cfg(tiny_corpus.name, "train.max_steps=3"), out, quiet=True).run()
    _, saved, _ = find_resumable(out, announce=False)
    assert saved.data.path == str(tiny_corpus.absolute())
    monkeypatch.chdir(tmp_path.parent)  # the same relative path from elsewhere: another file
    with pytest.raises(ConfigError, match=r"\[data\] settings differ"):
        Trainer(tiny_cfg(tiny_corpus.name, "train.max_steps=6"), out, resume=True, quiet=True)
    monkeypatch.chdir(tiny_corpus.parent)
    r = Trainer(tiny_cfg(tiny_corpus.name, "train.max_steps=6"), out, resume=True, quiet=True).run()
    assert r["step"] == 6


def test_a_new_run_never_writes_into_another_runs_folder(tiny_corpus, tmp_path):
    """A training run in an MQAR run's folder, or in a folder holding a user's config.toml,
    would overwrite config.toml and mix metrics.jsonl; an MQAR run in a training run's folder
    likewise. All are refused and the files are left as they were."""
    from continuumlm.train.mqar import run_mqar
    from test_mqar import _mqar_cfg

    own = tmp_path / "mine"
    own.mkdir()
    (own / "config.toml").write_text("# my notes\n[train]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match="already holds config.toml"):
        Trainer(tiny_cfg(tiny_corpus, "train.max_steps=2"), own, quiet=True)
    assert (own / "config.toml").read_text().startswith("# my notes")
    run_mqar(_mqar_cfg("train.max_steps=4"), tmp_path / "mq", quiet=True)
    before = (tmp_path / "mq" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="checkpoints"):
        Trainer(tiny_cfg(tiny_corpus, "train.max_steps=2"), tmp_path / "mq", quiet=True)
    with pytest.raises(ConfigError, match=r"holds a MQAR \(continuumlm mqar\) run, not a "
                                          r"language-modeling"):
        Trainer(tiny_cfg(tiny_corpus, "train.max_steps=2"), tmp_path / "mq", resume=True,
                quiet=True)
    assert (tmp_path / "mq" / "metrics.jsonl").read_text() == before
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=3"), tmp_path / "tr", quiet=True).run()
    before = (tmp_path / "tr" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds a language-modeling .* run, not a MQAR"):
        run_mqar(_mqar_cfg("train.max_steps=4"), tmp_path / "tr", quiet=True)
    assert (tmp_path / "tr" / "metrics.jsonl").read_text() == before


def test_inspect_reads_a_config_saved_with_a_byte_order_mark(tmp_path):
    cfg = tmp_path / "bom.toml"
    cfg.write_text("\ufeff[model]\nhidden_size = 32\nnum_heads = 2\nnum_layers = 1\n"
                   "[mqar]\nvocab_size = 64\n", encoding="utf-8")
    r = run_cli("inspect", "--config", str(cfg))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_inspect_describes_the_model_continuumlm_mqar_trains(tmp_path):
    """An MQAR config's model takes the task's vocabulary (whatever model.vocab_size says) and
    room for its sequences; `--set mqar.*` makes any config one."""
    import dataclasses

    from continuumlm.config import load_config
    from continuumlm.model import LanguageModel

    cfg = tmp_path / "recall.toml"
    cfg.write_text("[model]\nhidden_size = 32\nnum_heads = 2\nnum_layers = 1\nvocab_size = 50\n"
                   "position = \"learned\"\nmax_seq_len = 64\n[mqar]\nvocab_size = 300\n"
                   "seq_len = 256\nnum_kv_pairs = 8\n")
    model = load_config(cfg).model
    trained = LanguageModel(dataclasses.replace(model, vocab_size=300, max_seq_len=256))
    for args in (["--config", str(cfg)],
                 ["--config", str(tmp_path / "plain.toml"), "--set", "mqar.vocab_size=300",
                  "--set", "mqar.seq_len=256", "--set", "mqar.num_kv_pairs=8"]):
        (tmp_path / "plain.toml").write_text(cfg.read_text().split("[mqar]")[0])
        r = run_cli("inspect", *args, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert (info["vocab_size"], info["vocab_from"]) == (300, "mqar.vocab_size")
        assert info["parameters"] == trained.num_parameters()


def test_inspect_does_not_state_an_adaptive_solvers_nfe_as_a_fact(tmp_path):
    cfg = tmp_path / "adaptive.toml"
    cfg.write_text("[model]\nhidden_size = 32\nnum_heads = 2\nnum_layers = 1\nvocab_size = 50\n"
                   "depth = \"ode\"\node_solver = \"dopri5\"\n")
    r = run_cli("inspect", "--config", str(cfg), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["nfe_per_forward"] is None and "adaptive" in info["nfe_note"]
    r = run_cli("inspect", "--config", str(cfg), "--json", "--set", "model.ode_solver=rk4")
    assert json.loads(r.stdout)["nfe_per_forward"] == 4 * 4  # rk4, ode_steps 4 by default


@pytest.mark.parametrize("extra", [[], ["train.grad_accum=3", "model.mixer=continuous"]],
                         ids=["plain", "accum_penalty"])
def test_a_training_step_reads_its_metrics_from_the_device_once(tiny_corpus, tmp_path,
                                                                monkeypatch, extra):
    """On a GPU every read of a tensor's value makes the host wait for the device. A step reads
    its loss, penalty and gradient norm together, once (it used to read 3 + grad_accum times)."""
    import sys as _sys

    trainer = Trainer(tiny_cfg(tiny_corpus, *extra), tmp_path / "run", quiet=True)
    reads = []
    for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, _name=name, **kw):
            caller = _sys._getframe(1).f_code.co_filename
            if "continuumlm" in caller and "tests" not in caller:
                reads.append((_name, caller.rsplit("/", 1)[-1]))
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counting)
    for _ in range(2):
        reads.clear()
        loss, grad_norm = trainer.train_step()
        assert reads == [("tolist", "objective.py")]
        assert math.isfinite(loss) and math.isfinite(grad_norm)


_FAULTS = """
import resource, sys, torch
from continuumlm.train.device import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
def once():
    x = torch.ones(64 * 2 ** 20 // 4)  # 64 MB, every page written
    del x
once(); once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    once()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_keep_freed_memory_stops_large_tensors_faulting_in_again():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0] == "True", int(out[1])

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[always]" in thp.read_text():
        pytest.skip("transparent huge pages always on: a 64 MB block faults in as ~32 pages")
    applied, kept = faults("keep")
    if not applied:
        pytest.skip("not glibc: mallopt unavailable")
    _, default = faults("default")
    # ten 64 MB tensors: 10 x 16,384 pages faulted in afresh by default; once kept, none in
    # the steady state (a small allocation carving into the freed block can cost one more
    # tensor's worth of fresh pages before the heap settles)
    assert default > 120_000, default
    assert kept <= 2 * 16_384 + 2_000, kept


def test_trainer_keeps_freed_memory_on_cpu_unless_told_not_to(tiny_corpus, tmp_path, monkeypatch):
    from continuumlm.train import trainer as trainer_mod

    calls = []
    monkeypatch.setattr(trainer_mod, "keep_freed_memory", lambda: calls.append(1) or True)
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=1"), tmp_path / "kept", quiet=True)
    assert len(calls) == 1
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=1", "train.keep_freed_memory=false"),
            tmp_path / "system", quiet=True)
    assert len(calls) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the note is for glibc Linux")
def test_trainer_says_when_keeping_freed_memory_has_no_effect(tiny_corpus, tmp_path, monkeypatch,
                                                                capsys):
    from continuumlm.train import trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "keep_freed_memory", lambda: False)  # no glibc
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=1"), tmp_path / "run")
    assert "train.keep_freed_memory could not be applied" in capsys.readouterr().err
