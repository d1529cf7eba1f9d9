import subprocess
import sys
from pathlib import Path

import pytest
import torch

from continuumlm.data.mqar import mqar_batch

CLI = str(Path(sys.executable).parent / "continuumlm")


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
    r = subprocess.run([CLI, "mqar", "--config", str(cfg), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "recall accuracy" in r.stdout and (tmp_path / "run" / "result.json").is_file()
    r = subprocess.run([CLI, "mqar", "--config", str(cfg), "--set", "mqar.seq_len=8"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and "too short" in r.stderr
