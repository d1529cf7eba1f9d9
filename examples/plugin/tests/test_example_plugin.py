"""The example plugin's own tests: what a plugin author runs on their components."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))  # the plugin, as an installed package would be importable

import continuumlm_example_plugin as plugin  # noqa: E402

from continuumlm import ConfigError, LanguageModel, ModelConfig, load_config  # noqa: E402
from continuumlm.ode import integrate  # noqa: E402
from continuumlm.testing import check_component  # noqa: E402


@pytest.mark.parametrize("kernel", [1, 3, 6])
def test_causal_conv_mixer_keeps_every_invariant(kernel):
    check_component("mixer", "causal_conv", components={"causal_conv": {"kernel": kernel}})


def test_ralston_solver_keeps_every_invariant():
    check_component("solver", "ralston")
    check_component("solver", "ralston", mixer="causal_conv")


def test_ralston_is_second_order():
    """On dy/dt = A y the error falls 4x per halving of the step."""
    torch.manual_seed(0)
    A = torch.randn(4, 4, dtype=torch.float64) * 0.7
    y0 = torch.randn(3, 4, dtype=torch.float64)
    exact = y0 @ torch.linalg.matrix_exp(A).T
    solver = plugin.RalstonSolver(None)
    errs = [(integrate(lambda t, y: y @ A.T, y0, 0.0, 1.0, solver, n, "direct") - exact)
            .abs().max().item() for n in (16, 32)]
    assert 3.5 < errs[0] / errs[1] < 4.5


def test_the_mixer_setting_is_its_own_table_and_checked():
    cfg = load_config(None, ["model.mixer=causal_conv", "model.causal_conv.kernel=5",
                             "model.vocab_size=11"])
    assert cfg.model.component("causal_conv").kernel == 5
    m = LanguageModel(cfg.model)
    assert m.depth.layers[0].mixer.kernel == 5
    with pytest.raises(ConfigError, match="model.causal_conv.kernel must be greater than 0"):
        load_config(None, ["model.mixer=causal_conv", "model.causal_conv.kernel=0"])
    with pytest.raises(ConfigError, match="did you mean 'kernel'"):
        ModelConfig.from_dict({"mixer": "causal_conv", "causal_conv": {"kernal": 2}})


@pytest.mark.slow
def test_a_run_trained_with_the_plugin_needs_no_flag_afterwards(tmp_path):
    """train --plugin saves the module in model.plugins; eval and generate in a fresh process
    (where nothing has imported the plugin) find its components from the checkpoint."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the cat sat on the mat. " * 200)
    run = tmp_path / "run"
    common = [sys.executable, "-m", "continuumlm"]
    train = common + [
        "train", "--plugin", "continuumlm_example_plugin", "--out", str(run), "--quiet",
        *sum((["--set", s] for s in [
            "data.dataset=text", f'data.path="{corpus}"', "model.mixer=causal_conv",
            "model.causal_conv.kernel=4", "model.depth=ode", "model.ode_solver=ralston",
            "model.ode_steps=2", "model.num_layers=1", "model.hidden_size=16",
            "model.num_heads=2", "model.max_seq_len=16", "train.seq_len=16",
            "train.batch_size=4", "train.max_steps=4", "train.eval_interval=2",
            "train.eval_iters=1", "train.checkpoint_interval=2", "train.device=cpu"]), [])]
    env = {**os.environ, **{"PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}}
    r = subprocess.run(train, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(common + ["generate", "--checkpoint", str(run), "--prompt", "the ",
                                 "--max-new-tokens", "8", "--greedy"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("the "), r.stderr[-2000:]
    # without the plugin importable the error says what is missing and how to fix it
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    bare["PYTHONPATH"] = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p and Path(p).resolve() != HERE)
    r = subprocess.run(common + ["generate", "--checkpoint", str(run), "--prompt", "the "],
                       env=bare, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "plugin 'continuumlm_example_plugin' could not be imported" \
        in r.stderr, r.stderr[-2000:]
