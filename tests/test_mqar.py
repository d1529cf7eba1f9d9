import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import continuumlm.train.mqar_results as R
from conftest import run_cli
from continuumlm.data.mqar import mqar_batch


def test_mqar_structure():
    N, V, T = 6, 64, 48
    x, y = mqar_batch(50, V, T, N, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (50, T)
    for row_x, row_y in zip(x, y):
        keys, values = row_x[0:2 * N:2], row_x[1:2 * N:2]
        assert len(set(keys.tolist())) == N and (keys < V // 2).all() and (values >= V // 2).all()
        table = dict(zip(keys.tolist(), values.tolist()))
        q = (row_y >= 0).nonzero().flatten()
        assert len(q) == N and (q >= 2 * N).all()
        for pos in q.tolist():  # the target after a query key is that key's value
            assert row_y[pos].item() == table[row_x[pos].item()]
        assert sorted(row_x[q].tolist()) == sorted(keys.tolist())


def test_mqar_is_seeded_and_power_law_prefers_near_queries():
    a = mqar_batch(200, 128, 128, 8, generator=torch.Generator().manual_seed(3))
    b = mqar_batch(200, 128, 128, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    pos = (a[1] >= 0).nonzero()[:, 1].float()
    region = torch.arange(16, 128, 2).float()
    assert pos.mean() < region.mean()  # skewed towards the key-value pairs


def test_mqar_bad_sizes():
    with pytest.raises(ValueError, match="too short"):
        mqar_batch(1, 256, 20, 8)
    with pytest.raises(ValueError, match="fewer than"):
        mqar_batch(1, 8, 64, 8)


def test_query_distances_match_a_search_for_each_key():
    from continuumlm.data.mqar import query_distances

    N = 5
    x, y = mqar_batch(40, 64, 64, N, generator=torch.Generator().manual_seed(1))
    expected = []
    for row_x, row_y in zip(x, y):
        for pos in (row_y >= 0).nonzero().flatten().tolist():
            key_pos = row_x[:2 * N].tolist().index(row_x[pos].item())
            expected.append(pos - key_pos)
    assert query_distances(x, y, N).tolist() == expected
    assert min(expected) >= 2  # a query comes after every pair, its key at an even position
    with pytest.raises(ValueError, match="num_kv_pairs"):
        query_distances(x, y, 2)  # too few pairs: some query keys are not among them


def test_recall_accuracy_equals_argmax_of_the_full_logits():
    from conftest import small_model
    from continuumlm.data.mqar import query_hits, recall_accuracy

    m = small_model(vocab_size=64)
    x, y = mqar_batch(10, 64, 32, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _ = m(x)  # small_model is in eval mode
    m.train()
    mask = y >= 0
    y[:5][mask[:5]] = logits[:5].argmax(-1)[mask[:5]]  # right answers in half the sequences
    want = (logits.argmax(-1)[mask] == y[mask])
    assert 0 < want.float().mean() < 1
    assert torch.equal(query_hits(m, x, y, batch_size=3), want)  # batches not dividing 10
    assert recall_accuracy(m, x, y) == pytest.approx(want.float().mean().item())
    assert m.training  # the mode it was in is kept


def test_mqar_cli_smoke(tmp_path):
    cfg = tmp_path / "m.toml"
    cfg.write_text("""
[model]
hidden_size = 32
num_heads = 2
num_layers = 1
mixer = "deltanet"
[mqar]
vocab_size = 64
seq_len = 32
num_kv_pairs = 4
train_examples = 256
test_examples = 64
[train]
max_steps = 8
batch_size = 16
eval_interval = 4
device = "cpu"
""")
    r = run_cli("mqar", "--config", cfg, "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert "recall accuracy" in r.stdout and (tmp_path / "run" / "result.json").is_file()
    r = run_cli("mqar", "--config", cfg, "--set", "mqar.seq_len=8", cwd=tmp_path)
    assert r.returncode == 2 and "too short" in r.stderr


def test_query_loss_equals_the_full_forward_loss():
    """MQAR's objective, the head at the query positions only, is the full forward's loss."""
    from conftest import small_model

    m = small_model(vocab_size=64)
    x, y = mqar_batch(4, 64, 32, 4, generator=torch.Generator().manual_seed(0))
    _, full = m(x, y)
    torch.testing.assert_close(m(x, y, targets_only=True)[1], full, rtol=1e-6, atol=1e-6)


def _mqar_cfg(*extra):
    from continuumlm import load_config

    return load_config(None, [
        "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1", "mqar.vocab_size=64",
        "mqar.seq_len=32", "mqar.num_kv_pairs=4", "mqar.train_examples=96",
        "mqar.test_examples=32", "train.max_steps=8", "train.batch_size=16",
        "train.eval_interval=4", "train.log_interval=1", "train.device=cpu", *extra])


def _dies_at_evaluation(n: int, evaluate):
    """``evaluate``, except that its n-th call interrupts the run as a killed process would."""
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return evaluate(*a, **k)
    return wrapped


def test_mqar_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    import continuumlm.train.mqar as M
    from continuumlm.train.logging import read_metrics

    full = M.run_mqar(_mqar_cfg(), tmp_path / "full", quiet=True)
    real = M.recall_accuracy
    # the process dies at the second evaluation (step 8)
    monkeypatch.setattr(M, "recall_accuracy", _dies_at_evaluation(2, real))
    with pytest.raises(KeyboardInterrupt):
        M.run_mqar(_mqar_cfg(), tmp_path / "cut", quiet=True)
    monkeypatch.setattr(M, "recall_accuracy", real)
    # the checkpoint written after the evaluation at step 4 (the one at step 8 never was)
    assert torch.load(tmp_path / "cut" / "checkpoints" / "last" / "trainer_state.pt",
                      weights_only=True)["step"] == 4
    # the interrupted run leaves a record of how far it got, marked unfinished
    part = R.progress(tmp_path / "cut")
    assert not part["complete"] and not part["stopped_early"]
    assert part["steps"] == 4 and part["history"] == full["history"][:1]
    assert part["parameters"] == full["parameters"] and part["accuracy"] == full["history"][0][1]
    assert json.loads((tmp_path / "cut" / "result.json").read_text())["complete"] is False
    assert R.progress(tmp_path / "nothing") is None
    assert R.progress(tmp_path / "cut", _mqar_cfg())["steps"] == 4
    with pytest.raises(ValueError, match="other settings"):
        R.progress(tmp_path / "cut", _mqar_cfg("train.lr=0.5"))
    resumed = M.run_mqar(_mqar_cfg(), tmp_path / "cut", quiet=True)
    assert resumed["history"] == full["history"] and resumed["steps"] == 8
    assert resumed["complete"] and R.progress(tmp_path / "cut") == resumed
    # a run that ended but died before writing its record is reported complete from its state
    (tmp_path / "cut" / "result.json").unlink()
    again = R.progress(tmp_path / "cut")
    assert again["complete"] and again["steps"] == 8 and again["history"] == full["history"]

    def losses(d):
        return [(e["step"], e["loss"]) for e in read_metrics(d) if "loss" in e]

    assert losses(tmp_path / "cut") == losses(tmp_path / "full")

    def evaluations(d):  # strict JSON: no NaN placeholders in the metrics file
        lines = (d / "metrics.jsonl").read_text().splitlines()
        events = [json.loads(x, parse_constant=lambda c: pytest.fail(f"{c} in metrics")) for x in lines]
        return [[e["step"], e["accuracy"]] for e in events if "accuracy" in e]

    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "full") == full["history"]
    with pytest.raises(ValueError, match="other settings"):
        M.run_mqar(_mqar_cfg("train.lr=0.5"), tmp_path / "cut", quiet=True)


@pytest.mark.slow
def test_mqar_snapshot_records_unfinished_runs(tmp_path, monkeypatch):
    """bench/mqar_runs.py --snapshot: records an interrupted run as unfinished, keeps a record
    from further along, and refuses a run made with other settings."""
    import continuumlm.train.mqar as M
    from continuumlm import load_config

    root = Path(__file__).resolve().parents[1]
    config = root / "configs" / "mqar" / "softmax_kv16.toml"
    sets = ["model.hidden_size=32", "mqar.vocab_size=64", "mqar.seq_len=32",
            "mqar.num_kv_pairs=4", "mqar.train_examples=96", "mqar.test_examples=32",
            "train.max_steps=12", "train.batch_size=16", "train.eval_interval=4",
            "train.warmup_steps=2", "train.device=cpu"]
    monkeypatch.setattr(M, "recall_accuracy", _dies_at_evaluation(3, M.recall_accuracy))
    with pytest.raises(KeyboardInterrupt):
        M.run_mqar(load_config(config, sets), tmp_path / "runs" / "mqar-softmax_kv16",
                   quiet=True)
    env = {**os.environ, "CONTINUUMLM_RUNS_DIR": str(tmp_path / "runs"),
           "CONTINUUMLM_RESULTS_DIR": str(tmp_path / "results")}

    def snapshot(*extra):
        return subprocess.run([sys.executable, str(root / "bench" / "mqar_runs.py"), "--snapshot",
                               str(config), *sum((["--set", x] for x in sets), []), *extra],
                              capture_output=True, text=True, timeout=300, env=env)

    r = snapshot()
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "results" / "mqar-softmax_kv16.json").read_text())
    assert rec["steps"] == 8 and rec["complete"] is False and rec["overrides"] == sets
    # recall by distance: every held-out query in one bucket, together the recorded accuracy
    buckets = rec["recall_by_distance"]
    assert [b["from"] for b in buckets] == list(R.DISTANCE_EDGES) and buckets[-1]["to"] is None
    assert sum(b["queries"] for b in buckets) == 32 * 4
    hits = sum(b["accuracy"] * b["queries"] for b in buckets if b["queries"])
    assert hits / (32 * 4) == pytest.approx(rec["accuracy"], abs=1e-9)
    # --by-distance adds the split to a record made without it, from the state at its step
    del rec["recall_by_distance"]
    (tmp_path / "results" / "mqar-softmax_kv16.json").write_text(json.dumps(rec))
    r = subprocess.run([sys.executable, str(root / "bench" / "mqar_runs.py"), "--by-distance",
                        str(config)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    again = json.loads((tmp_path / "results" / "mqar-softmax_kv16.json").read_text())
    assert again["recall_by_distance"] == buckets and again["steps"] == 8
    rec["steps"] = 100  # a record from further along (an earlier, longer sitting) is kept
    (tmp_path / "results" / "mqar-softmax_kv16.json").write_text(json.dumps(rec))
    r = snapshot()
    assert r.returncode == 0 and "keep" in r.stdout, r.stderr
    r = snapshot("--set", "train.lr=0.5")
    assert r.returncode != 0 and "other settings" in r.stderr
    r = subprocess.run([sys.executable, str(root / "bench" / "mqar_runs.py"), "--by-distance",
                        str(config)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode != 0 and "step 8" in r.stderr and "records step 100" in r.stderr
    # re-running the experiment keeps an unfinished record whose run folder is gone (it does
    # not train again from step 0); with the folder there, the run is continued (not tested)
    shutil.rmtree(tmp_path / "runs" / "mqar-softmax_kv16")
    before = (tmp_path / "results" / "mqar-softmax_kv16.json").read_text()
    r = subprocess.run([sys.executable, str(root / "bench" / "mqar_runs.py"), str(config),
                        *sum((["--set", x] for x in sets), [])],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "unfinished" in r.stdout and "delete" in r.stdout, r.stderr
    assert (tmp_path / "results" / "mqar-softmax_kv16.json").read_text() == before
    assert not (tmp_path / "runs" / "mqar-softmax_kv16").exists()


def test_mqar_stops_at_the_target_accuracy(tmp_path):
    from continuumlm.train.mqar import run_mqar

    r = run_mqar(_mqar_cfg("mqar.stop_accuracy=0.0"), tmp_path / "s", quiet=True)
    assert r["steps"] == 4 and r["stopped_early"]


def test_mixed_training_set_splits_examples_among_pair_counts():
    from continuumlm.data.mqar import mqar_mixed_batch, query_distances

    x, y = mqar_mixed_batch(11, 64, 48, [2, 4, 6], generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (11, 48)
    counts = (y >= 0).sum(1).tolist()  # one query per pair
    assert counts == [2] * 4 + [4] * 4 + [6] * 3
    for n, sl in ((2, slice(0, 4)), (4, slice(4, 8)), (6, slice(8, 11))):
        query_distances(x[sl], y[sl], n)  # every query key is among that row's first n pairs
    # one pair count only: the plain generator's sequences, drawn from the same stream
    a = mqar_mixed_batch(5, 64, 48, [4], generator=torch.Generator().manual_seed(1))
    b = mqar_batch(5, 64, 48, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="empty"):
        mqar_mixed_batch(5, 64, 48, [])


def test_mixed_pair_counts_config_and_run(tmp_path):
    import continuumlm.train.mqar as M
    from continuumlm import ConfigError, load_config
    from continuumlm.config import dump_toml

    cfg = _mqar_cfg("mqar.train_kv_pairs=[2, 4]")
    assert cfg.mqar.train_kv_pairs == [2, 4]
    assert load_config(None, []).mqar.train_kv_pairs == []
    text = tmp_path / "c.toml"
    text.write_text(dump_toml(cfg))  # written and read back as a TOML array
    assert load_config(text).mqar.train_kv_pairs == [2, 4]
    for bad, needle in (("[0, 4]", "positive"), ('["a"]', "list of int"), ("4", "list of int"),
                        ("[true]", "list of int")):
        with pytest.raises(ConfigError, match=needle):
            _mqar_cfg(f"mqar.train_kv_pairs={bad}")
    with pytest.raises(ConfigError, match=r"mqar.seq_len = 32 is too short for 9 key-value"):
        _mqar_cfg("mqar.train_kv_pairs=[4, 9]")
    train_x, train_y = M.train_set(cfg)
    assert sorted(set((train_y >= 0).sum(1).tolist())) == [2, 4]
    assert ((M._test_set(cfg)[1] >= 0).sum(1) == 4).all()  # held out at num_kv_pairs
    result = M.run_mqar(cfg, tmp_path / "run", quiet=True)
    assert result["train_kv_pairs"] == [2, 4] and result["num_kv_pairs"] == 4
    with pytest.raises(ValueError, match="other settings"):  # not the same run as 4 pairs only
        M.run_mqar(_mqar_cfg(), tmp_path / "run", quiet=True)


LEGACY = Path(__file__).parent / "data" / "mqar-state-pt"


def _legacy_run(tmp_path, drop_key: bool = False) -> Path:
    """A copy of a run folder the standalone MQAR loop of earlier versions wrote (its
    ``state.pt`` at step 4 of _mqar_cfg()'s 8 steps: the process died at the second
    evaluation); ``drop_key``: as saved by a version without ``mqar.train_kv_pairs``."""
    run = tmp_path / "legacy"
    shutil.copytree(LEGACY, run)
    if drop_key:
        st = torch.load(run / "state.pt", weights_only=True)
        del st["config"]["mqar"]["train_kv_pairs"]
        torch.save(st, run / "state.pt")
    return run


def _golden():
    return json.loads((Path(__file__).parent / "data" / "mqar_golden.json").read_text())


@pytest.mark.parametrize("name", ["softmax", "ode_deltanet"])
def test_mqar_on_the_trainer_reproduces_the_standalone_loop(tmp_path, name):
    """Per-step losses and held-out recall equal those of the standalone loop MQAR had before
    it became a task on the trainer (tests/data/mqar_golden.json): bit for bit on the CPU that
    recorded them, and to float32 rounding on another (other SIMD kernels round otherwise:
    ode_deltanet differs by 1e-7 relative at step 5 on another x86 CPU)."""
    import continuumlm.train.mqar as M
    from continuumlm.train.logging import read_metrics

    g = _golden()[name]
    r = M.run_mqar(_mqar_cfg(*g["set"]), tmp_path / "run", quiet=True)
    losses = [[e["step"], e["loss"]] for e in read_metrics(tmp_path / "run") if "loss" in e]
    assert [s for s, _ in losses] == [s for s, _ in g["losses"]]
    assert [v for _, v in losses] == pytest.approx([v for _, v in g["losses"]], rel=1e-5)
    assert r["history"] == g["history"] and r["parameters"] == g["parameters"]


@pytest.mark.parametrize("drop_key", [False, True])
def test_a_run_of_the_standalone_loop_is_adopted_and_continues_exactly(tmp_path, drop_key):
    """A state.pt run folder (the standalone loop's) is read as it is by progress and
    recall_by_distance, and the same command continues it on the trainer: the losses of its
    remaining steps are the uninterrupted loop's. A state saved before a config key existed
    (drop_key) takes the key's default, which is what that version did."""
    import continuumlm.train.mqar as M
    from continuumlm.train.logging import read_metrics

    run = _legacy_run(tmp_path, drop_key)
    g = _golden()["softmax"]
    part = R.progress(run, _mqar_cfg())
    assert part["steps"] == 4 and not part["complete"] and part["history"] == g["history"][:1]
    assert R.recall_by_distance(run)["step"] == 4
    with pytest.raises(ValueError, match="other settings"):
        M.run_mqar(_mqar_cfg("train.lr=0.5"), run, quiet=True)
    assert not (run / "checkpoints").exists()
    r = M.run_mqar(_mqar_cfg(), run, quiet=True)
    assert r["steps"] == 8 and r["complete"] and r["history"] == g["history"]
    assert [[e["step"], e["loss"]] for e in read_metrics(run) if "loss" in e] == g["losses"]
    assert (run / "state.pt").exists()  # kept: nothing of the old run is lost
    assert R.progress(run) == r and R.fresh_recall(run)["step"] == 8


def test_an_mqar_checkpoint_is_refused_by_eval_with_a_reason(tmp_path):
    """MQAR models have no tokenizer: eval and generate say so instead of a missing file."""
    import continuumlm.train.mqar as M
    from continuumlm import CheckpointError
    from continuumlm.train import load_model_and_tokenizer

    M.run_mqar(_mqar_cfg("train.max_steps=4"), tmp_path / "run", quiet=True)
    with pytest.raises(CheckpointError, match="MQAR task .* no tokenizer"):
        load_model_and_tokenizer(tmp_path / "run")


def test_mqar_runs_with_gradient_accumulation_and_bfloat16(tmp_path):
    """On the trainer MQAR gains its options: grad_accum splits each step's examples into
    micro-batches (the same examples as one batch of their total size: equal first loss), and
    autocast runs (bf16 on CPU)."""
    import continuumlm.train.mqar as M
    from continuumlm.train.logging import read_metrics

    def first_loss(d):
        return next(e["loss"] for e in read_metrics(d) if "loss" in e)

    M.run_mqar(_mqar_cfg("train.max_steps=2", "train.batch_size=16"), tmp_path / "one",
               quiet=True)
    M.run_mqar(_mqar_cfg("train.max_steps=2", "train.batch_size=8", "train.grad_accum=2"),
               tmp_path / "two", quiet=True)
    assert first_loss(tmp_path / "two") == pytest.approx(first_loss(tmp_path / "one"), rel=1e-5)
    r = M.run_mqar(_mqar_cfg("train.max_steps=4", "train.dtype=bf16"), tmp_path / "bf16",
                   quiet=True)
    assert r["complete"] and r["steps"] == 4
    with pytest.raises(ValueError, match="fewer than one optimizer step"):
        M.run_mqar(_mqar_cfg("train.batch_size=64", "train.grad_accum=2"), tmp_path / "big",
                   quiet=True)


def test_fresh_recall_scores_the_final_model_on_unseen_sequences(tmp_path):
    """The fresh set is neither the training set nor the held-out set that decides stopping,
    and its recall is the final model's (recomputed here from the run's own weights)."""
    import continuumlm.train.mqar as M
    from continuumlm.data.mqar import recall_accuracy

    cfg = _mqar_cfg()
    r = M.run_mqar(cfg, tmp_path / "f", quiet=True)
    fresh = R.fresh_recall(tmp_path / "f")
    assert fresh["step"] == r["steps"] == 8
    x, y = M._test_set(cfg, M.FRESH_OFFSET)
    held, train = M._test_set(cfg)[0], M.train_set(cfg)[0]
    assert not (x[:, None] == held[None]).all(-1).any()
    assert not (x[:, None] == train[None]).all(-1).any()
    from safetensors.torch import load_model

    model = M._quiet_model(cfg)  # run_mqar gave cfg the task's model settings
    load_model(model, str(tmp_path / "f" / "checkpoints" / "last" / "model.safetensors"))
    assert fresh["accuracy"] == recall_accuracy(model, x, y)


def test_example_counts_that_cannot_fit_are_refused_before_generating(tmp_path, monkeypatch):
    import continuumlm.train.mqar as M
    from continuumlm import ConfigError

    cfg = _mqar_cfg()
    # 2 GiB free: enough for the test config's sets, not for 100 million held-out sequences
    monkeypatch.setattr(M, "available_memory", lambda device: 2 * 2**30)
    M._check_data_memory(cfg.mqar)
    cfg = _mqar_cfg("mqar.test_examples=100000000")
    monkeypatch.setattr(M, "mqar_batch", None)  # generating at all would fail differently
    with pytest.raises(ConfigError, match=r"mqar.test_examples = 100,000,000 .* lower"):
        M.run_mqar(cfg, tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_mqar_under_two_processes_equals_one_process_with_accumulation(tmp_path):
    """`continuumlm mqar --nproc 2`: rank r reads slice r of each step's examples, so two
    processes train what one process with grad_accum 2 trains (equal losses and recall)."""
    from continuumlm.train.logging import read_metrics

    root = Path(__file__).resolve().parents[1]
    config = root / "configs" / "mqar" / "softmax_kv16.toml"
    sets = ["model.hidden_size=32", "model.num_heads=2", "mqar.vocab_size=64",
            "mqar.seq_len=32", "mqar.num_kv_pairs=4", "mqar.train_examples=96",
            "mqar.test_examples=32", "train.max_steps=6", "train.batch_size=8",
            "train.eval_interval=3", "train.warmup_steps=2", "train.log_interval=1",
            "train.device=cpu"]
    args = sum((["--set", x] for x in sets), [])
    cli = str(Path(sys.executable).parent / "continuumlm")
    two = subprocess.run([cli, "mqar", "--config", str(config), "--out", str(tmp_path / "two"),
                          "--nproc", "2", *args], capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr
    one = run_cli("mqar", "--config", config, "--out", tmp_path / "one", *args,
                  "--set", "train.grad_accum=2")
    assert one.returncode == 0, one.stderr

    def losses(d):
        return [e["loss"] for e in read_metrics(d) if "loss" in e]

    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    a = json.loads((tmp_path / "two" / "result.json").read_text())
    b = json.loads((tmp_path / "one" / "result.json").read_text())
    assert a["complete"] and a["steps"] == b["steps"] == 6
    assert [h[0] for h in a["history"]] == [3, 6]
    assert a["examples_seen"] == b["examples_seen"] == 6 * 16
    # sharded (FSDP): the recall is scored through the model's forward, which gathers weights
    fsdp = subprocess.run([cli, "mqar", "--config", str(config), "--out", str(tmp_path / "fsdp"),
                           "--nproc", "2", *args, "--set", "train.strategy=fsdp"],
                          capture_output=True, text=True, timeout=600)
    assert fsdp.returncode == 0, fsdp.stderr
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "one"), rel=1e-4)
    c = json.loads((tmp_path / "fsdp" / "result.json").read_text())
    assert [h[0] for h in c["history"]] == [3, 6]


def test_a_run_that_died_before_its_first_evaluation_starts_again(tmp_path, monkeypatch):
    """No checkpoint yet (the first comes with the first evaluation): the same command clears
    the run's own config.toml and metrics and starts it again; another run's files are
    refused, not cleared."""
    import continuumlm.train.mqar as M
    from continuumlm import ConfigError
    from continuumlm.train.logging import read_metrics

    real = M.recall_accuracy
    monkeypatch.setattr(M, "recall_accuracy", _dies_at_evaluation(1, real))
    with pytest.raises(KeyboardInterrupt):
        M.run_mqar(_mqar_cfg(), tmp_path / "run", quiet=True)
    monkeypatch.setattr(M, "recall_accuracy", real)
    assert (tmp_path / "run" / "config.toml").exists()
    assert not (tmp_path / "run" / "checkpoints" / "last").exists()
    with pytest.raises(ConfigError, match="already holds"):  # not this run's files
        M.run_mqar(_mqar_cfg("train.lr=0.5"), tmp_path / "run", quiet=True)
    r = M.run_mqar(_mqar_cfg(), tmp_path / "run", quiet=True)
    full = M.run_mqar(_mqar_cfg(), tmp_path / "full", quiet=True)
    assert r["history"] == full["history"]
    assert [e["loss"] for e in read_metrics(tmp_path / "run") if "loss" in e] == \
        [e["loss"] for e in read_metrics(tmp_path / "full") if "loss" in e]


def test_the_evaluated_checkpoint_survives_pruning(tmp_path, monkeypatch):
    """Checkpoints saved between evaluations (here every step, keeping one) never prune the
    one the record was made from: progress and recall_by_distance read that step."""
    import continuumlm.train.mqar as M

    sets = ("train.checkpoint_interval=1", "train.keep_checkpoints=1")
    monkeypatch.setattr(M, "recall_accuracy", _dies_at_evaluation(2, M.recall_accuracy))
    with pytest.raises(KeyboardInterrupt):
        M.run_mqar(_mqar_cfg(*sets), tmp_path / "run", quiet=True)
    root = tmp_path / "run" / "checkpoints"
    assert (root / "last").resolve().name == "step-00000007"
    assert (root / "evaluated").resolve().name == "step-00000004"
    assert R.progress(tmp_path / "run")["steps"] == 4
    assert R.recall_by_distance(tmp_path / "run")["step"] == 4


def test_a_run_continues_only_with_the_process_count_it_was_trained_with(tmp_path):
    import continuumlm.train.mqar as M
    from continuumlm import ConfigError
    from continuumlm.runs.checkpoint import load_trainer_state

    M.run_mqar(_mqar_cfg("train.max_steps=4"), tmp_path / "run", quiet=True)
    last = (tmp_path / "run" / "checkpoints" / "last").resolve()
    state = {**load_trainer_state(last), "world_size": 2}
    cfg = _mqar_cfg("train.max_steps=4")
    cfg.model = M._task_model(cfg)
    with pytest.raises(ConfigError, match="trained with 2 process.*--nproc 2"):
        M.MQARTask(cfg, tmp_path / "run", last, state)


def test_mqar_throughput_counts_its_own_sequence_length(tmp_path, capsys):
    """tokens/s counts mqar.seq_len tokens per row (train.seq_len is the language-modeling
    window, which MQAR does not read)."""
    from continuumlm.train import mqar as M

    M.run_mqar(_mqar_cfg("train.max_steps=2", "train.seq_len=8"), tmp_path / "run")
    assert "; 512 tokens per step;" in capsys.readouterr().out  # 16 rows x 32 tokens


def test_a_stopped_mqar_run_names_the_mqar_command(tmp_path, monkeypatch, capsys):
    """A signal stops an MQAR run with a checkpoint; the message names the command that
    continues it (it named `continuumlm train ... --resume auto`, which refuses an MQAR run)."""
    import continuumlm.train.mqar as M
    from continuumlm.train.signals import StopSignals

    real = StopSignals.agreed_stop

    def stop_after_two(self, dist, device, *a, **k):
        self.requested = self.requested or ("SIGTERM" if len(calls) >= 2 else None)
        calls.append(1)
        return real(self, dist, device, *a, **k)

    calls = []
    monkeypatch.setattr(StopSignals, "agreed_stop", stop_after_two)
    M.run_mqar(_mqar_cfg(), tmp_path / "run")
    out = capsys.readouterr()
    said = out.out + out.err
    assert "saved a checkpoint" in said and "continuumlm mqar --config CONFIG --out" in said
    assert "continuumlm train" not in said
    # a full disk at a checkpoint of an MQAR run says the same (it read `continuumlm train
    # ... --resume auto`)
    import continuumlm.train.checkpointer as ck
    from continuumlm.errors import DiskError

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "save_checkpoint", full)
    with pytest.raises(DiskError) as e:
        M.run_mqar(_mqar_cfg(), tmp_path / "full", quiet=True)
    assert "continuumlm mqar --config CONFIG" in str(e.value), str(e.value)
    assert "continuumlm train" not in str(e.value)


def test_a_shared_example_cache_gives_the_same_training_set_built_once(tmp_path, monkeypatch):
    """$CONTINUUMLM_MQAR_CACHE: the seeded training set of one config is built once and
    memory-mapped by every later run (a sweep's rates side by side), equal to the uncached one;
    another seed or [mqar] setting gets its own file."""
    import continuumlm.train.mqar as M

    cfg = _mqar_cfg()
    plain = M._draw_train_set(cfg)
    monkeypatch.setenv(M.EXAMPLE_CACHE, str(tmp_path / "cache"))
    built = M.train_set(cfg)
    files = list((tmp_path / "cache").glob("mqar-train-*.pt"))
    assert len(files) == 1
    calls = []
    monkeypatch.setattr(M, "_draw_train_set", lambda c: calls.append(c) or plain)
    shared = M.train_set(cfg)
    assert calls == []  # read from the file, not drawn again
    for a, b, c in zip(plain, built, shared):
        assert torch.equal(a, b) and torch.equal(a, c)
    M.train_set(_mqar_cfg("train.seed=7"))
    assert len(list((tmp_path / "cache").glob("mqar-train-*.pt"))) == 2 and len(calls) == 1


def test_a_saved_run_is_scored_on_this_machines_best_device_in_the_runs_precision(
        tmp_path, monkeypatch):
    """recall_by_distance and fresh_recall (bench/mqar_runs.py's snapshots) score on the GPU
    when there is one, under the autocast train.dtype gives there, not on the CPU: on a GPU
    machine the CPU took minutes per ODE DeltaNet run."""
    import continuumlm.train.mqar as M
    from continuumlm.train import device as D

    r = M.run_mqar(_mqar_cfg("train.dtype=bf16"), tmp_path / "run", quiet=True)
    asked = []

    def pick(name, *a):
        asked.append(name)
        return torch.device("cpu")

    def autocast(device, dtype):
        asked.append(dtype)
        return D.autocast_for(device, dtype)

    monkeypatch.setattr(R, "pick_device", pick)
    monkeypatch.setattr(R, "autocast_for", autocast)
    assert R.recall_by_distance(tmp_path / "run")["step"] == r["steps"]
    assert R.fresh_recall(tmp_path / "run")["step"] == r["steps"]
    assert asked == ["auto", "bf16", "auto", "bf16"]

