"""Per-token adaptive depth (``LanguageModel.set_exit``): references (threshold 0 is full depth,
threshold inf is one step of dt), causality and cached decoding equal to recompute at the same
threshold for mixers x solvers x fields x criteria, the decoding path that skips work, the
evaluation and CLI reports, and the refusals."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from continuumlm import LanguageModel
from continuumlm.registry import MIXERS
from continuumlm.testing import check_cached_decoding, check_causal, small_model

V = 37


def ode_model(**kw) -> LanguageModel:
    base = dict(depth="ode", field="sequential", ode_solver="rk4", ode_steps=4,
                ode_time_embedding="sinusoidal")
    # float64: an exit decision compares a float with the threshold, so the cached and the
    # recomputed paths must agree far below any criterion's distance from it
    m = small_model(**{**base, **kw}).double()
    with torch.no_grad():  # a time embedding that matters (it starts at zero)
        for blk in m.depth.blocks:
            if blk.field.time is not None:
                blk.field.time.proj.weight.normal_(0, 0.3)
        if m.exit_gate is not None:  # a gate whose decisions differ between tokens
            m.exit_gate.weight.normal_(0, 1.0)
    return m


def partial_threshold(model, criterion: str, idx) -> float:
    """A threshold at which some tokens stop early and others integrate longer."""
    full = None
    for tau in [10.0 ** e for e in range(-8, 2)] + [x / 10 for x in range(2, 10)]:
        model.set_exit(tau, criterion)
        with torch.no_grad():
            model(idx)
        nfe = model.last_token_nfe.double()
        full = full or model.config.num_layers * model.config.ode_steps * \
            model.depth.blocks[0].solver.evals_per_step
        if nfe.min() < full and nfe.max() > nfe.min():
            return tau
    pytest.fail(f"no threshold gives a partial exit with {criterion}")


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_threshold_zero_is_full_depth_and_inf_is_one_step(mixer):
    m = ode_model(mixer=mixer)
    idx = torch.randint(0, V, (2, 19))
    with torch.no_grad():
        full = m(idx)[0]
        m.set_exit(0.0)
        assert torch.equal(m(idx)[0], full)
        assert (m.last_token_nfe == 2 * 4 * 4).all()
        m.set_exit(math.inf)
        first = m(idx)[0]
        assert (m.last_token_nfe == 2 * 4).all()  # one RK4 step per block
    # reference: the same weights integrated for one step of the same dt (same t0, same dt)
    cfg = m.config
    one = LanguageModel(dataclasses.replace(cfg, ode_steps=1, ode_t1=cfg.ode_t0 + 0.25))
    one = one.double().eval()
    one.load_state_dict(m.state_dict())
    with torch.no_grad():
        assert torch.equal(one(idx)[0], first)
    m.set_exit(None)
    with torch.no_grad():
        assert torch.equal(m(idx)[0], full) and m.last_token_nfe is None


COMBOS = ([dict(mixer=mx, criterion=c) for mx in sorted(MIXERS) for c in ("state", "kl")]
          + [dict(mixer=mx, criterion="gate", exit_gate=True) for mx in sorted(MIXERS)]
          + [dict(ode_solver=s) for s in ("euler", "midpoint", "heun", "rk4_38", "rk2_gated")]
          + [dict(field=f) for f in ("attention", "parallel")]
          + [dict(position="rope"), dict(ode_dt_embedding=True, ode_steps=3),
             dict(mixer="deltanet", field="parallel", ode_solver="heun")])


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_causal_and_cached_decoding_equals_recompute(combo):
    combo = dict(combo)
    criterion = combo.pop("criterion", "state")
    m = ode_model(**combo)
    idx = torch.randint(0, V, (2, 24))
    partial_threshold(m, criterion, idx)  # leaves the model exiting at it
    check_causal(m, atol=1e-10)
    check_cached_decoding(m, torch.randint(0, V, (2, 5)), 12, atol=1e-9)


def test_a_frozen_token_only_writes_what_later_tokens_read(monkeypatch):
    """Decoding a token that stopped after its first step: the rest of the solve runs no MLP
    and no attention read, only key/value writes, and later tokens see the same numbers."""
    m = ode_model(num_layers=1)
    prompt = torch.randint(0, V, (1, 6))
    m.set_exit(math.inf)
    ref = m.generate(prompt, 5, greedy=True, use_cache=False)
    m.set_exit(math.inf)  # counts from here
    calls = {"mlp": 0, "write": 0}
    field = m.depth.blocks[0].field
    mlp_forward, write = field.mlp.forward, field.mixer.write

    def count_mlp(*a, **k):
        calls["mlp"] += 1
        return mlp_forward(*a, **k)

    def count_write(*a, **k):
        calls["write"] += 1
        return write(*a, **k)

    monkeypatch.setattr(field.mlp, "forward", count_mlp)
    monkeypatch.setattr(field.mixer, "write", count_write)
    out = m.generate(prompt, 5, greedy=True)
    assert torch.equal(out, ref)
    # prompt and 4 fed tokens: 4 evaluations each (step 1), then 12 writes each (steps 2-4)
    assert calls == {"mlp": 5 * 4, "write": 5 * 12}
    assert m.depth.exit_totals == [6 * 4 + 4 * 4, 6 + 4]  # 4 evaluations per token


def test_evaluation_reports_mean_field_evaluations_per_token():
    from continuumlm.eval.perplexity import evaluate_contexts

    m = ode_model(num_layers=1).float()
    data = torch.randint(0, V, (300,))
    [full] = evaluate_contexts(m, data, [16], False, torch.device("cpu"))
    assert "nfe_per_token" not in full
    m.set_exit(0.0)
    [same] = evaluate_contexts(m, data, [16], False, torch.device("cpu"))
    assert same["loss"] == full["loss"] and same["nfe_per_token"] == 16
    m.set_exit(math.inf)
    [early] = evaluate_contexts(m, data, [16], False, torch.device("cpu"))
    assert early["nfe_per_token"] == 4 and early["loss"] != full["loss"]


def test_refusals():
    with pytest.raises(ValueError, match="depth = 'ode'"):
        small_model(depth="discrete").set_exit(0.1)
    with pytest.raises(ValueError, match="fixed-grid"):
        small_model(depth="ode", ode_solver="dopri5").set_exit(0.1)
    with pytest.raises(ValueError, match="reversible"):
        small_model(depth="ode", ode_solver="reversible_heun").set_exit(0.1)
    m = small_model(depth="ode")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=">= 0"):
            m.set_exit(bad)
    with pytest.raises(ValueError, match="not one of state, kl"):
        m.set_exit(0.1, "entropy")
    m.set_exit(0.1)
    with pytest.raises(ValueError, match="fixed-grid"):  # a solver swapped in afterwards
        m.set_solver("dopri5", ode_grad="direct")
        m(torch.randint(0, V, (1, 4)))


def test_eval_and_generate_take_an_exit_threshold(tiny_corpus, tmp_path):
    import json

    from conftest import run_cli, train_tiny

    def trained(name, depth):
        return train_tiny(tiny_corpus, tmp_path / name, f"model.depth={depth}")

    run = trained("ode", "ode")
    r = run_cli("eval", "--checkpoint", run, "--exit-threshold", "inf", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["exit"] == {"threshold": float("inf"), "criterion": "state"}
    assert out["results"][0]["nfe_per_token"] == 4  # one RK4 step of three
    r = run_cli("generate", "--checkpoint", run, "--prompt", "the cat", "--max-new-tokens", "5",
                "--exit-threshold", "0.5", "--exit-criterion", "kl")
    assert r.returncode == 0 and "field evaluations per token on average" in r.stderr
    r = run_cli("eval", "--checkpoint", trained("flat", "discrete"), "--exit-threshold", "0.1")
    assert r.returncode == 2 and "needs depth = 'ode'" in r.stderr
    r = run_cli("eval", "--checkpoint", run, "--exit-threshold", "-1")
    assert r.returncode == 2 and ">= 0" in r.stderr


def test_a_copied_model_exits_on_its_own_head():
    """The "kl" criterion's read-out is a bound method: a deepcopy reads its own head and
    norm (a closure kept reading the original's), and the model pickles."""
    import copy
    import pickle

    from continuumlm.testing import small_model

    m = small_model(depth="ode")
    m.set_exit(0.5, "kl")
    c = copy.deepcopy(m)
    assert c.depth.exit.readout.__self__ is c
    pickle.dumps(m)


def test_the_gate_criterion_needs_a_gate_and_reads_it():
    """--exit-criterion gate on a model without model.exit_gate is refused by name; with one,
    a token stops after the first step at which 1 - sigmoid(gate) falls below tau, as a
    step-by-step reference computes it."""
    m = ode_model(num_layers=1)
    with pytest.raises(ValueError, match="no.*gate|has none"):
        m.set_exit(0.5, "gate")
    m = ode_model(num_layers=1, exit_gate=True)
    idx = torch.randint(0, V, (2, 9))
    tau = partial_threshold(m, "gate", idx)
    m.set_exit(tau, "gate")
    with torch.no_grad():
        m(idx)
        got = m.last_token_nfe
        # reference: the full solve's states step by step, the first step whose gate says stop
        blk = m.depth.blocks[0]
        h = m.drop(m.tok_emb(idx))
        states, dt = [], 0.25
        blk.field.dt = dt
        for k in range(4):
            h = blk.solver.step(lambda t, x: blk.field(t, x), k * dt, h, dt)
            states.append(h)
        stop = torch.full(idx.shape, 4)
        for k in range(3, 0, -1):  # after step k (1..3) the token may stop
            settled = (1 - torch.sigmoid(m.gate_logits(states[k - 1]))) < tau
            stop = torch.where(settled, torch.full_like(stop, k), stop)
    assert torch.equal(got, stop.to(got.dtype) * 4)


def test_gate_config_refusals():
    from continuumlm import ConfigError, load_config

    with pytest.raises(ConfigError, match="exit_gate.*depth"):
        load_config(None, ["model.exit_gate=true"])
    with pytest.raises(ConfigError, match="model.exit_gate = true"):
        load_config(None, ["model.depth=ode", "train.any_depth.gate_weight=1.0"])
    with pytest.raises(ConfigError, match="gate_weight.*'direct' or 'checkpoint'"):
        load_config(None, ["model.depth=ode", "model.exit_gate=true", "model.ode_grad=adjoint",
                           "train.any_depth.gate_weight=1.0"])
