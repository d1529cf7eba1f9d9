"""Runs saved by version 0.1, whose configs kept component settings flat in [model]
(``deltanet_short_conv``, ``cat_*``): they load, evaluate, generate and resume unchanged.

tests/data/legacy-0.1/ holds two such runs (a DeltaNet with a short convolution, a Chebyshev
CAT model), written by that version's ``continuumlm train``, with the logits and greedy tokens
it produced for a prompt (expected.json). Their corpus path is recorded in the runs, so the
test writes the same generated corpus there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, write_tiny_corpus
from continuumlm.runs.checkpoint import load_model_and_tokenizer, load_run_config

DATA = Path(__file__).parent / "data" / "legacy-0.1"
EXPECTED = json.loads((DATA / "expected.json").read_text())
CORPUS = Path("/tmp/continuumlm-legacy-0.1/tiny.txt")  # where the saved runs read it


@pytest.fixture
def legacy_run(tmp_path, request):
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    write_tiny_corpus(CORPUS)
    run = tmp_path / request.param
    shutil.copytree(DATA / request.param, run, symlinks=True)
    return run


RUNS = ["deltanet_conv", "cat_cheb"]


@pytest.mark.parametrize("legacy_run", RUNS, indirect=True)
def test_a_legacy_checkpoint_gives_the_same_logits_and_tokens(legacy_run):
    saved = json.loads((legacy_run / "checkpoints" / "last" / "config.json").read_text())
    assert any(k.startswith(("cat_", "deltanet_")) for k in saved)  # the old flat format
    model, tok, _ = load_model_and_tokenizer(legacy_run)
    model.eval()
    exp = EXPECTED[legacy_run.name]
    ids = torch.tensor([tok.encode(exp["prompt"])])
    with torch.no_grad():
        logits = model(ids)[0][0, -1]
    torch.testing.assert_close(logits, torch.tensor(exp["logits_last"]), rtol=0, atol=1e-5)
    assert model.generate(ids, 12, greedy=True)[0].tolist() == exp["greedy"]
    cfg = model.config
    if legacy_run.name == "cat_cheb":  # the flat settings arrived in the component's table
        c = cfg.component("continuous")
        assert (c.basis, c.n_freq, c.n_quad, c.sob_lambda, c.length) == ("cheb", 6, 8, 1e-5, 32)
    else:
        assert cfg.component("deltanet").short_conv == 4


@pytest.mark.parametrize("legacy_run", RUNS, indirect=True)
def test_a_legacy_run_evaluates_generates_and_resumes(legacy_run):
    r = run_cli("eval", "--checkpoint", legacy_run, "--json")
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", "--checkpoint", legacy_run, "--prompt", "the", "--greedy",
                "--max-new-tokens", "5")
    assert r.returncode == 0 and r.stdout.startswith("the"), r.stderr
    r = run_cli("train", "--out", legacy_run, "--resume", "--quiet", "--set",
                "train.max_steps=6")
    assert r.returncode == 0, r.stderr
    last = (legacy_run / "checkpoints" / "last").resolve()
    assert last.name == "step-00000006"
    written = json.loads((last / "config.json").read_text())
    assert not any(k.startswith(("cat_", "deltanet_")) for k in written)  # the new format
    name = "continuous" if legacy_run.name == "cat_cheb" else "deltanet"
    assert name in written and load_run_config(last).model.component(name) is not None


@pytest.mark.parametrize("legacy_run", ["deltanet_conv"], indirect=True)
def test_a_legacy_run_resumes_with_a_config_in_the_new_spelling(legacy_run, tmp_path):
    """A 0.1 checkpoint holds every flat setting (the CAT ones too, though this is a DeltaNet);
    the same run described with a [model.deltanet] table is the same run."""
    import tomllib

    raw = tomllib.loads((legacy_run / "config.toml").read_text())
    model = {k: v for k, v in raw["model"].items() if not k.startswith(("cat_", "deltanet_"))}
    lines = ["[model]", *(f"{k} = {json.dumps(v)}" for k, v in model.items()),
             "", "[model.deltanet]", "short_conv = 4", 'activation = "none"', "beta_bias = true",
             'head_norm = "model"', ""]
    for section in ("data", "train"):
        lines += [f"[{section}]", *(f"{k} = {json.dumps(v)}" for k, v in raw[section].items()
                                    if v is not None), ""]
    new = tmp_path / "new.toml"
    new.write_text("\n".join(lines).replace("True", "true").replace("False", "false"))
    # without the feature map of its time (today's defaults follow fla) it is another model
    bare = tmp_path / "bare.toml"
    bare.write_text("\n".join(x for x in new.read_text().splitlines()
                               if not x.startswith(("activation", "beta_bias", "head_norm"))))
    r = run_cli("train", "--config", bare, "--out", legacy_run, "--resume", "--quiet")
    assert r.returncode == 2 and "model.deltanet.activation" in r.stderr, r.stderr
    r = run_cli("train", "--config", new, "--out", legacy_run, "--resume", "--quiet", "--set",
                "train.max_steps=6")
    assert r.returncode == 0, r.stderr
