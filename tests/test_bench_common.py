"""bench/common.py: how a training run's throughput is judged shared or measured alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
common = pytest.importorskip("common")

SPIN = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < {}: pass"


@pytest.mark.slow
@pytest.mark.skipif(common.machine_busy_seconds() is None, reason="needs Linux /proc/stat")
def test_other_load_leaves_out_the_run_itself_and_counts_other_work():
    with common.OtherLoad() as idle:
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"], check=True)
    if idle.cores > 0.3:
        pytest.skip(f"other work keeps {idle.cores:.1f} cores busy: nothing here runs alone")
    # the measured child keeps one core busy: a load average would count it, OtherLoad must not
    with common.OtherLoad() as alone:
        subprocess.run([sys.executable, "-c", SPIN.format(1.0)], check=True)
    assert alone.cores is not None and alone.cores < 0.6, alone.cores
    # a process that is not the measured run spins meanwhile: that is other work
    other = subprocess.Popen([sys.executable, "-c", SPIN.format(2.5)])
    try:
        with common.OtherLoad() as shared:
            subprocess.run([sys.executable, "-c", "import time; time.sleep(1.5)"], check=True)
    finally:
        other.wait()
    assert shared.cores is not None and shared.cores > 0.6, shared.cores


def test_load_mark():
    alone, busy = {"other_cores": 0.05}, {"other_cores": 1.1}
    assert common.load_mark([alone, alone]) == ""
    assert common.load_mark([alone, busy]) == " *"
    assert common.load_mark([alone, {"other_cores": None}]) == " °"  # resumed: not known
    # older records: load averages count the run's own threads, so they never vouch for "alone"
    assert common.load_mark([{"load_average": [0.1, 0.2]}]) == " *"
    assert common.load_mark([{}]) == " °"
    assert common.load_mark([alone, {}]) == " °"
    # a row is timed by its runs measured alone, and marked only when it has none
    assert common.timed_runs([busy, alone, {"other_cores": None}]) == ([alone], "")
    # one run known shared: the row is understated whatever the other's mark
    assert common.timed_runs([busy, {"other_cores": None}]) == ([busy, {"other_cores": None}],
                                                                " *")
    assert common.timed_runs([busy, busy]) == ([busy, busy], " *")


def test_ctrl_c_lets_the_training_child_finish_saving(tmp_path):
    """Ctrl-C reaches a benchmark script and its training child together. The script must wait
    for the child to save, not kill it a moment later (subprocess.run kills after 0.25 s)."""
    import os
    import signal
    import time

    saved = tmp_path / "saved"
    child = (f"import signal, time, pathlib\n"
             f"stop = []\n"
             f"signal.signal(signal.SIGINT, lambda *a: stop.append(1))\n"
             f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
             f"while not stop: time.sleep(0.01)\n"
             f"time.sleep(1.0)  # finishing the step and writing the checkpoint\n"
             f"pathlib.Path({str(saved)!r}).touch()\n")
    # (the default handler first: a shell's background job starts with SIGINT ignored)
    parent = (f"import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / 'bench')!r})\n"
              f"from experiment import run_child\n"
              f"try:\n    run_child([sys.executable, '-c', {child!r}])\n"
              f"except KeyboardInterrupt:\n    sys.exit(130)\n")
    p = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists():
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.02)
    os.killpg(p.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    assert p.wait(timeout=60) == 130
    assert saved.exists()


def test_depth_elasticity_without_its_models_writes_nothing(tmp_path):
    import os

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CONTINUUMLM_RUNS_DIR": str(tmp_path / "runs"),
           "CONTINUUMLM_RESULTS_DIR": str(tmp_path / "results")}
    r = subprocess.run([sys.executable, str(repo / "bench" / "depth_elasticity.py")], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "experiment shakespeare" in r.stderr, r.stderr
    assert not (tmp_path / "results").exists()


def _mqar_record(acc: float, complete: bool = True, **kw) -> dict:
    return {"config": "configs/mqar/softmax_kv64.toml", "overrides": [], "mixer": "softmax",
            "depth": "discrete", "num_kv_pairs": 64, "train_kv_pairs": [], "accuracy": acc,
            "best_accuracy": acc, "steps": 100, "max_steps": 100, "complete": complete,
            "seconds": 60.0, **kw}


def test_an_mqar_learning_rate_sweep_reports_its_best_rate(tmp_path, monkeypatch):
    """bench/mqar_sweep.py: the plain record (the config's own rate) and the tagged ones are
    summarized into lr_sweep; the best complete rate wins over a higher unfinished one; the
    results page shows that rate's run as the config's row and every rate below."""
    import json

    import mqar_sweep
    import render

    monkeypatch.setattr(mqar_sweep, "RESULTS", tmp_path)
    name = "mqar-softmax_kv64"
    records = {name: _mqar_record(0.04),
               f"{name}-lr0.001": _mqar_record(0.995, overrides=["train.lr=0.001"], tag="lr0.001"),
               f"{name}-lr0.01": _mqar_record(0.999, False, overrides=["train.lr=0.01"],
                                              tag="lr0.01")}
    assert mqar_sweep.summarize(name, 3e-3, [1e-3, 1e-2]) is None  # nothing recorded yet
    for key, r in records.items():
        if key != name:
            (tmp_path / f"{key}.json").write_text(json.dumps(r))
    assert mqar_sweep.summarize(name, 3e-3, [1e-3, 1e-2]) is None  # the config's own rate
    (tmp_path / f"{name}.json").write_text(json.dumps(records[name]))
    assert mqar_sweep.summarize(name, 3e-3, [1e-3, 1e-2, 1e-4]) is None  # 1e-4 missing
    # the config's own rate (3e-3) is compared even when --lrs leaves it out
    s = mqar_sweep.summarize(name, 3e-3, [1e-3, 1e-2])
    assert s["lr_best"] == 1e-3 and [x["lr"] for x in s["lr_sweep"]] == [1e-3, 3e-3, 1e-2]
    assert s["accuracy"] == 0.04  # the plain record keeps its own run's figures
    shown = render.mqar_records({**records, name: s})
    assert len(shown) == 1 and shown[0]["accuracy"] == 0.995
    assert shown[0]["shown_lr"] == "0.001 (best of 3)"
    table = render.mqar_sweep_table({**records, name: s})
    assert table.count("\n") == 4 and "(unfinished)" in table
    # a rate run to another step limit (a schedule compressed to fit a GPU's time) is listed,
    # not ranked, however well it did
    short = _mqar_record(0.999, overrides=["train.lr=0.0001", "train.max_steps=10"],
                         tag="lr0.0001", steps=10, max_steps=10)
    (tmp_path / f"{name}-lr0.0001.json").write_text(json.dumps(short))
    s = mqar_sweep.summarize(name, 3e-3, [1e-3, 1e-2, 1e-4])
    assert s["lr_best"] == 1e-3
    assert [x["ranked"] for x in s["lr_sweep"]] == [False, True, True, True]
    records[f"{name}-lr0.0001"] = short
    assert render.mqar_records({**records, name: s})[0]["shown_lr"] == "0.001 (best of 3)"
    assert "10 of 10 (another step limit than the config's: not ranked)" in \
        render.mqar_sweep_table({**records, name: s})


def test_the_learning_rate_sweep_sets_each_model_at_its_best_rate_against_the_others():
    """bench/lr_sweep.py: seed-matched gaps at each rate, and each model at its own best rate
    (mean over the seeds) against the fixed reference at its best one."""
    import lr_sweep

    loss = {("ode_euler", "1e-3"): 1.93, ("ode_euler", "2e-3"): 1.86,
            ("ode_rk4", "1e-3"): 1.90, ("ode_rk4", "2e-3"): 1.85}
    rows = [{"model": m, "lr": lr, "seed": s, "solve": "euler" if m == "ode_euler" else "rk4",
             "val_loss": v + 0.001 * i} for (m, lr), v in loss.items()
            for i, s in enumerate(lr_sweep.SEEDS)]
    elastic = {("1e-3", "euler"): 1.94, ("1e-3", "rk4"): 1.88,
               ("2e-3", "euler"): 1.87, ("2e-3", "rk4"): 1.90}
    rows += [{"model": lr_sweep.ELASTIC, "lr": lr, "seed": s, "solve": solve,
              "val_loss": v + 0.001 * i} for (lr, solve), v in elastic.items()
             for i, s in enumerate(lr_sweep.SEEDS)]
    table = lr_sweep.gaps_table(rows)
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    assert "+0.0100 (yes; 3 seeds)" in lines["lr 1e-3, all models"]  # Euler x 4
    assert "-0.0200 (yes; 3 seeds)" in lines["lr 1e-3, all models"]  # RK4 x 4
    assert "+0.0500 (no; 3 seeds)" in lines["lr 2e-3, all models"]
    # best rates: ode_euler 2e-3 and the elastic Euler x 4 2e-3; ode_rk4 2e-3, elastic 1e-3
    euler = next(v for k, v in lines.items() if k.startswith("each at its best rate for Euler"))
    assert "(elastic 2e-3)" in euler and "+0.0100 (yes; 3 seeds)" in euler
    rk4 = next(v for k, v in lines.items() if k.startswith("each at its best rate for RK4"))
    assert "(elastic 1e-3)" in rk4 and "+0.0300 (no; 3 seeds; reference at lr 2e-3)" in rk4
    assert "1.8600 / 1.8610 / 1.8620 (mean **1.8610**)" in lr_sweep.sweep_table(rows)
    # the discrete baseline, best at 2e-3; ode_euler also tried at 5e-3 (worse than 2e-3)
    rows += [{"model": lr_sweep.DISCRETE, "lr": lr, "seed": s, "solve": "discrete",
              "val_loss": v + 0.001 * i} for lr, v in (("1e-3", 1.90), ("2e-3", 1.84))
             for i, s in enumerate(lr_sweep.SEEDS)]
    rows += [{"model": "ode_euler", "lr": "5e-3", "seed": s, "solve": "euler", "val_loss": 1.99}
             for s in lr_sweep.SEEDS]
    best = {line.split(" | ")[0].lstrip("| ") + " " + line.split(" | ")[1]: line
            for line in lr_sweep.best_table(rows).splitlines()[2:]}
    assert "| 2e-3 (top of the sweep; 0.0600 below 1e-3) | 1.8410 (3 seeds) | -0.0600 |" in best[
        "transformer_baby 4 layers"]
    # ode_euler: best 2e-3 (not the top of its sweep: 5e-3 was tried), 0.02 behind the baseline
    assert "| 2e-3 | 1.8610 (3 seeds) | -0.0700 | +0.0200 (3 seeds) |" in best[
        "ode_euler Euler x 4 (NFE 4)"]
    assert "| 1e-3 | 1.8810 (3 seeds) |  | +0.0400 (3 seeds) |" in best[
        "elastic (cw1.0) RK4 x 4 (NFE 16)"]
    assert "4 layers, seeds" in lr_sweep.sweep_table(rows)
    assert lr_sweep.lr_of({"overrides": ["train.lr=3e-3", "train.min_lr=3e-4"]}) == "3e-3"
    assert lr_sweep.lr_of({"overrides": []}) == "1e-3"


def test_the_learning_rate_sweep_refuses_a_run_at_another_rate_than_its_tag(tmp_path):
    import json
    import os

    repo = Path(__file__).resolve().parents[1]
    results = tmp_path / "results"
    results.mkdir()
    (results / "shakespeare_char-ode_rk4-lr3e-3_seed1.json").write_text(json.dumps(
        {"overrides": ["train.lr=2e-3"], "val_loss_full_split": 1.9}))
    env = {**os.environ, "CONTINUUMLM_RUNS_DIR": str(tmp_path / "runs"),
           "CONTINUUMLM_RESULTS_DIR": str(results)}
    r = subprocess.run([sys.executable, str(repo / "bench" / "lr_sweep.py")], cwd=repo,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ran at lr 2e-3, not 3e-3" in r.stderr, r.stderr
    assert not (results / "lr_sweep.json").exists()


@pytest.mark.parametrize("key", ["train.distill.teacher", "train.distill_from"])
def test_a_teacher_of_the_runs_own_seed_shares_the_recipe_row(key):
    import render

    own = {"seed": 1, "overrides": [f"{key}=runs/bench/t_seed1", "train.lr=2e-3"]}
    assert render.row_overrides(own) == (f"{key}=runs/bench/t_seed{{seed}}", "train.lr=2e-3")
    assert render.row_overrides({**own, "seed": 2}) == tuple(own["overrides"])  # another seed's
    assert render.row_overrides({**own, "seed": 11}) == tuple(own["overrides"])


def test_the_baseline_and_counterpart_sentences_read_each_config_as_written():
    """Runs of a config with --set options (another learning rate, a tag) are rows of their
    own; pooling them into the config's mean compared models trained differently."""
    import render

    def rec(config, loss, seed, overrides=()):
        return {"config": f"configs/shakespeare_char/{config}.toml", "seed": seed,
                "val_loss_full_split": loss, "overrides": list(overrides),
                "tokens_per_s_median": 1000.0, "other_cores": 0.0}

    lr = ["train.lr=3e-3"]
    results = {"a": rec("transformer_baby", 1.90, 1), "b": rec("transformer_baby", 1.92, 2),
               "c": rec("transformer_baby", 1.70, 1, lr), "d": rec("ode_euler", 1.93, 1),
               "e": rec("ode_euler", 1.60, 1, lr)}
    base = render.baseline_sentence(results)[0]
    assert "over 2 seed(s), 1.910, is above" in base, base
    said = render.verdict(results, "configs/shakespeare_char/", "transformer_baby", ppl=False)[0]
    assert "`ode_euler` 1.930 vs `transformer_baby` 1.910 (worse" in said, said


def test_elastic_cost_only_refuses_an_unknown_name_before_timing(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(repo / "bench" / "elastic_cost.py"), "--only",
                        "ode_elastic_dial_capped-cw9"], cwd=repo, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "--only ode_elastic_dial_capped-cw9: no such config" in r.stderr, r.stderr
    assert "ode_elastic_dial_capped-cw1.0-kd1.0" in r.stderr and "Nothing was timed" in r.stderr


def test_ptb_std_targets_read_the_headline_runs_seed_matched():
    import math

    import render

    def rec(config, test_ppl, seed, overrides=()):
        return {"config": f"configs/ptb_std/{config}.toml", "seed": seed,
                "overrides": list(overrides), "test_loss_full_split": math.log(test_ppl)}

    results = {"a": rec("transformer", 100.0, 1), "b": rec("transformer", 90.0, 2),
               "c": rec("transformer", 150.0, 1, ["model.dropout=0.0"]),
               "d": rec("ode_euler", 104.0, 1)}
    said = render.ptb_std_targets(results)[0]
    assert "test perplexity, 95.0 (mean of 2 seeds), is at or below" in said, said
    assert "+4.0% against" in said and "seed 1: 104.0 vs 100.0" in said, said
    assert "within 5%: met, 1 of the 3 seeds" in said, said
    results["d"] = rec("ode_euler", 106.0, 1)
    assert "within 5%: not met" in render.ptb_std_targets(results)[0]


def test_ptb_dropout_sweep_names_each_models_best_rate_and_what_is_missing():
    import math

    import render

    def rec(config, d, ppl):
        return {"config": f"configs/ptb_std/{config}.toml", "seed": 1, "tag": f"sweep_dropout{d}",
                "val_loss_full_split": math.log(ppl)}

    results = {"a": rec("transformer", "0.0", 116.0), "b": rec("transformer", "0.3", 139.0),
               "c": rec("ode_euler", "0.0", 120.0), "d": rec("ode_euler", "0.3", 110.0),
               "e": {"config": "configs/ptb_std/ode_euler.toml", "seed": 1, "tag": None,
                     "val_loss_full_split": math.log(90.0)}}  # a headline run: not the sweep
    said, _, table, _ = render.ptb_dropout_sweep(results)
    assert "best rate ode_euler 0.3; transformer 0.0." in said, said
    assert "not run" not in said
    lines = table.splitlines()
    assert lines[0] == "| model | dropout 0.0 | dropout 0.3 |"
    assert lines[2] == "| ode_euler | 120.0 | **110.0** |"
    results["f"] = rec("ode_euler", "0.5", 105.0)
    said, _, table, _ = render.ptb_dropout_sweep(results)
    assert "ode_euler 0.5;" in said and "transformer 0.0 (of 2 rates; 0.5 not run yet)" in said, said
    assert table.splitlines()[3] == "| transformer | **116.0** | 139.0 | not run |"
    assert render.ptb_dropout_sweep({"e": results["e"]}) == []
    results["g"] = {**rec("ode_euler", "0.5", 50.0), "seed": 2}  # another seed: not the sweep
    assert "ode_euler 0.5;" in render.ptb_dropout_sweep(results)[0]
    assert "| **105.0** |" in render.ptb_dropout_sweep(results)[2]


@pytest.mark.parametrize("table", ["regularize.", ""])  # today's spelling, and the records'
def test_regularizer_table_sets_each_weight_against_the_unregularized_run_and_the_target(table):
    import render

    def rec(config, val, nfe, overrides=()):
        return {"config": f"configs/shakespeare_char/{config}.toml", "seed": 1337,
                "overrides": list(overrides), "val_loss_full_split": val,
                "nfe_mean_last_tenth": nfe, "nfe_backward_mean_last_tenth": nfe / 2}

    half = [f"train.{table}kinetic_weight=0.005", f"train.{table}jacobian_weight=0.005"]
    results = {"shakespeare_char-ode_tsit5_rnode_seed1337": rec("ode_tsit5_rnode", 1.92, 80.0)}
    assert render.regularizer_table(results) == ""  # nothing to set it against
    results["shakespeare_char-ode_tsit5_seed1337"] = rec("ode_tsit5", 1.90, 132.0)
    results["x"] = rec("ode_tsit5_rnode", 1.91, 78.0, half)
    results["y"] = rec("ode_tsit5_rnode", 1.80, 60.0, ["train.lr=3e-3"])  # compares a rate
    lines = render.regularizer_table(results).splitlines()
    assert len(lines) == 5 and "3e-3" not in "".join(lines)
    assert "| unregularized |" in lines[2] and "| 132.0 |  |  |" in lines[2], lines[2]
    assert "0.01 each" in lines[3] and "| +1.05% |" in lines[3] and "| 39.39% | not met |" in lines[3]
    assert "0.005 each" in lines[4] and "| +0.53% |" in lines[4] and "| 40.91% | met |" in lines[4]
    assert render.regularizer_verdict(results) == (
        "Target met by 40.91% fewer at +0.53% (kinetic + Jacobian, 0.005 each).")
    results["x"] = rec("ode_tsit5_rnode", 1.91, 90.0, half)
    assert render.regularizer_verdict(results) == (
        "No setting tried meets the target (2 tried). Within 1% of the unregularized loss the "
        "most saved is 31.82% fewer at +0.53% (kinetic + Jacobian, 0.005 each); the most saved "
        "by any setting is 39.39% fewer at +1.05% (kinetic + Jacobian, 0.01 each).")
    results["x"] = rec("ode_tsit5_rnode", 1.93, 90.0, half)
    assert render.regularizer_verdict(results) == (
        "No setting tried meets the target (2 tried). Every setting costs more than 1%; the most "
        "saved is 39.39% fewer at +1.05% (kinetic + Jacobian, 0.01 each).")
    results["s"] = rec("ode_tsit5_rnode", 1.905, 78.0, [*half, f"train.{table}steer=0.5"])
    lines = render.regularizer_table(results).splitlines()
    assert "| kinetic + Jacobian, 0.005 each |" in lines[4], lines[4]  # without STEER first
    assert "| kinetic + Jacobian, 0.005 each; STEER 0.5 |" in lines[5], lines[5]
    assert "| +0.26% |" in lines[5] and "| 40.91% | met |" in lines[5]
    del results["shakespeare_char-ode_tsit5_seed1337"]
    assert render.regularizer_verdict(results) == ""


def test_a_recipe_is_the_same_under_either_spelling():
    from common import canonical_overrides

    old = ["train.consistency_weight=1.0", "train.elastic_from=1000", "train.lr=2e-3"]
    new = ["train.elastic.consistency_weight=1.0", "train.elastic.start=1000", "train.lr=2e-3"]
    assert canonical_overrides(old) == canonical_overrides(new) == tuple(new)
    assert canonical_overrides(["model.cat_basis=cheb"]) == ("model.continuous.basis=cheb",)


def test_run_setting_reads_either_spelling_from_overrides_and_files(tmp_path):
    import render

    flat = tmp_path / "old.toml"  # a config file as an earlier version spelled it
    flat.write_text("[train]\nsteer = 0.25\n")
    assert render.run_setting({"config": str(flat)}, "train.regularize.steer") == 0.25

    rnode = {"config": "configs/shakespeare_char/ode_tsit5_rnode.toml", "overrides": []}
    assert render.run_setting(rnode, "train.kinetic_weight") == 0.01  # [train.regularize]
    assert render.run_setting(rnode, "train.regularize.jacobian_weight") == 0.01
    assert render.run_setting(rnode, "train.regularize.steer", 0.0) == 0.0
    assert render.run_setting(rnode, "train.lr") == 1e-3
    old = {**rnode, "overrides": ["train.kinetic_weight=0.005"]}  # a record of its day
    assert render.run_setting(old, "train.regularize.kinetic_weight") == "0.005"
    new = {**rnode, "overrides": ["train.regularize.steer=0.5"]}
    assert render.run_setting(new, "train.steer") == "0.5"
    assert render.run_setting({**rnode, "config": "configs/shakespeare_char/ode_rk4.toml"},
                              "train.regularize.kinetic_weight", "none") == "none"


def test_adaptive_solvers_keeps_the_rows_of_a_model_whose_run_is_gone():
    import adaptive_solvers as A

    new = [{"model": "ode_tsit5", "solver": "tsit5"}]
    recorded = [{"model": "ode_rk4", "solver": "tsit5"}, {"model": "ode_rk4", "solver": "dopri5"},
                {"model": "ode_tsit5", "solver": "tsit5", "old": True}]
    rows, missing = A.keep_recorded(new, ["ode_rk4", "ode_tsit5_rnode"], recorded)
    assert rows == recorded[:2] + new  # the rerun model's fresh rows replace its old ones
    assert missing == ["ode_tsit5_rnode"]
    assert A.keep_recorded(new, [], recorded) == (new, [])


def test_elastic_cost_groups_a_trainers_steps_by_their_draw(tiny_corpus, tmp_path):
    """What a step costs is read from the trainer's elastic draws: (solver, steps) and whether
    the consistency term's finer solve runs."""
    import elastic_cost

    from continuumlm import load_config
    from continuumlm.train import Trainer

    cfg = load_config(None, [
        "data.dataset=text", f'data.path="{tiny_corpus}"', "model.hidden_size=16",
        "model.num_heads=2", "model.num_layers=1", "model.depth=ode", "train.device=cpu",
        "train.elastic.steps=[1, 2]", "train.elastic.consistency_weight=0.5",
        "train.batch_size=2", "train.seq_len=8", "train.max_steps=8"])
    tr = Trainer(cfg, tmp_path / "run", quiet=True)
    found = elastic_cost.kinds(tr, 8)
    assert sorted(k for ks in found.values() for k in ks) == list(range(8))
    for (draw, finer), steps in found.items():
        assert draw == tr.objective.elastic.draw(steps[0]) and finer == (draw[1] == 1)


def test_elastic_cost_marks_the_rows_timed_apart():
    import elastic_cost

    rows = [{"config": "ode_rk4", "steps": 96, "kinds": 1, "mean_nfe": 16.0, "s_per_step": 0.3,
             "ratio": 1.0},
            {"config": "ode_euler", "steps": 96, "kinds": 1, "mean_nfe": 4.0, "s_per_step": 0.1,
             "ratio": 0.25, "timed_with": "python bench/elastic_cost.py --only ode_euler",
             "rk4_s_per_step": 0.4, "other_cores": 1.3}]
    table = elastic_cost.cost_table(rows).splitlines()
    assert table[0].endswith("| vs ode_rk4 | timed apart, with its own ode_rk4 |")
    assert table[2].endswith("| 1 |  |")
    assert table[3].endswith("| 0.25 | `python bench/elastic_cost.py --only ode_euler` (ode_rk4 "
                             "0.400 s there; other cores busy 1.3) |")
    assert "timed apart" not in elastic_cost.cost_table(rows[:1])


def test_an_elastic_model_at_another_rate_is_checked_against_references_at_that_rate():
    import depth_elasticity as de

    rows = [{"model": "ode_euler", "solver": "euler", "steps": 4, "nfe": 4, "val_loss": 1.90},
            {"model": "ode_rk4", "solver": "rk4", "steps": 4, "nfe": 16, "val_loss": 1.88},
            {"model": "ode_euler-lr2e-3", "solver": "euler", "steps": 4, "nfe": 4,
             "val_loss": 1.85, "seed": 1},
            {"model": "ode_rk4-lr2e-3", "solver": "rk4", "steps": 4, "nfe": 16,
             "val_loss": 1.84, "seed": 1}]
    for name, seed in (("x_elastic-lr2e-3", 1), ("x_elastic-lr2e-3", 2), ("x_elastic", 1)):
        rows += [{"model": name, "solver": "euler", "steps": 4, "nfe": 4, "val_loss": 1.86,
                  "seed": seed},
                 {"model": name, "solver": "rk4", "steps": 4, "nfe": 16, "val_loss": 1.87,
                  "seed": seed}]
    lines = [line for line in de.checks_table(rows).splitlines() if "x_elastic" in line]
    at_rate = [line for line in lines if "lr2e-3 | 1 |" in line][0]
    assert "+0.0100 (yes)" in at_rate and "+0.0300 (no)" in at_rate  # vs the lr 2e-3 runs
    unmatched = [line for line in lines if "lr2e-3 | 2 |" in line][0]
    assert "(yes" not in unmatched and "(no" not in unmatched  # no lr 2e-3 reference at seed 2
    plain = [line for line in lines if "x_elastic | 1 |" in line][0]
    assert "-0.0400 (yes, vs 1337)" in plain and "-0.0100 (yes, vs 1337)" in plain


def test_train_seeds_fills_in_each_seeds_values():
    import train_seeds

    applied, recorded = train_seeds.seed_sets(
        ["train.distill.teacher={runs}/t_seed{seed}", "train.lr=2e-3"], 7)
    assert applied == [f"train.distill.teacher={train_seeds.RUNS}/t_seed7", "train.lr=2e-3"]
    if train_seeds.RUNS.is_relative_to(train_seeds.ROOT):
        assert recorded[0] == f"train.distill.teacher={train_seeds.RUNS.relative_to(train_seeds.ROOT)}/t_seed7"


@pytest.mark.parametrize("norm", ["default", "seminorm"])
def test_adjoint_norm_parts_splits_torchdiffeqs_norm_without_changing_the_solve(norm):
    import adjoint_norm_parts as P
    import torch
    import torchdiffeq._impl.adjoint as A

    from continuumlm import LanguageModel, ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=11, hidden_size=16, num_heads=2, num_layers=1,
                                      max_seq_len=8, position="learned", depth="ode"))
    x = torch.randint(0, 11, (3, 7))
    y = torch.randint(0, 11, (3, 7))
    installer = A.handle_adjoint_norm_
    nfe, bnfe, calls = P.step(model, norm, x, y, record=True)
    assert A.handle_adjoint_norm_ is installer  # restored
    assert P.step(model, norm, x, y, record=False)[:2] == (nfe, bnfe) and bnfe > 0
    assert calls and all(set(c) == {*P.PARTS, "value"} for c in calls)
    kept = P.PARTS if norm == "default" else P.PARTS[:3]  # the seminorm drops the parameters
    for c in calls:  # the parts are the pieces torchdiffeq's norm takes the largest of
        assert c["value"] == pytest.approx(max(c[p] for p in kept), rel=1e-6), c
    assert any(c["parameter adjoints"] > 0 for c in calls)
    summary = P.summarize(calls)
    assert summary["norm_calls"] == len(calls) == sum(summary["largest"].values())


def test_seminorm_why_reports_the_steps_saved_and_the_parts():
    import render

    run = {"curves": {"default": [[1, 2.0, 20, 32], [2, 2.0, 20, 32], [3, 2.0, 20, 38]],
                      "seminorm": [[1, 2.0, 20, 20], [2, 2.0, 20, 32], [3, 2.0, 20, 44]]}}
    said = render.seminorm_why(run, None)
    assert said == ["Per step, the seminorm took fewer backward evaluations in 1 of 3 steps "
                    "(1 of the first 10) and more in 1.", ""]
    parts = {"command": "python bench/adjoint_norm_parts.py", "setup": "one step", "table": "T",
             "rows": [{"model": "m", "norm": "default", "backward_nfe": 32},
                      {"model": "m", "norm": "seminorm", "backward_nfe": 20}]}
    text = render.seminorm_why(run, parts)
    assert "saved by the seminorm in this step: m 37.5%." in text[2] and text[4] == "T"


def test_the_nfe_of_a_varying_solve_is_its_mean_not_its_last_draw():
    """An elastic or adaptive run's last logged step is one draw: the page and the MFU table
    showed elastic runs at NFE 8 (their last draw) while their draws average 11.7-18.8, and
    adaptive means that happened to be whole numbers lost their ~ mark. An elastic run's NFE
    is its draw set's expectation (the last tenth of training is a few dozen draws)."""
    render = pytest.importorskip("render")
    elastic = {"config": "configs/shakespeare_char/ode_elastic_narrow.toml", "nfe": 8,
               "nfe_mean_last_tenth": 14.0}
    # Euler or RK4 at 2, 4 or 8 steps: (2 + 4 + 8 + 8 + 16 + 32) / 6
    nfe, varies = common.forward_nfe(elastic, common.run_config(elastic))
    assert varies and nfe == pytest.approx(70 / 6)
    assert render._nfe_cell([elastic]) == "~11.7"
    adaptive = {"config": "configs/shakespeare_char/ode_tsit5.toml", "nfe": 126,
                "nfe_mean_last_tenth": 132.0}
    assert render._nfe_cell([adaptive]) == "~132.0"
    assert render._nfe_cell([{**adaptive, "nfe_mean_last_tenth": None}]) == "varies"
    fixed = {"config": "configs/shakespeare_char/ode_rk4.toml", "nfe": 16,
             "nfe_mean_last_tenth": 16.0}
    assert render._nfe_cell([fixed]) == "16"
    # a --set that makes a fixed-grid config elastic is read too: RK4 x 2 or x 4, and from
    # step 1000 of 2000 on (RK4 x 4 before)
    drawn = {**fixed, "overrides": ["train.elastic.steps=[2, 4]"], "nfe": 8}
    assert render._nfe_cell([drawn]) == "~12.0"
    late = {**drawn, "overrides": [*drawn["overrides"], "train.elastic.start=1000"]}
    assert render._nfe_cell([late]) == "~14.0"


def test_a_run_folder_with_other_settings_is_named_not_reused(tiny_corpus, tmp_path):
    """train_seeds.py and hf_harness.py resume or reuse a run folder only when it holds the
    run their command asks for; other_settings names what differs."""
    from continuumlm import load_config
    from continuumlm.train import Trainer

    cfg_file = tmp_path / "cfg.toml"
    cfg_file.write_text(f"""[model]
hidden_size = 32
num_heads = 2
num_layers = 1
[data]
dataset = "text"
path = "{tiny_corpus}"
[train]
max_steps = 2
batch_size = 2
seq_len = 16
warmup_steps = 1
eval_interval = 2
eval_iters = 1
device = "cpu"
""")
    run = tmp_path / "run"
    Trainer(load_config(cfg_file, ["train.seed=3"]), run, quiet=True).run()
    assert common.other_settings(run, cfg_file, ["train.seed=3"]) == []
    assert common.other_settings(run, cfg_file, ["train.seed=4", "train.lr=5e-3"]) == [
        "train.lr", "train.seed"]
    assert common.other_settings(run, cfg_file, ["train.seed=3", "model.num_layers=2"]) == [
        "model.num_layers"]


def test_a_score_on_a_few_windows_is_not_shown_as_the_whole_split():
    """train_seeds.py --max-windows (smoke tests) records its window count, and the tables
    say so instead of "whole split"; their tokens per step read the run's --set options."""
    render = pytest.importorskip("render")
    r = {"config": "configs/shakespeare_char/transformer_baby.toml", "seed": 1, "nfe": 4,
         "eval_every_target": True, "max_windows": 16}
    assert "16 windows at most" in render._tail([r])
    assert render._tail([{**r, "max_windows": None}]) == ""
    base = render._tokens_per_step(r)
    assert render._tokens_per_step({**r, "overrides": ["train.batch_size=24"]}) == 2 * base


@pytest.mark.slow
def test_the_committed_results_page_is_what_the_renderer_writes(tmp_path):
    """docs/results.md and the README's findings are generated: rendering the committed JSONs
    gives them exactly, with every figure the page links."""
    pytest.importorskip("matplotlib")
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    env = {**os.environ, "CONTINUUMLM_DOCS_DIR": str(tmp_path), "CONTINUUMLM_README": str(readme)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "render.py")], env=env,
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    page = (tmp_path / "results.md").read_text()
    assert page == (ROOT / "docs" / "results.md").read_text(), (
        "docs/results.md differs from what python bench/render.py writes: render it again")
    ablations = (tmp_path / "ablations.md").read_text()
    assert ablations == (ROOT / "docs" / "ablations.md").read_text(), (
        "docs/ablations.md differs from what python bench/render.py writes: render it again")
    # the README's "What we found" is written from the same records
    assert readme.read_text() == (ROOT / "README.md").read_text(), (
        "README.md's What we found differs from what python bench/render.py writes")
    assert "## What we found" in readme.read_text()
    for link in re.findall(r"\]\((img/[^)]+\.png)\)", page):
        assert (tmp_path / link).is_file(), link


def _tables(text: str) -> list[int]:
    """The number of body rows of each Markdown table in ``text``."""
    sizes, rows = [], None
    for line in text.split("\n") + [""]:
        if line.startswith("|"):
            rows = (rows or 0) + 1
        elif rows is not None:
            sizes.append(rows - 2)
            rows = None
    return sizes


def _anchors(text: str) -> set[str]:
    sys.path.insert(0, str(ROOT / "bench"))
    import page
    return {page.anchor(line.lstrip("#")) for line in text.split("\n") if line.startswith("## ")}


def test_the_results_page_opens_with_its_answers_and_links_what_it_moved():
    """The page opens with a summary table of at most about 15 rows; no table on it is longer
    than 25 rows (sweeps and variants are on the ablations page); every section starts with a
    sentence, not a table; every link between the two pages lands on a heading."""
    results = (ROOT / "docs" / "results.md").read_text()
    ablations = (ROOT / "docs" / "ablations.md").read_text()
    assert results.index("## At a glance") < results.index("## Tiny Shakespeare")
    sizes = _tables(results)
    assert sizes[0] <= 17 and max(sizes) <= 25, sizes
    for section in results.split("\n## ")[2:]:
        first = section.split("\n\n")[1]
        assert not first.startswith("|"), section[:80]
    targets = {"results.md": _anchors(results), "ablations.md": _anchors(ablations)}
    for here, text in (("results.md", results), ("ablations.md", ablations)):
        for file, anchor in re.findall(r"\]\(((?:results|ablations)\.md)?#([\w-]+)\)", text):
            assert anchor in targets[file or here], f"{here}: {file or here}#{anchor}"
    # every ablations section is linked from the results page
    for anchor in _anchors(ablations):
        assert f"ablations.md#{anchor}" in results, anchor


def test_page_templates_are_filled_exactly(tmp_path, monkeypatch):
    """A placeholder left unfilled, or a value no placeholder takes, is an error; blank runs
    collapse; tables split by row keep their header."""
    sys.path.insert(0, str(ROOT / "bench"))
    import page
    monkeypatch.setattr(page, "PAGES", tmp_path)
    (tmp_path / "t.md").write_text("## Title, it's\n\n$a\n\n\n$b\n")
    assert page.fill("t", a="x", b="") == ["## Title, it's", "", "x", ""]
    assert page.fill("t", a=["1", "2"], b="y") == ["## Title, it's", "", "1", "2", "", "y", ""]
    with pytest.raises(KeyError):
        page.fill("t", a="x")
    with pytest.raises(ValueError, match=r"\$c"):
        page.fill("t", a="x", b="y", c="z")
    assert page.anchor("CAT's context-length protocol") == "cats-context-length-protocol"
    assert page.anchor("Decoding: cached vs recompute") == "decoding-cached-vs-recompute"
    table = "| a | b |\n| --- | --- |\n| 1 | x |\n| 2 | y |"
    assert page.split_table(table, lambda c: c[0] == "1") == (
        "| a | b |\n| --- | --- |\n| 1 | x |", "| a | b |\n| --- | --- |\n| 2 | y |")
    assert page.split_table(table, lambda c: True)[1] == ""


def test_render_refuses_without_matplotlib(tmp_path):
    """Without matplotlib the page is not written at all (it would lose its figures)."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['matplotlib'] = None\n")
    env = {**os.environ, "CONTINUUMLM_DOCS_DIR": str(tmp_path / "docs"),
           "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "render.py")], env=env,
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and "pip install 'continuumlm[plot]'" in run.stderr
    assert not (tmp_path / "docs" / "results.md").exists()


@pytest.mark.slow
def test_a_render_into_other_folders_leaves_the_readme_alone(tmp_path):
    """A --quick experiment renders its records into another docs folder: the repository's
    README (its findings) is written only by a render of the repository's own records."""
    code = "import sys; sys.path.insert(0, 'bench'); import render; print(render.README_FILE)"
    for env, expected in (({"CONTINUUMLM_DOCS_DIR": str(tmp_path)}, "None"),
                          ({"CONTINUUMLM_RESULTS_DIR": str(tmp_path)}, "None"),
                          ({}, str(ROOT / "README.md"))):
        clean = {k: v for k, v in os.environ.items()
                 if k not in ("CONTINUUMLM_DOCS_DIR", "CONTINUUMLM_RESULTS_DIR",
                              "CONTINUUMLM_README")}
        run = subprocess.run([sys.executable, "-c", code], env={**clean, **env},
                             capture_output=True, text=True, cwd=ROOT)
        assert run.stdout.strip() == expected, (env, run.stdout, run.stderr[-500:])


def test_decode_speed_says_from_how_many_tokens_compiling_pays():
    """Whole processes: eager 10 s for 512 tokens at 64 tok/s (2 s of set-up), compiled
    20 s at 128 tok/s (16 s of set-up): 14 s more set-up over 1/64 - 1/128 s saved per
    token pays from 1792 tokens; never when compiled decoding is not faster, and at once
    when the compiled set-up is not longer."""
    decode_speed = pytest.importorskip("decode_speed")
    assert decode_speed.pays_from(10.0, 20.0, 64.0, 128.0, 512) == 1792
    assert decode_speed.pays_from(10.0, 20.0, 128.0, 64.0, 512) is None
    assert decode_speed.pays_from(10.0, 6.0, 64.0, 128.0, 512) == 0


def test_decode_speed_sums_recompute_times_over_every_length(monkeypatch):
    """The sampled recompute rate sums one token's time over every length the loop reads
    (prompt_len .. prompt_len + n - 1): exact for a time linear in the length (the
    interpolation's case), and within 1% for a purely quadratic one (attention's share; the
    chords of a convex curve lie above it, so the time is overstated, by 0.7% here)."""
    decode_speed = pytest.importorskip("decode_speed")
    for cost, rel in ((lambda L: 0.01 + 2e-4 * L, 1e-9), (lambda L: 0.01 + 1e-7 * L * L, 1e-2)):
        seen = []
        monkeypatch.setattr(decode_speed, "recompute_token_s",
                            lambda m, L, cost=cost, seen=seen: seen.append(L) or cost(L))
        rate = decode_speed.recompute_tok_s_sampled(None, 64, 2048)
        exact = 2048 / sum(cost(L) for L in range(64, 64 + 2048))
        assert rate == pytest.approx(exact, rel=rel)
        assert seen[0] == 64 and seen[-1] == 64 + 2047 and len(seen) == 9


def test_the_speculative_bound_solves_for_the_chance_of_keeping_each_draft():
    """findings.kept_for inverts 1 + p + ... + p^k (checked against the sum at the answer and
    on the edges); speculative_bound reads a record's pass costs: a round of k drafts and one
    verification against plain decoding, times the target."""
    import findings

    for k in (1, 2, 4, 8):
        for p in (0.0, 0.3, 0.77, 0.93, 1.0):
            tokens = sum(p ** i for i in range(k + 1))
            assert abs(findings.kept_for(tokens, k) - p) < 1e-9
    assert findings.kept_for(9.5, 8) is None
    rows = [{"mode": "eager", "decoding": "greedy", "draft": "euler x 1", "k": 4,
             "tok_s": 600.0, "tokens_per_verification": 3.1},
            {"mode": "eager", "decoding": "greedy", "draft": "euler x 1", "k": "auto",
             "tok_s": 900.0, "tokens_per_verification": 3.3}]
    m = {"name": "m", "rows": rows, "pass_costs": {"plain_ms": 2.0,
                                                  "draft_ms": {"euler x 1": 0.25},
                                                  "verify_ms": {"4": 3.0}}}
    text = findings.speculative_bound(m, 2.5)
    # a round: 4 x 0.25 + 3.0 = 4.0 ms; 2.5x needs 2.5 x 4.0 / 2.0 = 5.0 tokens = k + 1
    assert "needs 5.0 tokens per verification (each draft kept with probability 100%" in text
    assert "it makes 3.1" in text
    assert findings.speculative_bound({**m, "pass_costs": None}, 2.5) is None


def test_pass_costs_time_each_pass_of_a_round():
    """bench/speculative.py pass_costs on a small ODE model and a discrete one: a positive time
    for the plain pass, every draft and every verification, and the model's solve and layers
    as they were."""
    import speculative

    from continuumlm.testing import small_model

    ode = small_model(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1).eval()
    prompt = torch.randint(0, 37, (1, 5))
    costs = speculative.pass_costs(ode, prompt, [("euler", 1), ("midpoint", 1)], ks=(2, 3),
                                   reps=1, inner=2)
    assert costs["plain_ms"] > 0 and set(costs["verify_ms"]) == {"2", "3"}
    assert set(costs["draft_ms"]) == {"euler x 1", "midpoint x 1"}
    assert all(v > 0 for v in [*costs["draft_ms"].values(), *costs["verify_ms"].values()])
    assert (ode.config.ode_solver, ode.config.ode_steps) == ("rk4", 2)
    stack = small_model(depth="discrete", num_layers=3).eval()
    layers = list(stack.depth.layers)
    costs = speculative.pass_costs(stack, prompt, [("layers", 1)], ks=(2,), reps=1, inner=2)
    assert set(costs["draft_ms"]) == {"first 1 layers"}
    assert list(stack.depth.layers) == layers
    # a discrete stack drafts with its first layers, through its lean step as decoding does
    assert costs["draft_by"] == {"first 1 layers": "lean step"}
    assert costs["own_by"] == "lean step" and costs["draft_ms"]["first 1 layers"] > 0


def test_decode_sums_every_prompt_and_says_how_it_drafted():
    """bench/speculative.py decode over two prompts, with the field clock on: the counts are
    the streams' summed, the drafts went through the lean step (the clock wraps class forwards,
    which the lean step does not refuse), the clock timed some field time, and its wrapping is
    gone after remove()."""
    import speculative

    from continuumlm import Draft
    from continuumlm.decoding import Decoder
    from continuumlm.decoding.lean_draft import LeanDraft
    from continuumlm.testing import small_model

    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1).eval()
    prompts = [torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(i))
               for i in range(2)]
    field_forward, lean_field = type(model.depth.blocks[0].field).forward, LeanDraft._field
    clock = speculative.FieldClock(model)
    try:
        outs, tps, stats = speculative.decode(Decoder(model), prompts, 12,
                                              Draft("euler", 1, 3), clock=clock)
    finally:
        clock.remove()
    assert [len(o) for o in outs] == [12, 12] and tps > 0
    assert stats["tokens"] == 24 and stats["rounds"] >= 2 and stats["drafted"] >= 2
    assert stats["drafted_by"] == "lean step" and 0 < stats["outside_field"] < 1
    assert type(model.depth.blocks[0].field).forward is field_forward
    assert LeanDraft._field is lean_field
    # a discrete stack: its lean step's layers are timed as the field
    from continuumlm.decoding.lean_stack import LeanStack

    stack, lean_layer = small_model(num_layers=3).eval(), LeanStack._layer
    clock = speculative.FieldClock(stack)
    try:
        _, _, stats = speculative.decode(Decoder(stack), prompts, 12,
                                         Draft(layers=1, tokens=3), clock=clock)
    finally:
        clock.remove()
    assert stats["drafted_by"] == "first layers, lean step" and 0 < stats["outside_field"] < 1
    assert clock.seconds > 0 and LeanStack._layer is lean_layer


def test_confirmed_times_against_both_plain_decodings():
    """bench/speculative.py confirmed: each repetition's ratio against plain decoding as the
    decoder runs it (the lean step here) and against plain decoding through the decoding
    pass (Decoder(lean=False)), with the medians and what plain decoding ran by."""
    import speculative

    from continuumlm.decoding import Decoder
    from continuumlm.testing import small_model

    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1).eval()
    prompts = [torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(0))]
    dec = Decoder(model)
    speculative.decode(dec, prompts, 4)
    row = {"draft": "euler x 1", "k": 3, "confidence": 0.2}
    got = speculative.confirmed(dec, prompts, 10, row, sampled=True, times=3)
    assert got["plain_by"] == "lean step" and got["confidence"] == 0.2
    assert len(got["ratios"]) == len(got["against_pass_ratios"]) == 3
    assert got["speedup"] == round(sorted(got["ratios"])[1], 2)
    assert got["against_pass"] == round(sorted(got["against_pass_ratios"])[1], 2)
    old = speculative.confirmed(Decoder(model, lean=False), prompts, 10, row, False, 1)
    assert "against_pass" not in old  # already the decoding pass: nothing to compare
    # a pipelined row: against plain decoding at the run's thread count and at the other
    piped = {"mode": "pipelined", "draft": "euler x 1", "k": 3}
    threads = torch.get_num_threads()
    try:
        got = speculative.confirmed(dec, prompts, 10, piped, sampled=False, times=2)
    finally:
        dec.close()
    assert torch.get_num_threads() == threads  # put back
    assert got["plain_threads"] == threads and got["other_threads"] == (2 if threads == 1
                                                                        else 1)
    assert len(got["against_other_threads_ratios"]) == 2 and "against_pass" not in got


def _pipelined_model(name: str, plain: float, drafted: dict) -> dict:
    """A bench/speculative.py --mode pipelined model record: per decoding, its fastest row's
    speed-up and the re-timed median."""
    rows = [{"mode": "pipelined", "decoding": d, "draft": "euler x 2", "k": 8,
             "acceptance": 0.8, "tokens_per_verification": 4.0, "tok_s": plain * x,
             "plain_tok_s": plain, "speedup": x, "same_tokens": d == "greedy" or None}
            for d, x in drafted.items()]
    return {"name": name, "rows": rows,
            "confirmed": {f"pipelined {d}": {"speedup": x, "ratios": [x]}
                          for d, x in drafted.items()}}


def test_the_native_kernels_record_is_read_beside_the_one_with_onednn():
    """conclusions.pipelined_native and findings._pipelined: the record with oneDNN off
    (--onednn auto) gives its own medians and verdict; the rates before and after are of the
    same seed's same row (the new median seed, which need not be the old record's median
    seed); without the record, nothing is said."""
    import conclusions
    import findings

    old_greedy = (2.5, 2.0, 2.2)  # median seed: s2
    before = {"command": "python bench/speculative.py --out a", "models": [
        _pipelined_model(f"fam_s{i}", 440.0 + i, {"greedy": x, "sampled": 2.3})
        for i, x in enumerate(old_greedy)]}
    after = {"command": "python bench/speculative.py --onednn auto --out a_native",
             "models": [_pipelined_model(f"fam_s{i}", 540.0 + i,
                                         {"greedy": 1.8 + i / 10, "sampled": 2.6})
                        for i in range(3)]}  # median seed: s1
    results = {"a": before}
    assert conclusions.pipelined_native(results, "a_native", "a", "fam", 2.5) == ""
    results["a_native"] = after
    text = conclusions.pipelined_native(results, "a_native", "a", "fam", 2.5)
    assert "1.90x greedy (1.80-2.00x over the seeds" in text
    assert "2.60x sampled" in text and "missed by 0.60x" in text and "--onednn auto" in text
    # seed 1's row in both records: 441 * 2.0 -> 541 * 1.9 tokens/s
    assert ("greedy (fam_s1, euler x 2, k 8): plain 441 -> 541 tokens/s (1.23x), drafted "
            "882 -> 1028 (1.17x)") in text
    # a record whose rows do not match (another draft) gives no before-and-after
    before["models"][1]["rows"][0]["draft"] = "rk4 x 1"
    assert "greedy (fam_s1" not in conclusions.pipelined_native(results, "a_native", "a",
                                                                 "fam", 2.5)
    clause = findings._pipelined(results, "a", "fam", 2.5)
    assert "2.20x greedy and 2.30x sampled" in clause
    assert "1.90x and 2.60x against the faster plain decoding" in clause


def test_cpu_kernels_conclusion_gives_each_kind_of_decoding_its_range():
    import conclusions

    r = {"decoding": [
        {"model": m, "decoding": kind, "speedup": x}
        for m, xs in (("a", (1.2, 1.1)), ("b", (1.25, 1.15)))
        for kind, x in zip(("batch 1, lean step", "batch 8, decoding pass"), xs)],
        "gelu": [{"rows": 1, "onednn_us": 14.0, "own_us": 3.0, "speedup": 4.7},
                 {"rows": 64, "onednn_us": 30.0, "own_us": 30.5, "speedup": 0.98},
                 {"rows": 1024, "onednn_us": 275.0, "own_us": 420.0, "speedup": 0.65}]}
    text = conclusions.cpu_kernels(r, {})
    assert "1.20-1.25x (batch 1, lean step), 1.10-1.15x (batch 8, decoding pass)" in text
    assert "the range over 2 models" in text
    assert "14.0 us on one row of 512 against 3.0 us" in text
    assert "the faster one from 1,024 rows on" in text  # 64 rows is a tie, not a win
    r["decoding"] = [{"model": "a", "decoding": "a prompt's pass", "speedup": 0.95}]
    assert "at 0.95x (a prompt's pass)" in conclusions.cpu_kernels(r, {})
    assert conclusions.cpu_kernels({"decoding": []}, {}) is None
