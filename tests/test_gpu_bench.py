"""bench/gpu_check.sh and bench/gpu_bench.py on the CPU: the dry run proves the plumbing of the
one GPU run a session may get (sections, budgets, interruption, the JSON it keeps)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny_corpus

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gpu_bench.py"


def _env(tmp_path: Path) -> dict:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_tiny_corpus(data / "tinyshakespeare.txt")
    return {**os.environ, "CONTINUUMLM_DATA": str(data), "PY": sys.executable,
            "PYTHONPATH": str(ROOT / "src")}


def _rows(out: Path) -> dict:
    result = json.loads((out / "gpu_bench.json").read_text())
    return result, {(s, r["row"]): r for s in ("kernels", "training", "decoding", "gpt2")
                    if s in result for r in result[s]["rows"]}


def test_dry_run_measures_every_section_and_can_run_again(tmp_path):
    out = tmp_path / "out"
    env = {**_env(tmp_path), "GPU_CHECK_DRY": "1", "OUT": str(out)}
    for _ in range(2):  # a second run into the same folder starts afresh
        p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        result, rows = _rows(out)
        assert result["dry_run"] is True
        assert len(rows) == 2 + 9 + 2 + 2 and all(r["status"] == "done" for r in rows.values())
        assert rows["kernels", "T130"]["sdpa_ms"] > 0
        baby = rows["training", "transformer_baby-bf16-compiled"]
        assert baby["compiled"] is True and baby["tokens_per_s_median"] > 0
        assert baby["mfu"] > 0 and rows["decoding", "deltanet"]["compiled_tok_s"] > 0
        assert result["gpt2"]["ode_evaluation_vs_layer"] > 0
    # nothing large under OUT: the JSON and the logs, no run folders or checkpoints
    assert sorted(p.name for p in out.iterdir()) == ["gpu_bench.json", "gpu_bench.log",
                                                     "pytest-cuda.log"]


def test_a_section_past_its_budget_is_stopped_and_its_rows_marked(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(BENCH), "--dry", "--out", str(out), "--sections",
                        "training", "gpt2", "--budget-scale", "0.02"], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    result, rows = _rows(out)
    assert "budget of 1 s ran out" in result["training"]["stopped"]
    statuses = {r["status"] for (s, _), r in rows.items() if s == "training"}
    assert statuses <= {"done", "interrupted", "skipped"} and statuses - {"done"}
    # the next section still ran (its own budget, its own process)
    assert "gpt2" in result and result["gpt2"]["budget_s"] == 0.8


def test_an_interrupted_training_run_is_not_recorded_as_a_result(tmp_path, monkeypatch):
    """The trainer turns SIGTERM into a clean return; the benchmark must record that row as
    interrupted (no throughput, no MFU) and stop the section instead of training the rest."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench
    import torch

    from continuumlm.train import Trainer

    ran = []

    def interrupted_run(self):
        ran.append(self.out.name)
        return {"step": 2, "val_loss": 4.0, "interrupted": "SIGTERM", "parameters": 1,
                "compiled": False, "compile_error": None, "skipped_steps": 0}

    monkeypatch.setattr(Trainer, "run", interrupted_run)
    out = tmp_path / "out"
    out.mkdir()
    sec = gpu_bench.Section(out, "training", dry=True)
    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    with pytest.raises(SystemExit):
        gpu_bench.training(sec, torch.device("cpu"), str(corpus), tmp_path / "runs")
    _, rows = _rows(out)
    first = rows["training", "transformer_baby-fp32"]
    assert ran == ["transformer_baby-fp32"] and first["status"] == "interrupted"
    assert "mfu" not in first and all(r["status"] == "pending" for k, r in rows.items()
                                      if k[1] != "transformer_baby-fp32")


def test_a_failing_measurement_keeps_the_rest_of_its_row(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    sec = gpu_bench.Section(tmp_path, "kernels", dry=True)
    sec.plan("T1")
    sec.measure("T1", "a_ms", lambda: 1.5)
    sec.measure("T1", "b_ms", lambda: 1 / 0)
    sec.measure("T1", "c_ms", lambda: 2.5)
    sec.finish("T1")
    _, rows = _rows(tmp_path)
    row = rows["kernels", "T1"]
    assert (row["a_ms"], row["c_ms"], row["status"]) == (1.5, 2.5, "error")
    assert "ZeroDivisionError" in row["b_ms_error"]
