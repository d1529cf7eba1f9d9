"""A plugin mixer with no decoding cache (``cache_factory = None``, ``forward(x, cache=None)``
refusing a cache), through the commands a user runs: it trains, evaluates and generates by
recomputing; cached generation is refused by name with the way out."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from continuumlm import ModelConfig
from continuumlm.model.lm import LanguageModel
from continuumlm.registry import MIXERS
from continuumlm.testing import check_component

PLUGINS = str(Path(__file__).parent / "plugins")
MODULE = "continuumlm_cacheless_plugin"


@pytest.fixture(autouse=True)
def running_mean(monkeypatch):
    """The plugin imported (registering running_mean) for the test alone: the registry and
    sys.modules are put back after it, so the tests that iterate over the registered mixers
    never see it."""
    from continuumlm import registry

    monkeypatch.syspath_prepend(PLUGINS)
    # what `--plugin` leaves in this process (the exported module list, the loaded ones)
    monkeypatch.setenv(registry.PLUGINS_ENV, os.environ.get(registry.PLUGINS_ENV, ""))
    monkeypatch.setattr(registry, "_loaded_plugins", list(registry._loaded_plugins))
    assert "softmax" in MIXERS  # the built-ins loaded first, as for a real plugin
    monkeypatch.setitem(MIXERS._entries, "running_mean", None)  # removed again afterwards
    del MIXERS._entries["running_mean"]
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    yield importlib.import_module(MODULE)
    sys.modules.pop(MODULE, None)


def test_the_cacheless_mixer_keeps_every_invariant_it_can():
    check_component("mixer", "running_mean")


@pytest.mark.parametrize("depth", ["discrete", "ode"])
def test_cached_generation_is_refused_by_name(depth):
    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=11, hidden_size=16, num_heads=2, num_layers=1,
                                      max_seq_len=32, mixer="running_mean", depth=depth)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    assert model.cache_memory() is None and model.cacheless_mixers() == ["running_mean"]
    with pytest.raises(ValueError, match=r"running_mean.*no decoding cache.*use_cache=False"):
        model.generate(prompt, 4, greedy=True)
    with pytest.raises(ValueError, match="running_mean"):
        model.step(prompt, model.init_state(1))
    out = model.generate(prompt, 4, greedy=True, use_cache=False)
    ref = prompt
    for _ in range(4):  # recomputing by hand
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)


def test_train_eval_and_generate_from_the_command_line(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("the cat sat on the mat. " * 100)
    run = tmp_path / "run"
    sets = ["data.dataset=text", f'data.path="{corpus}"', "model.mixer=running_mean",
            "model.depth=ode", "model.ode_solver=rk4", "model.ode_steps=2", "model.num_layers=1",
            "model.hidden_size=16", "model.num_heads=2", "model.max_seq_len=16",
            "train.seq_len=16", "train.batch_size=4", "train.max_steps=2",
            "train.eval_interval=2", "train.eval_iters=1", "train.device=cpu"]
    r = run_cli("train", "--plugin", "continuumlm_cacheless_plugin", "--out", run, "--quiet",
                *sum((["--set", s] for s in sets), []))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli("eval", "--checkpoint", run)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decoding cache: none (the mixer 'running_mean' has no decoding cache)" in r.stdout
    r = run_cli("generate", "--checkpoint", run, "--prompt", "the ", "--max-new-tokens", "5",
                "--greedy", "--no-cache")
    assert r.returncode == 0 and r.stdout.startswith("the "), r.stderr[-2000:]
    assert "no decoding cache" in r.stderr
    r = run_cli("generate", "--checkpoint", run, "--prompt", "the ", "--max-new-tokens", "5")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "running_mean" in r.stderr and "--no-cache" in r.stderr
    assert "Traceback" not in r.stderr
