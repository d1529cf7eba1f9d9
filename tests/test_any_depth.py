"""[train.any_depth]: coarse solves taught by the model's own solve in the same step."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import write_tiny_corpus
from continuumlm.config import load_config
from continuumlm.errors import ConfigError
from continuumlm.train.any_depth import AnyDepth

BASE = ["model.hidden_size=16", "model.num_heads=2", "model.num_layers=1", "model.depth=ode",
        "model.ode_solver=rk4", "model.ode_steps=2", "model.max_seq_len=16",
        "train.batch_size=2", "train.seq_len=8", "train.max_steps=3", "train.eval_interval=3",
        "train.eval_iters=1", "train.device=cpu", "train.warmup_steps=1"]


def config(*extra):
    return load_config(None, [*BASE, *extra])


@pytest.mark.parametrize("sets, match", [
    (['train.any_depth.drafts=["euler"]'], "SOLVER:STEPS"),
    (['train.any_depth.drafts=["euler:0"]'], "SOLVER:STEPS"),
    (['train.any_depth.drafts=[]'], "empty"),
    (['train.any_depth.drafts=["euler:1","euler:1"]'], "twice"),
    (['train.any_depth.drafts=["euler:1"]', "train.any_depth.draws=2"], "draws"),
    (['train.any_depth.drafts=["rk4:2"]'], "own solve"),
    (['train.any_depth.drafts=["dopri5:1"]'], "fixed-grid"),
    (['train.any_depth.drafts=["eulr:1"]'], "euler"),
    (['train.any_depth.drafts=["euler:1"]', "train.any_depth.weight=0"], "learn nothing"),
    (['train.any_depth.drafts=["euler:1"]', "model.depth=discrete"], "depth = 'ode'"),
    (['train.any_depth.drafts=["euler:1"]', "train.elastic.steps=[1,2]"], "one of them"),
    (["train.any_depth.drafs=1"], "did you mean 'drafts'"),
])
def test_bad_settings_are_refused_by_name(sets, match):
    with pytest.raises(ConfigError, match=match):
        config(*sets)


def test_draws_are_a_function_of_seed_and_step():
    cfg = config('train.any_depth.drafts=["euler:1","euler:2","rk4:1"]', "train.any_depth.draws=2",
                 "train.any_depth.every=2")
    model = torch.nn.Module()
    a, b = AnyDepth(model, cfg.train), AnyDepth(model, cfg.train)
    assert [a.drawn(s) for s in range(8)] == [b.drawn(s) for s in range(8)]
    assert all(a.drawn(s) == [] for s in (1, 3, 5))
    drawn = [a.drawn(s) for s in range(0, 40, 2)]
    assert all(len(d) == 2 and len(set(d)) == 2 for d in drawn)
    assert {x for d in drawn for x in d} == {("euler", 1), ("euler", 2), ("rk4", 1)}


def test_the_terms_are_the_kl_toward_the_own_solve_with_gradients_to_the_draft_only():
    """terms(): KL(own || coarse) with the own solve detached, the coarse solve's loss and the
    cross-entropy against the own greedy token, each equal to a hand computation; the model's
    solve is its own again afterwards."""
    from continuumlm.testing import small_model

    cfg = config('train.any_depth.drafts=["euler:1"]', "train.any_depth.top1_weight=1")
    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2).train()
    x = torch.randint(0, 37, (2, 8))
    y = torch.randint(0, 37, (2, 8))
    own, _ = model(x, y)
    terms = AnyDepth(model, cfg.train).terms(lambda: model(x, y), own, 0)
    assert (model.config.ode_solver, model.config.ode_steps) == ("rk4", 2)
    model.set_solver("euler", 1)
    coarse, coarse_loss = model(x, y)
    model.set_solver("rk4", 2)
    p, logq = F.softmax(own.detach(), -1), F.log_softmax(coarse, -1)
    kl = (p * (p.log() - logq)).sum(-1).mean()
    torch.testing.assert_close(terms["kl"], kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms["lm"], coarse_loss)
    top1 = F.nll_loss(logq.reshape(-1, 37), own.argmax(-1).reshape(-1))
    torch.testing.assert_close(terms["top1"], top1, rtol=1e-5, atol=1e-6)
    (g,) = torch.autograd.grad(terms["kl"], [own], allow_unused=True)
    assert g is None  # nothing flows into the own solve through its target


def test_a_run_logs_the_terms_and_keeps_its_own_solve(tmp_path):
    from continuumlm.train import Trainer

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"', *BASE,
                             'train.any_depth.drafts=["euler:1","rk4:1"]',
                             "train.any_depth.lm_weight=0.5"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert steps and all(r["nfe"] == 8 for r in steps)  # RK4 x 2: the own solve's NFE
    # KL >= 0 up to float32 rounding (a draft equal to the own solve reads about -1e-9)
    assert all(r["any_depth_kl"] >= -1e-6 and r["any_depth_lm"] > 0
               and len(r["any_depth_drafts"]) == 1 for r in steps)
    assert "any_depth_top1" not in steps[0]
    saved = load_config(tmp_path / "run" / "config.toml")
    assert saved.train.any_depth.drafts == ["euler:1", "rk4:1"]
    assert (saved.model.ode_solver, saved.model.ode_steps) == ("rk4", 2)


def _reference_agreement(model, data, context, solve):
    """Window by window, position by position: the obviously-correct count."""
    from continuumlm.data import eval_batches

    own = (model.config.ode_solver, model.config.ode_steps)
    same = total = 0
    kl = own_ce = ce = 0.0
    for x, y in eval_batches(data, context, 3):
        for b in range(x.shape[0]):
            a = model(x[b:b + 1])[0][0].double()
            model.set_solver(*solve)
            c = model(x[b:b + 1])[0][0].double()
            model.set_solver(*own)
            for t in range(x.shape[1]):
                if y[b, t] < 0:
                    continue
                p, q = a[t].softmax(-1), c[t].softmax(-1)
                same += int(a[t].argmax() == c[t].argmax())
                kl += float((p * (p.log() - q.log())).sum())
                own_ce -= float(p[y[b, t]].log())
                ce -= float(q[y[b, t]].log())
                total += 1
    return same / total, kl / total, total, ce / total, own_ce / total


@torch.no_grad()
def test_agreement_equals_a_position_by_position_count():
    from continuumlm.eval.agreement import agreement
    from continuumlm.testing import small_model

    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2, vocab_size=5).eval()
    with torch.no_grad():  # weights away from the initialization: the solves differ
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    data = torch.randint(0, 5, (101,))  # 101: a tail window with already-scored targets
    got = agreement(model, data, 12, [("euler", 1), ("rk4", 2)], torch.device("cpu"),
                    batch_tokens=36)
    same, kl, n, ce, own_ce = _reference_agreement(model, data, 12, ("euler", 1))
    assert got["euler:1"]["positions"] == n == 100
    assert got["euler:1"]["loss"] == pytest.approx(ce, rel=1e-5)
    assert got["euler:1"]["own_loss"] == pytest.approx(own_ce, rel=1e-5)
    assert got["euler:1"]["agreement"] == pytest.approx(same)
    assert got["euler:1"]["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
    assert 0 < same < 1  # the check has something to count
    assert got["rk4:2"]["agreement"] == 1.0 and got["rk4:2"]["kl"] == pytest.approx(0, abs=1e-6)
    assert (model.config.ode_solver, model.config.ode_steps) == ("rk4", 2)


def test_eval_agreement_from_the_command_line(tmp_path):
    from conftest import run_cli
    from continuumlm.train import Trainer

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"', *BASE,
                             "train.max_steps=1", "train.eval_interval=1"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    r = run_cli("eval", "--checkpoint", tmp_path / "run", "--which", "last", "--agreement", "euler:1,rk4:1",
                "--json", "--max-windows", "4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["agreement"]) == set(out["agreement_kl"]) == {"euler:1", "rk4:1"}
    assert all(0 <= v <= 1 for v in out["agreement"].values())
    r = run_cli("eval", "--checkpoint", tmp_path / "run", "--which", "last", "--agreement", "euler:1",
                "--max-windows", "4")
    assert r.returncode == 0 and "greedy same" in r.stdout and "euler:1" in r.stdout, r.stderr
    for bad, match in (("euler", "SOLVER:STEPS"), ("eulr:1", "euler"),
                       ("dopri5:1", "dopri5")):
        r = run_cli("eval", "--checkpoint", tmp_path / "run", "--which", "last", "--agreement", bad)
        assert r.returncode == 2 and match in r.stderr, (bad, r.stderr)


@pytest.mark.parametrize("skip", [False, True], ids=["detached", "skip"])
@pytest.mark.parametrize("grad", ["direct", "checkpoint", "binomial"])  # exact discrete gradients
def test_truncated_backprop_is_the_gradient_through_the_last_steps(grad, skip):
    """backprop_steps = m: the same forward (loss) as the whole solve, and the gradient of an
    obviously-correct reference: the first n - m Euler steps taken by hand without autograd,
    the last m with it; with backprop_skip, the gradient at the state after the first n - m
    steps also goes on to the block's input as it is (a second backward, from that input)."""
    from continuumlm.model.extras import SolveExtras
    from continuumlm.testing import small_model

    model = small_model(depth="ode", ode_solver="euler", ode_steps=5, num_layers=1,
                        ode_grad=grad, dropout=0.0).train()
    x = torch.randint(0, 37, (2, 6))
    y = torch.randint(0, 37, (2, 6))
    full = model(x, y)[1]
    model.depth.extras = SolveExtras(backprop_steps=2, backprop_skip=skip)
    try:
        loss = model(x, y)[1]
    finally:
        model.depth.extras = None
    torch.testing.assert_close(loss, full)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params, allow_unused=True)

    block = model.depth.blocks[0]
    field = block.field

    def reference():
        h0 = model.drop(model.tok_emb(x) + (model.pos_emb(torch.arange(6)) if model.pos_emb
                                            is not None else 0))
        dt = 1 / 5
        field.dt = dt
        with torch.no_grad():
            h = h0
            for k in range(3):
                h = h + dt * field(k * dt, h)
        s = h.detach().requires_grad_(skip)
        h = s
        for k in range(3, 5):
            h = h + dt * field(k * dt, h)
        if field.post_mlp:
            h = h + block.mlp(block.norm_mlp(h))
        logits = model.lm_head(model.norm_f(h))
        return F.cross_entropy(logits.reshape(-1, 37), y.reshape(-1)), h0, s

    ref, h0, s = reference()
    torch.testing.assert_close(ref, loss, rtol=1e-5, atol=1e-6)
    want = torch.autograd.grad(ref, [*params, s] if skip else params, allow_unused=True)
    if skip:  # the state's gradient, sent on from the block's input as it is
        want, at_state = want[:-1], want[-1]
        more = torch.autograd.grad(h0, params, grad_outputs=at_state, allow_unused=True)
        want = [b if m is None else m if b is None else b + m for b, m in zip(want, more)]
        assert any(m is not None and m.abs().sum() > 0 for m in more)  # the embeddings learn
    for name, a, b in zip([n for n, p in model.named_parameters() if p.requires_grad], got, want):
        if b is None:
            assert a is None or not a.any(), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_truncation_config_refusals():
    with pytest.raises(ConfigError, match="positive integer"):
        config("train.any_depth.backprop_steps=0")
    with pytest.raises(ConfigError, match="adaptive"):
        config("train.any_depth.backprop_steps=2", "model.ode_solver=dopri5")
    with pytest.raises(ConfigError, match="depth = 'discrete'"):
        config("train.any_depth.backprop_steps=2", "model.depth=discrete")
    cfg = config("train.any_depth.backprop_steps=1", "train.elastic.steps=[1,2,4]")
    assert cfg.train.any_depth.backprop_steps == 1 and not cfg.train.any_depth.enabled
    with pytest.raises(ConfigError, match="backprop_steps is not set"):
        config("train.any_depth.backprop_skip=true")
    assert config("train.any_depth.backprop_steps=1",
                  "train.any_depth.backprop_skip=true").train.any_depth.backprop_skip


def forward_keeping_states(model, x):
    """(logits, the states between solver steps) of a training forward that keeps them."""
    from continuumlm.model.extras import SolveExtras

    model.depth.extras = SolveExtras(readout=True)
    try:
        logits, _ = model(x)
    finally:
        model.depth.extras = None
    return logits, model.depth.last_step_states


def test_the_gate_learns_whether_each_step_already_has_the_final_greedy_token(tmp_path):
    """gate_loss: the binary cross-entropy of the gate on the own solve's states between steps
    against 'its read-out's greedy token is the final one', computed by hand; only the gate's
    weights get a gradient from it; a run logs it."""
    from continuumlm.testing import small_model
    from continuumlm.train import Trainer

    cfg = config("model.exit_gate=true", "train.any_depth.gate_weight=1.0")
    model = small_model(depth="ode", ode_solver="euler", ode_steps=3, num_layers=1,
                        exit_gate=True).train()
    logits, states = forward_keeping_states(model, torch.randint(0, 37, (2, 7)))
    assert len(states) == 2  # after steps 1 and 2 of 3
    loss = AnyDepth(model, cfg.train).gate_loss(logits)
    final = logits.argmax(-1)
    ref = torch.stack([F.binary_cross_entropy_with_logits(
        model.exit_gate(model.norm_f(h)).squeeze(-1),
        (model.lm_head(model.norm_f(h)).argmax(-1) == final).float()) for h in states]).mean()
    torch.testing.assert_close(loss, ref)
    grads = torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    named = dict(zip([n for n, _ in model.named_parameters()], grads))
    assert named["exit_gate.weight"] is not None
    assert all(g is None for n, g in named.items() if not n.startswith("exit_gate."))

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    run_cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"', *BASE,
                                 "model.exit_gate=true", "train.any_depth.gate_weight=1.0"])
    Trainer(run_cfg, tmp_path / "run", quiet=True).run()
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["any_depth_gate"] > 0 for r in rows if "loss" in r)


@pytest.mark.parametrize("sets, match", [
    (["train.any_depth.step_weight=-1"], "step_weight must be >= 0"),
    (["train.any_depth.step_weight=1", "model.ode_steps=1"],
     "step_weight reads out the states between solver steps; model.ode_steps = 1"),
    (["train.any_depth.step_weight=1", "model.ode_steps=1", "train.elastic.steps=[1]"],
     "train.elastic.steps = \\[1\\] has none"),
    (["train.any_depth.step_weight=1", "model.depth=discrete"], "step_weight reads out an ODE"),
    (["train.any_depth.step_weight=1", "model.ode_grad=adjoint"], "'direct' or 'checkpoint'"),
    (["train.any_depth.step_weight=1", "model.ode_solver=tsit5"], "'tsit5' is adaptive"),
    (["train.any_depth.step_weight=1", "model.ode_solver=reversible_heun",
      "model.ode_grad=direct"], "'reversible_heun' is reversible"),
    (["train.any_depth.gate_weight=1", "model.exit_gate=true", "model.ode_solver=tsit5"],
     "gate_weight reads out the states of a fixed grid"),
])
def test_bad_step_read_out_settings_are_refused_by_name(sets, match):
    with pytest.raises(ConfigError, match=match):
        config(*sets)


def test_step_read_outs_on_elastic_draws_of_more_than_one_step_are_allowed():
    cfg = config("train.any_depth.step_weight=1", "model.ode_steps=1", "train.elastic.steps=[1,4]")
    assert cfg.train.any_depth.step_weight == 1


def test_the_step_read_outs_and_the_gate_read_the_targets_positions_of_a_targets_only_task():
    """A task whose head runs at its targets only (MQAR: logits (N, V)) gets the terms of the
    states at those positions, in order: equal to the full-position terms on a batch where
    every position has a target, and to the kept positions' terms otherwise."""
    from continuumlm.testing import small_model

    cfg = config("model.exit_gate=true", "train.any_depth.gate_weight=1.0",
                 "train.any_depth.step_weight=1.0")
    torch.manual_seed(0)
    model = small_model(depth="ode", ode_solver="euler", ode_steps=3, num_layers=1,
                        exit_gate=True).double().train()
    any_depth = AnyDepth(model, cfg.train)
    x = torch.randint(0, 37, (2, 6))
    y = torch.randint(0, 37, (2, 6))
    y[0, :3] = -1
    logits, states = forward_keeping_states(model, x)
    keep = y >= 0
    kept = logits[keep]
    for term in ("step_loss", "gate_loss"):
        got = getattr(any_depth, term)(kept, y)
        # the reference: the full-position term of a model whose states and logits are the
        # kept positions alone, as a batch of one row
        model.depth.last_step_states = [h[keep][None] for h in states]
        want = getattr(any_depth, term)(kept[None])
        model.depth.last_step_states = states
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="pass the targets"):
        any_depth.step_loss(kept)


def test_the_step_read_outs_learn_the_own_solves_distribution(tmp_path):
    """step_loss: the mean over the own solve's states between steps of KL(own || read-out),
    equal to a hand computation in float64 on an awkward shape; its gradient is that of the
    hand computation with the own distribution and the read-out's weights (final norm, head)
    held constant, so it moves the states only; a run logs it, and a run without it logs
    nothing of it."""
    from continuumlm.testing import small_model
    from continuumlm.train import Trainer

    cfg = config("train.any_depth.step_weight=0.5")
    torch.manual_seed(3)
    model = small_model(depth="ode", ode_solver="rk4", ode_steps=3, num_layers=2).double().train()
    logits, states = forward_keeping_states(model, torch.randint(0, 37, (3, 5)))
    assert len(states) == 4  # 2 blocks, after steps 1 and 2 of 3
    loss = AnyDepth(model, cfg.train).step_loss(logits)
    own = logits.detach().double().softmax(-1)
    # the read-out as constants: copies that take no gradient
    head = copy.deepcopy(model.lm_head).requires_grad_(False)
    norm = copy.deepcopy(model.norm_f).requires_grad_(False)
    ref = torch.stack([
        (own * (own.log() - head(norm(h)).double().log_softmax(-1))).sum(-1)
        .mean() for h in states]).mean()
    torch.testing.assert_close(loss.double(), ref)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(ref, params, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g.double(), w)
    assert any(g is not None and g.abs().sum() > 0 for g in got)
    named = dict(zip([n for n, _ in model.named_parameters()], got))
    assert all(g is None or not g.abs().sum() for n, g in named.items()
               if n.startswith("norm_f."))

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    for name, extra in (("with", ["train.any_depth.step_weight=0.5"]), ("without", [])):
        run_cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"', *BASE,
                                     *extra])
        Trainer(run_cfg, tmp_path / name, quiet=True).run()
        rows = [json.loads(r) for r in
                (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "loss" in r]
        if extra:
            assert steps and all(r["any_depth_step"] > 0 for r in steps)
        else:
            assert not any("any_depth_step" in r for r in rows)
