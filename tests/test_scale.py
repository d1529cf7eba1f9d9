"""Scale-out: torchrun (DDP, FSDP) on CPU with gloo, torch.compile, mixed precision."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import small_model
from continuumlm import ConfigError
from continuumlm.data.batches import BatchSampler
from continuumlm.train import Trainer
from continuumlm.train.logging import read_metrics
from test_train import tiny_cfg

CLI = str(Path(sys.executable).parent / "continuumlm")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "continuumlm"]


def tiny_args(corpus, *extra):
    sets = ["data.dataset=text", f"data.path=\"{corpus}\"", "model.hidden_size=32",
            "model.num_heads=2", "model.num_layers=2", "model.dropout=0.0", "train.batch_size=4",
            "train.seq_len=16", "train.max_steps=6", "train.lr_decay_steps=6",
            "train.warmup_steps=2", "train.log_interval=1", "train.eval_interval=3",
            "train.eval_iters=2", "train.checkpoint_interval=3", "train.device=cpu",
            "train.dist_timeout_s=60", *extra]
    return sum((["--set", s] for s in sets), [])


def run(cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, **kw)
    return r


def weights(run_dir):
    return load_file(str(Path(run_dir) / "checkpoints" / "last" / "model.safetensors"))


def losses(run_dir):
    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e]


def assert_same_weights(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """One single-process run with grad_accum 2 and the two-process runs that should match it
    (same global batch of 2 x 4 sequences per step)."""
    tmp = tmp_path_factory.mktemp("dist")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the cat sat on the mat {i * 7 % 13}\n"
                              for i in range(400)))
    out = {}
    r = run([CLI, "train", "--quiet", "--out", str(tmp / "one"),
             *tiny_args(corpus, "train.grad_accum=2")])
    assert r.returncode == 0, r.stderr
    out["one"] = tmp / "one"
    r = run([*TORCHRUN, "train", "--quiet", "--out", str(tmp / "ddp"), *tiny_args(corpus)])
    assert r.returncode == 0, r.stderr
    out["ddp"] = tmp / "ddp"
    out["corpus"], out["tmp"] = corpus, tmp
    return out


@pytest.mark.slow
def test_two_processes_equal_one_process_with_the_same_global_batch(two_process_runs):
    assert_same_weights(weights(two_process_runs["one"]), weights(two_process_runs["ddp"]))
    a, b = losses(two_process_runs["one"]), losses(two_process_runs["ddp"])
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, abs=1e-5)  # rank 0 logs the mean over both ranks


@pytest.mark.slow
def test_only_rank_zero_writes(two_process_runs):
    ddp = two_process_runs["ddp"]
    assert len(read_metrics(ddp)) == len([e for e in read_metrics(two_process_runs["one"])])
    state = torch.load(ddp / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert state["world_size"] == 2 and sorted(state["sampler"]["streams"]) == [0, 1]
    assert len(state["rank_rng"]) == 2
    assert state["rank_cuda_rng"] == [None, None]  # per-rank CUDA generators, on CUDA only


@pytest.mark.slow
def test_two_process_resume_continues_the_same_losses(two_process_runs):
    tmp, corpus = two_process_runs["tmp"], two_process_runs["corpus"]
    cut = tmp / "cut"
    r = run([*TORCHRUN, "train", "--quiet", "--out", str(cut),
             *tiny_args(corpus, "train.max_steps=3")])
    assert r.returncode == 0, r.stderr
    # one process would read one of the two batch streams: half the global batch, refused
    r = run([CLI, "train", "--quiet", "--out", str(cut), "--resume", "--set", "train.max_steps=6"])
    assert r.returncode == 2 and "changes its global batch" in r.stderr, r.stderr
    # through the --nproc launcher this time
    r = run([CLI, "train", "--nproc", "2", "--quiet", "--out", str(cut), "--resume",
             "--set", "train.max_steps=6"])
    assert r.returncode == 0, r.stderr
    assert losses(cut) == losses(two_process_runs["ddp"])
    assert_same_weights(weights(cut), weights(two_process_runs["ddp"]), atol=0)


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_fsdp_shards_and_export(two_process_runs):
    tmp, corpus = two_process_runs["tmp"], two_process_runs["corpus"]
    run_dir = tmp / "fsdp"
    r = run([*TORCHRUN, "train", "--quiet", "--out", str(run_dir),
             *tiny_args(corpus, "train.strategy=fsdp")])
    assert r.returncode == 0, r.stderr
    last = run_dir / "checkpoints" / "last"
    assert (last / "sharded").is_dir() and not (last / "model.safetensors").exists()
    r = run([CLI, "eval", "--checkpoint", str(run_dir), "--which", "last"])
    assert r.returncode == 2 and "continuumlm export" in r.stderr
    r = run([CLI, "export", "--checkpoint", str(run_dir)])  # last and best
    assert r.returncode == 0, r.stderr
    assert_same_weights(weights(run_dir), weights(two_process_runs["ddp"]))
    for which in ("last", "best"):
        r = run([CLI, "eval", "--checkpoint", str(run_dir), "--which", which, "--json"])
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["results"][0]["loss"] > 0


def one_and_two_processes(runs, name, *settings, strategy="ddp"):
    """Train the same settings in one process with grad_accum 2 and in two processes (the same
    global batch); return both run folders, the two-process one with model.safetensors."""
    tmp, corpus = runs["tmp"], runs["corpus"]
    one, two = tmp / f"{name}_one", tmp / f"{name}_{strategy}"
    r = run([CLI, "train", "--quiet", "--out", str(one),
             *tiny_args(corpus, "train.grad_accum=2", "train.checkpoint_interval=100", *settings)])
    assert r.returncode == 0, r.stderr
    r = run([*TORCHRUN, "train", "--quiet", "--out", str(two),
             *tiny_args(corpus, f"train.strategy={strategy}", "train.checkpoint_interval=100",
                        *settings)])
    assert r.returncode == 0, r.stderr
    if strategy == "fsdp":
        r = run([CLI, "export", "--checkpoint", str(two)])
        assert r.returncode == 0, r.stderr
    return one, two


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_logged_consistency_and_regularizers_are_the_global_batch_s(two_process_runs):
    """Like the loss, the logged consistency and step read-out terms are the mean over every
    rank's batch, as one process with the same global batch logs them (they were rank 0's)."""
    one, ddp = one_and_two_processes(
        two_process_runs, "terms", "model.depth=ode", "model.num_layers=1",
        "model.ode_solver=euler", "model.ode_steps=2", "train.elastic.steps=[2, 4]",
        "train.elastic.consistency_weight=0.5", "train.regularize.step_readout_weight=0.1", "train.max_steps=3")
    rows = [[e for e in read_metrics(d) if "loss" in e] for d in (one, ddp)]
    for name in ("consistency", "step_readout"):
        a = [e[name] for e in rows[0] if name in e]
        b = [e[name] for e in rows[1] if name in e]
        assert len(a) == len(b) >= 1 and a[-1] > 0, name
        assert a == pytest.approx(b, rel=1e-4, abs=0), name
    assert_same_weights(weights(one), weights(ddp))


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_fsdp_continuous_mixer_with_sobolev_penalty_matches_one_process(two_process_runs):
    """The trainer adds the mixers' penalty outside forward, where FSDP holds each weight as a
    shard: the penalty must still be the whole model's and its gradient the one-process one."""
    one, sharded = one_and_two_processes(
        two_process_runs, "cat", "model.mixer=continuous", "model.cat_n_freq=8",
        "model.cat_n_quad=8", "model.cat_sob_lambda=0.05", "model.position=none",
        "train.max_steps=3", strategy="fsdp")
    penalties = [[e["penalty"] for e in read_metrics(d) if "loss" in e] for d in (one, sharded)]
    assert penalties[0] == pytest.approx(penalties[1], rel=1e-5)
    assert penalties[0][-1] > 0
    assert_same_weights(weights(one), weights(sharded))


@pytest.mark.slow
def test_adaptive_adjoint_gradients_do_not_depend_on_how_the_batch_is_split(two_process_runs):
    """An adaptive adjoint solve picks its steps from the size of the gradient it carries back
    (its atol is absolute). Scaling each micro-batch's loss by 1/grad_accum made two processes
    and one process with grad_accum 2 train different models on the same global batch."""
    one, ddp = one_and_two_processes(
        two_process_runs, "adj", "model.mixer=deltanet", "model.depth=ode", "model.num_layers=1",
        "model.ode_solver=dopri5", "model.ode_grad=adjoint", "train.max_steps=2")
    assert_same_weights(weights(one), weights(ddp))


def test_sharded_checkpoint_metadata_is_never_unpickled_freely(two_process_runs, tmp_path):
    """torch reads a sharded checkpoint's .metadata with pickle.load: a file that names
    anything but checkpoint metadata is refused before torch sees it, and damage is an error
    with status 2, not a traceback."""
    import pickle
    import shutil

    from continuumlm.runs.checkpoint import _write_manifest

    src = two_process_runs["tmp"] / "fsdp"
    if not src.exists():
        pytest.skip("needs the FSDP run of test_fsdp_shards_and_export")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name, content in (("evil", pickle.dumps(Payload())), ("damaged", b"\x80\x04garbage")):
        run_dir = tmp_path / name
        shutil.copytree(src, run_dir, symlinks=True)
        ckpt = (run_dir / "checkpoints" / "last").resolve()
        (ckpt / "model.safetensors").unlink(missing_ok=True)
        (ckpt / "sharded" / ".metadata").write_bytes(content)
        _write_manifest(ckpt, 6)  # as if written so: the manifest is no signature
        r = run([CLI, "export", "--checkpoint", str(run_dir)])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert ("not loaded" if name == "evil" else "damaged") in r.stderr
    assert not marker.exists()


def test_an_export_that_cannot_write_leaves_the_checkpoint_as_it_was(two_process_runs, tmp_path,
                                                                   monkeypatch):
    """A full disk while the consolidated weights are written: a clear error, no half-written
    file left behind, the sharded checkpoint untouched (it still exports once there is room)."""
    import errno
    import shutil

    import safetensors.torch

    from continuumlm.errors import CheckpointError
    from continuumlm.runs.checkpoint import _write_manifest, export_sharded

    src = two_process_runs["tmp"] / "fsdp"
    if not src.exists():
        pytest.skip("needs the FSDP run of test_fsdp_shards_and_export")
    run_dir = tmp_path / "full"
    shutil.copytree(src, run_dir, symlinks=True)
    ckpt = (run_dir / "checkpoints" / "last").resolve()
    (ckpt / "model.safetensors").unlink(missing_ok=True)  # as it was before its export
    _write_manifest(ckpt, 6)
    before = {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}

    def full_disk(model, filename, *args, **kwargs):
        Path(filename).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_model", full_disk)
        with pytest.raises(CheckpointError, match="(?s)unchanged.*Free some space"):
            export_sharded(run_dir)
    assert {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()} == before
    # the disk fills up after the weights are written, while the manifest is
    real_dump = json.dump

    def full_at_manifest(obj, fh, *args, **kwargs):
        fh.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(json, "dump", full_at_manifest)
        with pytest.raises(CheckpointError, match="unchanged"):
            export_sharded(run_dir)
    assert json.dump is real_dump
    assert {p: p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()} == before
    export_sharded(run_dir)
    assert_same_weights(weights(run_dir), weights(two_process_runs["ddp"]))


@pytest.mark.slow
def test_a_failing_rank_fails_the_job_with_its_error(two_process_runs, tmp_path):
    """Rank 0 cannot write its run folder (a file stands where a folder must be); rank 1 waits
    for it at a collective. The job must end non-zero with rank 0's message, not hang."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    r = run([*TORCHRUN, "train", "--quiet", "--out", str(blocker / "run"),
             *tiny_args(two_process_runs["corpus"])])
    assert r.returncode != 0
    assert "cannot write to the run folder" in r.stderr + r.stdout


def test_nproc_reports_a_bad_config_once_with_status_2(tiny_corpus, tmp_path):
    r = run([CLI, "train", "--nproc", "2", "--out", str(tmp_path / "x"),
             *tiny_args(tiny_corpus, "train.strategy=zero3")])
    assert r.returncode == 2 and "strategy" in r.stderr and "launching" not in r.stdout


@pytest.mark.slow
def test_a_divergence_under_nproc_is_reported_once(tiny_corpus, tmp_path):
    """Every rank decides to stop on the same all-reduced loss; rank 0 alone says so, and the
    job exits with the status of a user error, without the launcher's traceback."""
    r = run([CLI, "train", "--nproc", "2", "--quiet", "--out", str(tmp_path / "x"),
             *tiny_args(tiny_corpus, "train.lr=1e30", "train.warmup_steps=0",
                        "train.max_bad_steps=2")])
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("training diverged") == 1 and "Traceback" not in r.stderr


# ------------------------------------------------------------------ batch streams

def test_batch_streams_are_distinct_and_stream_zero_is_the_seed():
    data = torch.arange(10_000)
    one = BatchSampler(data, 4, 8, seed=5)
    g = torch.Generator().manual_seed(5)  # what a single generator seeded with 5 draws
    starts = torch.randint(len(data) - 8, (4,), generator=g)
    assert torch.equal(one.next()[0][:, 0], starts)
    r0, r1 = BatchSampler(data, 4, 8, 5, range(0, 1)), BatchSampler(data, 4, 8, 5, range(1, 2))
    assert not torch.equal(r0.next()[0], r1.next()[0])
    with pytest.raises(ValueError, match="same number of processes"):
        BatchSampler(data, 4, 8, 5, range(2, 4)).load_state_dict(r0.state_dict())


# ------------------------------------------------------------------ compile

def _compile_works() -> bool:
    try:
        f = torch.compile(lambda x: x * 2)
        return bool((f(torch.ones(2)) == 2).all())
    except Exception:  # noqa: BLE001
        return False


@pytest.mark.slow
def test_compiled_forward_matches_eager():
    # probed here, not in a skipif: a probe at collection compiles for every pytest run, even
    # one that selects nothing of this module (on a bare GPU machine it held collection >60 s)
    if not _compile_works():
        pytest.skip("torch.compile is unavailable here")
    m = small_model(num_layers=1, depth="ode", ode_solver="rk4", ode_steps=2)
    x = torch.randint(0, 37, (2, 12))
    with torch.no_grad():
        eager, _ = m(x)
        compiled, _ = torch.compile(m)(x)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


def test_compiled_training_saves_plain_parameter_names(tiny_corpus, tmp_path):
    tr = Trainer(tiny_cfg(tiny_corpus, "train.compile=true"), tmp_path / "c", quiet=True)
    assert tr.forward is not tr.wrapped  # compiled lazily; nothing compiled yet
    path = tr.save()
    keys = load_file(str(path / "model.safetensors")).keys()
    assert set(keys) <= set(tr.model.state_dict()) and len(keys) > 5  # tied embedding once
    assert not any("_orig_mod" in k or k.startswith("module.") for k in keys)


def test_compile_failure_falls_back_to_eager_with_one_warning(tiny_corpus, tmp_path, monkeypatch,
                                                              capsys):
    def broken_compile(module, *a, **k):
        def call(*args, **kwargs):
            raise RuntimeError("backend exploded")
        return call

    monkeypatch.setattr(torch, "compile", broken_compile)
    cfg = tiny_cfg(tiny_corpus, "train.compile=true", "train.max_steps=3", "model.dropout=0")
    res = Trainer(cfg, tmp_path / "c", quiet=True).run()
    ref = Trainer(tiny_cfg(tiny_corpus, "train.max_steps=3", "model.dropout=0"),
                  tmp_path / "e", quiet=True).run()
    err = capsys.readouterr().err
    assert err.count("torch.compile failed") == 1 and "backend exploded" in err
    assert res["val_loss"] == ref["val_loss"]
    # what ran is reported: a benchmark must not call this run compiled
    assert res["compiled"] is False and "backend exploded" in res["compile_error"]
    assert ref["compiled"] is False and ref["compile_error"] is None


# ------------------------------------------------------------------ mixed precision

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_master_weights(tiny_corpus, tmp_path, dtype):
    cfg = tiny_cfg(tiny_corpus, f"train.dtype={dtype}", "train.max_steps=4",
                   "model.depth=ode", "model.num_layers=1", "model.ode_solver=rk4",
                   "model.ode_steps=2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = Trainer(cfg, tmp_path / dtype, quiet=True)
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        res = tr.run()
    assert torch.isfinite(torch.tensor(res["val_loss"]))
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert tr.scaler.is_enabled() == (dtype == "fp16")
    if dtype == "fp16":
        assert "scaler" in torch.load(tmp_path / dtype / "checkpoints" / "last" /
                                      "trainer_state.pt", weights_only=True)


def test_autocast_keeps_the_ode_state_and_times_fp32():
    m = small_model(num_layers=1, depth="ode", ode_solver="rk4", ode_steps=2,
                    ode_time_embedding="sinusoidal")
    x = torch.randint(0, 37, (2, 8))
    seen = []  # dtype of the ODE state leaving the depth module (before the final norm, which
    # autocast runs in fp32 anyway)
    hook = m.depth.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = m.hidden_states(x)
    hook.remove()
    assert seen == [torch.float32]
    ref = m.hidden_states(x)
    assert (h - ref).abs().max() < 0.1  # bf16 matmuls, fp32 accumulation of the solve


# ------------------------------------------------------------------ GPU only

@pytest.mark.cuda
def test_cuda_training_matches_cpu_closely(tiny_corpus, tmp_path):
    cpu = Trainer(tiny_cfg(tiny_corpus, "train.max_steps=4", "model.dropout=0"),
                  tmp_path / "cpu", quiet=True).run()
    gpu = Trainer(tiny_cfg(tiny_corpus, "train.max_steps=4", "model.dropout=0",
                           "train.device=cuda", "train.dtype=fp32"),
                  tmp_path / "gpu", quiet=True).run()
    assert abs(cpu["val_loss"] - gpu["val_loss"]) < 1e-3


@pytest.mark.cuda
def test_cuda_resume_continues_the_same_losses_with_dropout(tiny_corpus, tmp_path):
    """The CUDA generator (dropout masks on the GPU) is saved per rank and restored."""
    args = ("train.device=cuda", "train.dtype=fp32", "model.dropout=0.1")
    Trainer(tiny_cfg(tiny_corpus, *args), tmp_path / "full", quiet=True).run()
    Trainer(tiny_cfg(tiny_corpus, "train.max_steps=6", *args), tmp_path / "cut", quiet=True).run()
    Trainer(tiny_cfg(tiny_corpus, *args), tmp_path / "cut", resume=True, quiet=True).run()
    state = torch.load(tmp_path / "cut" / "checkpoints" / "last" / "trainer_state.pt",
                       weights_only=True)
    assert state["rank_cuda_rng"][0] is not None
    assert losses(tmp_path / "cut") == pytest.approx(losses(tmp_path / "full"), abs=1e-5)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "auto"], ids=["type", "index0", "auto"])
def test_each_torchrun_rank_takes_its_own_gpu_with_nccl(monkeypatch, name):
    """Under torchrun, train.device = "cuda:0" (or cuda, or auto on a GPU machine) means one GPU
    per rank, cuda:LOCAL_RANK, and the nccl backend; "cuda:0" used to put every rank on GPU 0
    with gloo. CUDA and the process group are faked: this checks the choice, not the GPU."""
    from continuumlm.train import distributed as D

    chosen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.setdefault("set_device", i))
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group",
                        lambda backend, timeout: chosen.setdefault("backend", backend))
    env, device = D.setup(name, 60)
    assert (env.rank, env.local_rank, env.world_size) == (1, 1, 2)
    assert device == "cuda:1" and chosen == {"set_device": 1, "backend": "nccl"}
    # two ranks on a machine with one GPU (not bound by SLURM): one paragraph, not NCCL's
    # duplicate-GPU error
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="local rank 1 needs a GPU of its own"):
        D.setup(name, 60)
    # srun ranks with GPUs bound to each task (--gpus-per-task=1): each sees its own as cuda:0
    chosen.clear()
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert D.setup(name, 60)[1] == "cuda:0" and chosen["set_device"] == 0


def test_cpu_torchrun_ranks_use_gloo(monkeypatch):
    from continuumlm.train import distributed as D

    chosen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(D.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(D.dist, "init_process_group",
                        lambda backend, timeout: chosen.setdefault("backend", backend))
    assert D.setup("cpu", 60)[1] == "cpu" and chosen == {"backend": "gloo"}
