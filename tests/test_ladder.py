"""Per-token exit across whole solves (``set_exit(..., ladder=[...])``, model/ladder.py):
against the reference built from each solve's own logits, exactly causal, cached decoding
equal to recomputing, the evaluation and CLI reports, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from continuumlm.testing import check_causal, small_model

LADDER = ["euler:1", "rk4:1"]


def block_model(**kw):
    base = dict(depth="ode", field="sequential", ode_solver="rk4", ode_steps=4, num_layers=1,
                ode_kv="block", ode_time_embedding="sinusoidal")
    m = small_model(**{**base, **kw}).double()  # float64: decisions compare with a threshold
    with torch.no_grad():
        for blk in m.depth.blocks:
            if blk.field.time is not None:  # a time embedding that matters
                blk.field.time.proj.weight.normal_(0, 0.3)
    return m


def solve_logits(m, solver: str, steps: int, idx):
    """The logits of one whole solve, every token with it (no exit)."""
    own, ladder = (m.config.ode_solver, m.config.ode_steps), m.depth.ladder
    m.set_solver(solver, steps)
    m.depth.ladder = None
    try:
        with torch.no_grad():
            return m(idx)[0]
    finally:
        m.set_solver(*own)
        m.depth.ladder = ladder


def reference(m, idx, tau):
    """Each position's logits: the first of Euler x 1, RK4 x 1 whose read-out's largest
    probability is above 1 - tau, else the own solve's; with its field evaluations."""
    e1, r1, own = (solve_logits(m, "euler", 1, idx), solve_logits(m, "rk4", 1, idx),
                   solve_logits(m, "rk4", 4, idx))
    sure1 = 1 - torch.softmax(e1, -1).amax(-1) < tau
    sure2 = 1 - torch.softmax(r1, -1).amax(-1) < tau
    out = torch.where(sure1[..., None], e1, torch.where(sure2[..., None], r1, own))
    nfe = torch.where(sure1, 1, torch.where(sure2, 5, 21))
    return out, nfe, (e1, own)


def partial_tau(m, idx) -> float:
    """A threshold at which tokens stop at each of the three rungs."""
    e1, r1 = solve_logits(m, "euler", 1, idx), solve_logits(m, "rk4", 1, idx)
    c1 = 1 - torch.softmax(e1, -1).amax(-1)
    c2 = 1 - torch.softmax(r1, -1).amax(-1)
    for q in torch.linspace(0.1, 0.9, 17):
        tau = float(torch.quantile(c1.flatten(), float(q)))
        later = c1 >= tau
        if later.any() and (c2[later] < tau).any() and (c2[later] >= tau).any() and \
                (c1 < tau).any():
            return tau
    pytest.fail("no threshold stops tokens at every rung")


def test_the_ladder_is_each_solves_logits_chosen_token_by_token():
    m = block_model()
    idx = torch.randint(0, m.config.vocab_size, (2, 23))
    tau = partial_tau(m, idx)
    ref, nfe, (e1, own) = reference(m, idx, tau)
    m.set_exit(tau, "confidence", ladder=LADDER)
    with torch.no_grad():
        out = m(idx)[0]
    assert torch.equal(out, ref)
    assert torch.equal(m.last_token_nfe, nfe) and set(nfe.unique().tolist()) == {1, 5, 21}
    # threshold 0: nobody settles, the own solve after every rung; inf: the first rung
    m.set_exit(0.0, "confidence", ladder=LADDER)
    with torch.no_grad():
        assert torch.equal(m(idx)[0], own) and (m.last_token_nfe == 21).all()
        m.set_exit(math.inf, "confidence", ladder=LADDER)
        assert torch.equal(m(idx)[0], e1) and (m.last_token_nfe == 1).all()
        m.set_exit(None)
        assert torch.equal(m(idx)[0], own) and m.last_token_nfe is None
        assert (m.config.ode_solver, m.config.ode_steps) == ("rk4", 4)


@pytest.mark.parametrize("kw", [dict(), dict(position="rope"), dict(ode_solver="midpoint"),
                                dict(field="parallel")], ids=str)
def test_causal_and_cached_decoding_equals_recompute(kw):
    m = block_model(**kw)
    idx = torch.randint(0, m.config.vocab_size, (2, 24))
    own = f"{m.config.ode_solver}:{m.config.ode_steps}"
    ladder = [r for r in LADDER if r != own]
    tau = None
    for q in (0.3, 0.5, 0.7):  # some tokens stop early, others go on
        e1 = solve_logits(m, "euler", 1, idx)
        tau = float(torch.quantile(1 - torch.softmax(e1, -1).amax(-1), q))
        m.set_exit(tau, "confidence", ladder=ladder)
        with torch.no_grad():
            m(idx)
        if m.last_token_nfe.min() < m.last_token_nfe.max():
            break
    check_causal(m, atol=1e-10)
    prompt = idx[:, :5]
    a = m.generate(prompt, 14, greedy=True)
    b = m.generate(prompt, 14, greedy=True, use_cache=False)
    assert torch.equal(a, b)
    state = m.init_state(2)
    steps = [m.step(a[:, :5], state)[0]] + [m.step(a[:, t:t + 1], state)[0]
                                            for t in range(5, a.shape[1] - 1)]
    with torch.no_grad():
        full = m(a[:, :-1])[0]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], rtol=0, atol=1e-10)
    # one token a call: a token that settled at a rung ran no later rung
    m.set_exit(tau, "confidence", ladder=ladder)
    state = m.init_state(1)
    m.step(a[:1, :5], state)
    for t in range(5, a.shape[1]):
        m.step(a[:1, t:t + 1], state)
        assert m.last_nfe == int(m.last_token_nfe.sum())
        assert state.pos == t + 1


def test_evaluation_and_cli_report_the_ladder(tiny_corpus, tmp_path):
    import json

    from conftest import run_cli, train_tiny
    from continuumlm.eval.perplexity import evaluate_contexts

    m = block_model().float()
    data = torch.randint(0, m.config.vocab_size, (300,))
    [full] = evaluate_contexts(m, data, [16], False, torch.device("cpu"))
    m.set_exit(math.inf, "confidence", ladder=["euler:1"])
    [early] = evaluate_contexts(m, data, [16], False, torch.device("cpu"))
    assert early["nfe_per_token"] == 1 and early["loss"] != full["loss"]

    def trained(name, kv):
        return train_tiny(tiny_corpus, tmp_path / name, "model.depth=ode", f"model.ode_kv={kv}")

    run = trained("block", "block")
    r = run_cli("eval", "--checkpoint", run, "--exit-ladder", "euler:1", "--exit-threshold",
                "inf", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["exit"] == {"threshold": float("inf"), "criterion": "confidence",
                           "ladder": ["euler:1"]}
    assert out["results"][0]["nfe_per_token"] == 1
    r = run_cli("generate", "--checkpoint", run, "--prompt", "the cat", "--max-new-tokens", "5",
                "--exit-ladder", "euler:1,rk4:1", "--exit-threshold", "0.5")
    assert r.returncode == 0, r.stderr
    assert "per-token exit across solves euler:1, rk4:1, then the own" in r.stderr
    for bad, says in [(["--exit-ladder", "euler"], "SOLVER:STEPS"),
                      (["--exit-ladder", "rk4:3", "--exit-threshold", "1"], "own solve"),
                      (["--exit-ladder", "euler:1"], "needs --exit-threshold"),
                      (["--exit-ladder", "euler:1", "--exit-threshold", "1",
                        "--exit-criterion", "state"], "criterion")]:
        r = run_cli("eval", "--checkpoint", run, *bad)
        assert r.returncode == 2 and says in r.stderr, r.stderr
    r = run_cli("eval", "--checkpoint", trained("evaluation", "evaluation"), "--exit-ladder",
                "euler:1", "--exit-threshold", "0.1")
    assert r.returncode == 2 and "ode_kv = 'block'" in r.stderr


def test_refusals():
    for kw, says in [(dict(ode_kv="evaluation"), "ode_kv = 'block'"),
                     (dict(num_layers=2), "one-block"),
                     (dict(mixer="deltanet"), "softmax")]:
        m = block_model(**kw)
        with pytest.raises(ValueError, match=says):
            m.set_exit(0.1, "confidence", ladder=["euler:1"])
    with pytest.raises(ValueError, match="one-block"):
        small_model().set_exit(0.1, "confidence", ladder=["euler:1"])
    m = block_model()
    for ladder, criterion, says in [(["rk4:4"], "confidence", "own solve"),
                                    (["euler:16"], "confidence", "fewer field evaluations"),
                                    (["euler"], "confidence", "SOLVER:STEPS"),
                                    (["nope:1"], "confidence", "unknown solver"),
                                    (["euler:1"], "state", "criterion"),
                                    (["euler:1"], "gate", "halting gate"),
                                    ([], "confidence", "at least one")]:
        with pytest.raises(ValueError, match=says):
            m.set_exit(0.1, criterion, ladder=ladder)
    with pytest.raises(ValueError, match=">= 0"):
        m.set_exit(-1.0, "confidence", ladder=["euler:1"])
    m.set_exit(0.1, "confidence", ladder=["euler:1"])
    from continuumlm import Draft
    with pytest.raises(ValueError, match="set_exit"):
        m.generate(torch.zeros(1, 2, dtype=torch.long), 3, draft=Draft("euler", 1))
    with pytest.raises(ValueError, match="eagerly"):
        m.generate(torch.zeros(1, 2, dtype=torch.long), 3, compile=True)
    m.train()
    with pytest.raises(ValueError, match="inference setting"):
        m(torch.zeros(1, 2, dtype=torch.long))


def test_the_last_rung_is_the_solve_the_model_has_now_and_solve_dependent_memory_is_refused():
    m = block_model()
    idx = torch.randint(0, m.config.vocab_size, (1, 9))
    own8 = solve_logits(m, "rk4", 8, idx)
    m.set_exit(0.0, "confidence", ladder=["euler:1"])
    m.set_solver(ode_steps=8)  # the own solve after the ladder was set: RK4 x 8
    with torch.no_grad():
        assert torch.equal(m(idx)[0], own8) and (m.last_token_nfe == 1 + 32).all()
    m.set_solver("euler", 1)  # no coarser solve left
    with torch.no_grad(), pytest.raises(ValueError, match="fewer field evaluations"):
        m(idx)
    m.set_exit(None)
    with pytest.raises(ValueError, match="ode_dt_embedding"):
        block_model(ode_dt_embedding=True).set_exit(0.1, "confidence", ladder=["euler:1"])
    with pytest.raises(ValueError, match="fixed-grid"):
        block_model(ode_solver="dopri5", ode_grad="direct").set_exit(0.1, "confidence",
                                                                      ladder=["euler:1"])
