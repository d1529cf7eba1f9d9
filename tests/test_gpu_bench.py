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


@pytest.mark.slow  # end to end, several processes: make test-slow
def test_dry_run_measures_every_section_and_can_run_again(tmp_path):
    out = tmp_path / "out"
    # generous budgets: a loaded CI machine must not turn slowness into skipped rows
    env = {**_env(tmp_path), "GPU_CHECK_DRY": "1", "OUT": str(out),
           "GPU_CHECK_BUDGET_SCALE": "10"}
    for _ in range(2):  # a second run into the same folder starts afresh
        p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        result, rows = _rows(out)
        assert result["dry_run"] is True
        assert len(rows) == 2 + 9 + 4 + 2, sorted(rows)
        assert all(r["status"] == "done" for r in rows.values()), rows
        assert rows["kernels", "T130"]["sdpa_ms"] > 0
        baby = rows["training", "transformer_baby-bf16-compiled"]
        assert baby["compiled"] is True and baby["tokens_per_s_median"] > 0
        assert baby["mfu"] > 0 and baby["mfu_peak"] == "measured bf16 matmul"
        assert rows["decoding", "deltanet-compiled"]["compiled_tok_s"] > 0
        assert rows["decoding", "softmax-eager"]["cached_speedup"] > 0
        assert rows["gpt2", "ode_euler"]["depth_ms_per_evaluation"] > 0
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
    # stopped before it planned its rows (still importing) or after: none is left pending or
    # running, and not all of them are done
    statuses = {r["status"] for (s, _), r in rows.items() if s == "training"}
    assert statuses <= {"done", "interrupted", "skipped"}
    assert not statuses or statuses - {"done"}
    # the next section was still given its turn: run under what was left of its own budget
    # and of the deadline, or recorded as skipped when nothing was left
    assert result["gpt2"]["budget_s"] <= 0.8
    assert "ran out" in result["gpt2"]["stopped"] or "deadline" in result["gpt2"]["stopped"]
    assert all(r["status"] == "skipped" for r in result["gpt2"]["rows"])


def test_a_stopped_bench_stops_its_section_and_marks_its_rows(tmp_path):
    """gpu_check.sh's timeout (or Ctrl-C) stops the parent: the running section's child is
    stopped with it (it runs in its own process group) and its rows are marked."""
    import signal
    import time

    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(BENCH), "--dry", "--out", str(out), "--sections",
                          "training", "gpt2", "--budget-scale", "10"], env=_env(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until the training section has planned its rows
        try:
            if json.loads((out / "gpu_bench.json").read_text()).get("training"):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 128 + signal.SIGTERM, p.stdout.read()[-3000:]
    result, rows = _rows(out)
    assert "stopped by SIGTERM" in result["training"]["stopped"]
    statuses = [r["status"] for (s, _), r in rows.items() if s == "training"]
    assert not {"pending", "running"} & set(statuses) and "gpt2" not in result


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
