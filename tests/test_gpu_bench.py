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
        # kernels: two shapes x 2 lengths; decoding: 8 with the graph-replayed speculative rows
        assert len(rows) == 4 + 9 + 8 + 2, sorted(rows)
        assert rows["kernels", "wide-T130"]["H"] == 4  # the wide shape's dry-run size
        assert all(r["status"] == "done" for r in rows.values()), rows
        assert rows["kernels", "T130"]["sdpa_ms"] > 0
        baby = rows["training", "transformer_baby-bf16-compiled"]
        assert baby["compiled"] is True and baby["tokens_per_s_median"] > 0
        assert baby["mfu"] > 0 and baby["mfu_peak"] == "measured bf16 matmul"
        assert rows["decoding", "deltanet-compiled"]["compiled_tok_s"] > 0
        assert rows["decoding", "softmax-eager"]["cached_speedup"] > 0
        graphed = rows["decoding", "deltanet-graphed"]
        assert graphed["graph_tok_s"] > 0 and graphed["greedy_equal_to_eager"] is True
        # every frozen step of the timed call replayed but the warm-up (one capacity)
        assert graphed["graph_replays"] == graphed["frozen_steps"] - 1 > 0
        assert graphed["compile_failed"] is False
        assert graphed["steady_ms_per_token"] > 0  # after the warm-ups and the recording
        assert graphed["frozen_logits_within_tolerance"] is True  # against the frozen step
        for mixer in ("softmax", "deltanet"):  # both states' frozen steps replayed
            spec = rows["decoding", f"{mixer}-graphed-speculative"]
            assert spec["greedy_equal_to_eager"] is True and spec["graph_replays"] > 0
            assert spec["speculative_tok_s"] > 0 and spec["speculative_vs_graphed"] > 0
        assert all(r.get("commit") == result["commit"] for r in rows.values())
        assert rows["gpt2", "ode_euler"]["depth_ms_per_evaluation"] > 0
        assert result["gpt2"]["ode_evaluation_vs_layer"] > 0
    # nothing large under OUT: the JSON and the logs, no run folders or checkpoints
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "gpu_bench.json",
                                                     "gpu_bench.log", "pytest-cuda.log"]
    env_txt = (out / "env.txt").read_text()
    assert "torch " in env_txt and "fla for DeltaNet:" in env_txt
    # the CUDA tests, then after the benchmark the fla ones: both sessions in the one log
    assert (out / "pytest-cuda.log").read_text().count("test session starts") == 2


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


def _unpack(out: Path, tmp_path: Path) -> dict:
    import tarfile

    with tarfile.open(out / "gpu_mqar.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    return {p.stem: json.loads(p.read_text())
            for p in (tmp_path / "unpacked" / "results").glob("*.json")}


@pytest.mark.slow  # twelve toy runs side by side, then every row summarized: about 3 minutes
def test_mqar_sweep_dry_run_with_its_default_rows(tmp_path):
    """GPU_MQAR_DRY=1 with the default rows, the mixed-pairs row included (its pair counts
    once did not fit the toy sequence length): every rate of every row recorded and each row
    summarized with all five rates, into the one tarball the device returns."""
    import time

    out = tmp_path / "out"
    t0 = time.time()
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_mqar_sweep.sh")],
                       env={**_env(tmp_path), "GPU_MQAR_DRY": "1", "OUT": str(out)},
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    records = _unpack(out, tmp_path)
    for row in ("softmax_kv64", "ode_deltanet_kv64", "ode_deltanet_kv64_mixed"):
        summary = records[f"mqar-{row}"]
        assert len(summary["lr_sweep"]) == 5, summary["lr_sweep"]
        assert all(x["record"] for x in summary["lr_sweep"])
    assert time.time() - t0 < 400  # the bar is 3 minutes on an idle machine


@pytest.mark.slow
def test_a_row_that_does_not_fit_the_budget_is_named_and_not_run(tmp_path):
    """The probe measures a start-up longer than the whole budget: the row is not trained to a
    meaningless end, the calibration says why, and the sweep still ends well."""
    out = tmp_path / "out"
    env = {**_env(tmp_path), "GPU_MQAR_DRY": "1", "OUT": str(out), "ROWS": "softmax_kv64",
           "GPU_MQAR_DRY_STEPS": "100000", "GPU_MQAR_DRY_BUDGET": "3"}
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_mqar_sweep.sh")], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "softmax_kv64:" in p.stdout and "it is not run" in p.stdout
    import tarfile

    with tarfile.open(out / "gpu_mqar.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    calibration = json.loads((tmp_path / "unpacked" / "logs" / "calibration.json").read_text())
    row = calibration["rows"]["softmax_kv64"]
    assert not row["fits"] and "steps in the budget" in row["why"]
    # what it was measured on and by which command (the page reads them from the record)
    assert calibration["device"] == "cpu"
    assert calibration["command"] == "ROWS=softmax_kv64 bash bench/gpu_mqar_sweep.sh"
    assert not list((tmp_path / "unpacked" / "results").glob("mqar-softmax_kv64-lr*.json"))


def test_a_rate_stopped_before_its_first_evaluation_still_lets_its_row_be_summarized(
        tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import mqar_sweep

    monkeypatch.setattr(mqar_sweep, "RESULTS", tmp_path)
    record = {"accuracy": 0.9, "steps": 100, "max_steps": 100, "complete": True}
    (tmp_path / "mqar-x.json").write_text(json.dumps(record))
    (tmp_path / "mqar-x-lr0.01.json").write_text(json.dumps({**record, "accuracy": 0.95}))
    assert mqar_sweep.summarize("mqar-x", 3e-3, [1e-4, 1e-2]) is None  # not every rate yet
    summary = mqar_sweep.summarize("mqar-x", 3e-3, [1e-4, 1e-2], snapshot=True)
    cut = [x for x in summary["lr_sweep"] if x["record"] is None]
    assert [x["lr"] for x in cut] == [1e-4] and cut[0]["accuracy"] is None  # listed, not dropped
    assert summary["lr_best"] == 1e-2


def test_gpu_check_plans_inside_one_device_command_and_takes_a_fractional_scale():
    def plan(scale):
        return subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--plan"],
                              env={**os.environ, "PY": sys.executable,
                                   "GPU_CHECK_BUDGET_SCALE": scale},
                              capture_output=True, text=True, timeout=60)
    p = plan("1")
    assert p.returncode == 0 and int(p.stdout.split("whole command ")[1].split()[0]) <= 480
    p = plan("1.5")  # bash integer arithmetic once refused this before the bench started
    assert p.returncode == 0 and "benchmark 465 s" in p.stdout
    p = plan("abc")
    assert p.returncode == 2 and "not a positive number" in p.stderr


def test_the_most_valuable_rows_run_first_and_the_budgets_fit_the_deadline():
    """Graph-replayed decoding (never run on a GPU yet), then the kernels by GPU time, then
    the GPT-2-small target rows and training."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    order = ["decoding", "kernels", "gpt2", "training"]
    assert list(gpu_bench.BUDGETS) == order and list(gpu_bench.DRY_BUDGETS) == order
    assert sum(gpu_bench.BUDGETS.values()) <= gpu_bench.DEADLINE
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert f"BENCH_DEADLINE={gpu_bench.DEADLINE}" in script


@pytest.mark.slow
def test_a_section_dies_with_a_killed_bench(tmp_path):
    """SIGKILL of the bench's parent (a backstop timeout's last resort) leaves no section
    running on the device: the section asked the kernel to end it with its parent."""
    import signal
    import time

    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(BENCH), "--dry", "--out", str(out), "--sections",
                          "training", "--budget-scale", "10"], env=_env(tmp_path),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    child = None
    while time.time() < deadline and child is None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == p.pid:
                child = int(stat.parent.name)
        time.sleep(0.1)
    assert child is not None
    time.sleep(3)  # past the section's start-up (where it asks for the signal)
    p.send_signal(signal.SIGKILL)
    p.wait()
    def gone() -> bool:  # no process, or a zombie waiting for init to reap it
        try:
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            return True

    for _ in range(100):
        if gone():
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the section outlived its parent")


@pytest.mark.slow
def test_a_resumed_bench_keeps_the_done_rows_and_measures_the_rest(tmp_path):
    """gpu_check.sh --resume (gpu_bench.py --resume): a second command on the GPU completes what
    the first left, keeping its finished rows as they are; each run is listed."""
    env = _env(tmp_path)
    bench = [sys.executable, str(BENCH), "--out", str(tmp_path), "--dry", "--sections", "kernels"]
    subprocess.run(bench, env=env, check=True, capture_output=True, timeout=120)
    result, rows = _rows(tmp_path)
    assert [rows["kernels", k]["status"] for k in ("T64", "T130")] == ["done", "done"]
    # as a budget would leave it: T64 done (marked, to see it is kept), T130 cut short
    rows["kernels", "T64"]["sdpa_ms"] = -1.0
    rows["kernels", "T130"].update(status="skipped", reason="the section's budget ran out")
    del rows["kernels", "T130"]["chunkwise_torch_ms"]
    result["kernels"]["stopped"] = "the section's budget ran out"
    first = rows["kernels", "T64"]["commit"]  # each row names the code it measured
    assert first == result["runs"][0]["commit"]
    (tmp_path / "gpu_bench.json").write_text(json.dumps(result))
    p = subprocess.run([*bench, "--resume"], env={**env, "GPU_CHECK_COMMIT": "feedbee"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    result, rows = _rows(tmp_path)
    assert result["runs"][1]["commit"] == rows["kernels", "T130"]["commit"] == "feedbee"
    assert rows["kernels", "T64"]["commit"] == first
    assert rows["kernels", "T64"]["sdpa_ms"] == -1.0  # kept, not measured again
    assert rows["kernels", "T130"]["status"] == "done"
    assert rows["kernels", "T130"]["chunkwise_torch_ms"] > 0
    assert "stopped" not in result["kernels"]
    assert [r["command"] for r in result["runs"]] == [
        "GPU_CHECK_DRY=1 GPU_CHECK_SECTIONS='kernels' bash bench/gpu_check.sh",
        "GPU_CHECK_DRY=1 GPU_CHECK_SECTIONS='kernels' bash bench/gpu_check.sh --resume"]
    assert result["runs"][1]["sections"] == ["kernels"]
    # everything done: a resume runs no section
    p = subprocess.run([*bench, "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "0 rows done, 0 planned" in p.stdout, p.stdout + p.stderr
    # records of another machine are not resumed
    result["device"] = "NVIDIA H200"
    (tmp_path / "gpu_bench.json").write_text(json.dumps(result))
    p = subprocess.run([*bench, "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "measured on NVIDIA H200" in p.stderr
    # and gpu_check.sh --resume without records to resume says so
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--resume"],
                       env={**env, "GPU_CHECK_RESUME_FROM": str(tmp_path / "none.json"),
                            "OUT": str(tmp_path / "out")}, capture_output=True, text=True)
    assert p.returncode == 2 and "no " in p.stderr and "none.json" in p.stderr


@pytest.mark.slow
def test_collecting_the_cuda_tests_compiles_nothing(tmp_path):
    """gpu_check.sh runs `pytest -m cuda tests`: collecting the suite must not compile (a
    compile probe in a skipif ran at collection and held a bare GPU machine past the tests'
    time limit)."""
    plugin = tmp_path / "count_compiles.py"
    calls = tmp_path / "calls"
    plugin.write_text(
        "import torch\n"
        "_orig = torch.compile\n"
        "def _counting(*a, **k):\n"
        f"    open({str(calls)!r}, 'a').write('compile\\n')\n"
        "    return _orig(*a, **k)\n"
        "torch.compile = _counting\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-m", "cuda",
                        "-p", "no:cacheprovider", "-p", "count_compiles", "tests"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT / 'src'}"},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "selected" in p.stdout
    assert not calls.exists(), "collecting the tests called torch.compile"


def test_the_gpu_section_says_each_target_from_its_record():
    """docs/results.md's GPU section: each target met, missed (with its figure) or not measured
    (with why), and every row that did not finish named; never a number the record lacks."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_page

    def kernel(T, sdpa, torch_ms, fla=None, status="done", **kw):
        # GPU times (CUDA events); the host's clock, which reads its own launches too, slower
        return {"row": f"T{T}", "T": T, "status": status, "B": 4, "H": 8, "D": 64,
                "commit": "0123456789abcdef",
                "sdpa_gpu_ms": sdpa, "chunkwise_torch_gpu_ms": torch_ms,
                "chunkwise_fla_gpu_ms": fla,
                **{f"{k}_ms": None if v is None else v + 5.0 for k, v in
                   (("sdpa", sdpa), ("chunkwise_torch", torch_ms), ("chunkwise_fla", fla))},
                **kw}

    r = {"device": "GPU X", "gpt2": {"rows": [
        {"row": "discrete", "status": "done", "mfu": 0.30, "depth_ms_per_evaluation": 2.0},
        {"row": "ode_euler", "status": "done", "mfu": 0.31, "depth_ms_per_evaluation": 2.4}],
        "ode_evaluation_vs_layer": 1.2},
        "kernels": {"rows": [kernel(1024, 1.0, 3.0), kernel(4096, 9.0, 8.0, fla=2.0),
                             kernel(16384, 90.0, 30.0)]},
        "decoding": {"rows": [{"row": "softmax-eager", "mixer": "softmax", "status": "done",
                               "cached_tok_s": 50.0, "recompute_tok_s": 25.0}]}}
    t = gpu_page.targets(r)
    assert "30.0% MFU" in t["mfu"] and "missed" in t["mfu"]
    assert "1.20x" in t["evaluation"] and "missed" in t["evaluation"]
    assert "is faster than SDPA from T = 4096" in t["kernels"] and "met" in t["kernels"]
    assert "0.22x at T = 4096, 0.33x at T = 16384" in t["kernels"]  # the best kernel's ratio
    assert t["rows"] == "all 6 rows are done"
    assert "2.00x recompute" in gpu_page.conclusion(r)
    # slower at one long length: missed; a long length cut short: not measured, with why
    r["kernels"]["rows"][2]["chunkwise_torch_gpu_ms"] = 100.0
    assert "is not faster" in gpu_page.targets(r)["kernels"]
    assert "1.11x at T = 16384" in gpu_page.targets(r)["kernels"]
    # ... unless fla, usable there, was not timed: then it is not settled
    r["fla"] = True
    assert "not settled" in gpu_page.targets(r)["kernels"]
    del r["fla"]
    r["kernels"]["rows"][2] = kernel(16384, None, None, status="skipped", reason="budget spent")
    t = gpu_page.targets(r)
    assert "not measured yet (budget spent)" in t["kernels"]
    assert t["rows"] == "5 of 6 rows are done (not: T16384)"
    table = gpu_page.kernels_table(r)
    assert "| 4096 | 4x8x64 | GPU (CUDA events) | 9 | 8 | 2 |  | 0.22 | done (0123456) |" in table
    # a row of a record from before commit stamps says so: it may predate the code
    r["kernels"]["rows"][0].pop("commit")
    assert "done (commit not recorded)" in gpu_page.kernels_table(r)
    # rows timed by the host's clock alone (older records) give no verdict, and say so
    host = {"rows": [{k: v for k, v in x.items() if "_gpu_" not in k}
                     for x in r["kernels"]["rows"][:2]]
            + [kernel(16384, 90.0, 30.0) | {"sdpa_gpu_ms": None}]}
    t = gpu_page.targets({**r, "kernels": host})
    assert "not settled" in t["kernels"] and "host's clock" in t["kernels"]
    assert "met" not in t["kernels"] and "missed" not in t["kernels"]
    assert "host (wall clock)" in gpu_page.kernels_table({**r, "kernels": host})
    # flash-linear-attention's benchmark shape decides where the record has it
    wide = [dict(x, row="wide-" + x["row"]) for x in
            (kernel(4096, 9.0, 20.0), kernel(16384, 90.0, 100.0))]
    t = gpu_page.targets({**r, "kernels": {"rows": r["kernels"]["rows"][:2] + wide}})
    assert "is not faster" in t["kernels"] and "2.22x at T = 4096" in t["kernels"]
    assert "skipped: budget spent" in table
    # an interrupted training run shows no loss as if it were the finished figure
    r["training"] = {"rows": [{"row": "deltanet-bf16-compiled", "config": "deltanet",
                               "dtype": "bf16", "compile": True, "status": "interrupted",
                               "val_loss": 4.18}]}
    assert "4.18" not in gpu_page.training_table(r)
    # a run stopped by a signal has no seconds; the section still renders
    r["runs"] = [{"command": "bash bench/gpu_check.sh", "started": "then", "seconds": None}]
    assert "`bash bench/gpu_check.sh` (then UTC)" in "\n".join(gpu_page.section(r))


def test_a_dry_runs_gpu_record_is_not_published(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_page

    (tmp_path / "gpu_bench.json").write_text(json.dumps({"dry_run": True, "device": "cpu"}))
    assert gpu_page.load(tmp_path / "gpu_bench.json") is None
    assert gpu_page.load(tmp_path / "none.json") is None


def test_each_device_keeps_a_record_and_a_section_of_its_own(tmp_path, monkeypatch):
    """bench/results/gpu/<device>/gpu_bench.json, the folder named from the device as
    gpu_check.sh names it: every device's record is read (a dry run's is not), in folder order,
    and the first is the one the README's finding reads."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_page

    assert gpu_page.device_folder("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-')" in script
    monkeypatch.setattr(gpu_page, "GPU_RESULTS", tmp_path)
    for name, dry in (("NVIDIA H200", False), ("NVIDIA H100 80GB HBM3", False), ("cpu", True)):
        folder = tmp_path / gpu_page.device_folder(name)
        folder.mkdir()
        (folder / "gpu_bench.json").write_text(json.dumps({"device": name, "dry_run": dry}))
    assert [r["device"] for r in gpu_page.records()] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert gpu_page.load()["device"] == "NVIDIA H100 80GB HBM3"
    assert gpu_page.heading(gpu_page.records()[0]) != gpu_page.heading(gpu_page.records()[1])


def test_mqar_calibration_fits_each_rows_schedule_to_the_budget(tmp_path):
    """bench/mqar_calibrate.py: a row's step time is its slowest rate's (median of the logged
    windows after the first), its evaluation time the longest logged, its start-up the longest
    remainder of a rate that ran the whole probe; the step limit fits the budget with the
    evaluations and a margin, never above the config's; a rate that logged nothing is named."""
    import math

    sys.path.insert(0, str(ROOT / "bench"))
    import mqar_calibrate as mc

    from continuumlm.config import load_config

    config = ROOT / "configs" / "mqar" / "ode_deltanet_kv64.toml"
    cfg = load_config(config)
    t = cfg.train
    tokens = t.batch_size * cfg.mqar.seq_len  # 64 x 256
    probe, results = tmp_path / "probe", tmp_path / "probe_results"
    results.mkdir()

    def rate(lr, s_step, steps, eval_s=0.5, first=10.0, early=False):
        name = f"mqar-ode_deltanet_kv64-probe-lr{lr}"
        (probe / name).mkdir(parents=True)
        lines = [{"step": 5, "tokens_per_s": tokens * 5 / first}]
        for s in range(10, steps + 1, 5):
            lines.append({"step": s, "tokens_per_s": tokens / s_step})
            if s % 50 == 0:
                lines.append({"step": s, "accuracy": 0.5, "eval_s": eval_s})
        (probe / name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        if early:
            (results / f"{name}.json").write_text("{}")

    rate("0.0001", 0.02, 1000)  # start-up 45 - 20 - 20 x 0.5 = 15 s
    rate("0.01", 0.05, 500, eval_s=0.8)  # the slowest steps and evaluations: 45 - 25 - 8 = 12
    rate("0.0022", 0.01, 200, early=True)  # reached the recall at 2 s: its 41 s is no start-up
    out = mc.calibrate([config], probe, 45, 300, results)
    row = out["rows"]["ode_deltanet_kv64"]
    assert row["seconds_per_step"] == pytest.approx(0.05) and row["eval_s"] == 0.8
    assert row["startup_s"] == pytest.approx(15) and row["fits"]
    sets = row["sets"]
    steps, every = sets["train.max_steps"], sets["train.eval_interval"]
    run_s = 15 + 0.05 * steps + math.ceil(steps / every) * 0.8
    assert run_s <= 300 and run_s >= 15 + 0.8 * (300 - 15) * mc.MARGIN  # fits, and not wastefully
    assert math.ceil(steps / every) <= math.ceil(t.max_steps / t.eval_interval)
    assert sets["train.warmup_steps"] == round(t.warmup_steps * steps / t.max_steps)
    # a fast machine runs the config's own schedule, never more
    fast = mc.plan(cfg, 1e-4, 5, 300, 0.01)
    assert (fast["train.max_steps"], fast["train.eval_interval"]) == (t.max_steps, t.eval_interval)
    # slow evaluations are made fewer: at most a fifth of the time
    slow = mc.plan(cfg, 0.01, 0, 300, 5.0)
    n = math.ceil(slow["train.max_steps"] / slow["train.eval_interval"])
    assert n * 5.0 <= mc.EVAL_SHARE * 300 * mc.MARGIN + 5.0
    # a rate that logged no step is named and left out; a row with none does not fit
    (probe / "mqar-ode_deltanet_kv64-probe-lr0.00046").mkdir()
    row = mc.calibrate([config], probe, 45, 300, results)["rows"]["ode_deltanet_kv64"]
    assert row["fits"] and row["no_step_in_probe"] == ["mqar-ode_deltanet_kv64-probe-lr0.00046"]
    empty = tmp_path / "empty"
    (empty / "mqar-ode_deltanet_kv64-probe-lr0.01").mkdir(parents=True)
    row = mc.calibrate([config], empty, 45, 300)["rows"]["ode_deltanet_kv64"]
    assert not row["fits"] and "PROBE" in row["why"]
    row = mc.calibrate([config], tmp_path / "nothing", 45, 300)["rows"]["ode_deltanet_kv64"]
    assert not row["fits"] and "PROBE" in row["why"]
    # a short config (a toy dry run's 4 steps) fits at its own length
    toy = load_config(config, ["train.max_steps=4"])
    assert mc.plan(toy, 0.01, 1, 60, 0.1)["train.max_steps"] == 4


def test_the_readme_gpu_finding_names_the_kernels_only_when_all_long_lengths_were_timed(
        monkeypatch):
    """README's GPU finding: the DeltaNet-vs-SDPA ratio at each length from 4096, from the
    record, and nothing about kernels while a long length (or fla, usable there) is untimed."""
    sys.path.insert(0, str(ROOT / "bench"))
    import findings
    import gpu_page

    def kernel(T, sdpa, torch_ms, fla=None):
        return {"row": f"T{T}", "T": T, "status": "done", "sdpa_gpu_ms": sdpa,
                "chunkwise_torch_gpu_ms": torch_ms, "chunkwise_fla_gpu_ms": fla}

    r = {"device": "GPU X", "fla": True, "gpt2": {"rows": [
        {"row": "discrete", "status": "done", "mfu": 0.40},
        {"row": "ode_euler", "status": "done", "mfu": 0.42}], "ode_evaluation_vs_layer": 0.98},
        "kernels": {"rows": [kernel(1024, 0.5, 7.0, 2.5), kernel(4096, 0.8, 17.0, 2.4),
                             kernel(16384, 8.0, 63.0, 2.0)]}}
    monkeypatch.setattr(gpu_page, "load", lambda *a, **k: r)
    text = findings.gpu({})
    assert "takes 3.00x at T = 4096, 0.25x at T = 16384" in text
    assert "host's clock" not in text
    assert "T = 1024" not in text  # below the target's lengths
    for x in r["kernels"]["rows"]:  # an older record, timed by the host's clock: said so
        for k in [k for k in x if k.endswith("_gpu_ms")]:
            x[k[:-7] + "_ms"] = x.pop(k)
    assert "takes 3.00x at T = 4096, 0.25x at T = 16384 by the host's clock" in findings.gpu({})
    r["kernels"]["rows"][2]["chunkwise_fla_ms"] = None  # fla usable but not timed there
    assert "SDPA" not in findings.gpu({})


def test_the_mqar_finding_says_the_gpu_sweeps_time_from_its_calibration(tmp_path, monkeypatch):
    """README's MQAR finding: with a GPU calibration record (bench/gpu_mqar_sweep.sh's, copied
    to bench/results/gpu/), the minutes the sweep's whole schedules take there, from the
    slowest row's measured step; a CPU dry run's calibration says nothing about a GPU."""
    sys.path.insert(0, str(ROOT / "bench"))
    import findings

    monkeypatch.setattr(findings, "RESULTS", tmp_path)
    results = {f"mqar-{k}": {"accuracy": a} for k, a in
               (("deltanet_kv64", 0.992), ("softmax_kv64_mixed", 0.99),
                ("ode_deltanet_kv64", 0.947))}
    assert "that sweep needs a GPU" in findings.mqar(results)
    (tmp_path / "gpu").mkdir()
    cal = {"device": "GPU X", "rows": {
        "a": {"seconds_per_step": 0.2, "config_max_steps": 20000},
        "b": {"seconds_per_step": 0.3, "config_max_steps": 10000}}}
    (tmp_path / "gpu" / "mqar_calibration.json").write_text(json.dumps(cal))
    assert "on one GPU X, needs about 67 minutes" in findings.mqar(results)
    (tmp_path / "gpu" / "mqar_calibration.json").write_text(json.dumps({**cal, "device": "cpu"}))
    assert "that sweep needs a GPU" in findings.mqar(results)


def test_the_decoding_table_shows_graph_replay_apart_from_eager_and_compiled():
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_page

    rows = [{"row": "softmax-eager", "mixer": "softmax", "status": "done", "new_tokens": 256,
             "cached_tok_s": 50.0, "recompute_tok_s": 25.0},
            {"row": "softmax-compiled", "mixer": "softmax", "status": "done",
             "compiled_tok_s": 60.0, "compile_first_call_s": 20.0},
            {"row": "softmax-graphed", "mixer": "softmax", "status": "done",
             "graph_tok_s": 500.0, "greedy_equal_to_eager": True, "frozen_steps": 255,
             "graph_replays": 254, "compile_failed": False},
            {"row": "softmax-compiled-graphed", "mixer": "softmax", "status": "error",
             "graph_error": "RuntimeError: x"},
            {"row": "deltanet-compiled-graphed", "mixer": "deltanet", "status": "done",
             "graph_tok_s": 400.0, "greedy_equal_to_eager": True, "frozen_steps": 255,
             "graph_replays": 0, "compile_failed": True}]
    table = gpu_page.decoding_table({"decoding": {"rows": rows}})
    line = next(t for t in table.splitlines() if t.startswith("| softmax"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[8:11] == ["500", "", "10.0x"], cells
    assert cells[11] == "graphed: yes, 254/255 steps replayed"
    line = next(t for t in table.splitlines() if t.startswith("| deltanet"))
    assert ("compiled-graphed: yes, 0/255 steps replayed, compiling failed (eager units)"
            in line)
    assert "compiled-graphed error" in cells[12] and "eager done" in cells[12]
