"""The ODE solve's regularizers (train.regularize.kinetic_weight, train.regularize.jacobian_weight) and STEER
(train.regularize.steer): the integrals against references computed from the field's own evaluations,
gradients equal across gradient modes (double backward through recomputation), only in
training, logged apart and reproduced by a resumed run; config refusals."""

from __future__ import annotations

import pytest
import torch

from continuumlm import ConfigError, LanguageModel, ModelConfig, load_config
from continuumlm.model.extras import SolveExtras
from continuumlm.ode.solvers import TABLEAUS
from continuumlm.registry import MIXERS

BASE = dict(vocab_size=29, hidden_size=16, num_heads=2, num_layers=1, max_seq_len=32,
            depth="ode", ode_time_embedding="sinusoidal")


def build(**kw) -> LanguageModel:
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(**{**BASE, **kw})).double().train()
    with torch.no_grad():
        for b in m.depth.blocks:
            b.field.time.proj.weight.normal_(0, 0.2)
    return m


def field_outputs(m, idx):
    """Every evaluation of the field in an ordinary forward, in order."""
    outs = []
    field = m.depth.blocks[0].field
    handle = field.register_forward_hook(lambda mod, args, out: outs.append(out.detach()))
    with torch.no_grad():
        m(idx)
    handle.remove()
    return outs


@pytest.mark.parametrize("solver,steps", [("euler", 3), ("rk4", 2), ("heun", 3)])
def test_kinetic_energy_is_the_solvers_quadrature_of_the_squared_field(solver, steps):
    m = build(ode_solver=solver, ode_steps=steps)
    idx = torch.randint(0, 29, (2, 7))
    outs = field_outputs(m, idx)
    b, dt = TABLEAUS[solver].b, 1.0 / steps
    ref = sum(dt * b[i % len(b)] * o.pow(2).mean(-1) for i, o in enumerate(outs)).mean()
    m.depth.extras = SolveExtras(kinetic=True)
    with torch.no_grad():
        plain = m(idx)[0]
    got = m.last_regularizers["kinetic"]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    m.depth.extras = None
    with torch.no_grad():  # the integral rides along: h itself is unchanged
        torch.testing.assert_close(m(idx)[0], plain, rtol=0, atol=1e-12)


def test_jacobian_term_is_the_probed_vector_jacobian_product():
    m = build(ode_solver="euler", ode_steps=1, dropout=0.0)
    idx = torch.randint(0, 29, (2, 5))
    m.depth.extras = SolveExtras(jacobian=True)
    torch.manual_seed(7)
    m(idx)
    got = m.last_regularizers["jacobian"]
    # reference: the same probe (the first draw after the seed), df/dh at h0 by autograd
    x = m.tok_emb(idx)  # rope positions: nothing added before the depth
    torch.manual_seed(7)
    probe = torch.randn_like(x)
    h = x.detach().requires_grad_(True)
    field = m.depth.blocks[0].field
    field.dt = 1.0
    vjp = torch.autograd.grad(field(0.0, h), h, probe)[0]
    torch.testing.assert_close(got, vjp.pow(2).mean(-1).mean(), rtol=1e-10, atol=0)


def grads(m, idx, seed=3):
    m.zero_grad()
    torch.manual_seed(seed)
    _, loss = m(idx, idx.roll(-1, 1))
    regs = m.last_regularizers
    (loss + 0.5 * regs["kinetic"] + 0.3 * regs["jacobian"]).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kw", [dict(ode_grad="checkpoint"), dict(ode_grad="binomial",
                                                                  ode_checkpoints=1)],
                         ids=["checkpoint", "binomial"])
def test_gradients_through_recomputation_equal_direct(kw):
    idx = torch.randint(0, 29, (2, 6))
    ref = build(ode_solver="rk4", ode_steps=3)
    ref.depth.extras = SolveExtras(kinetic=True, jacobian=True)
    g_d = grads(ref, idx)
    m = build(ode_solver="rk4", ode_steps=3, **kw)
    m.load_state_dict(ref.state_dict())
    m.depth.extras = SolveExtras(kinetic=True, jacobian=True)
    g = grads(m, idx)
    for n in g_d:
        torch.testing.assert_close(g[n], g_d[n], rtol=1e-9, atol=1e-12, msg=n)


@pytest.mark.parametrize("kw", [dict(ode_solver="tsit5", ode_grad="adjoint"),
                                dict(ode_solver="tsit5", ode_grad="checkpoint"),
                                dict(ode_solver="rk4", ode_grad="adjoint"),
                                dict(ode_solver="reversible_heun", ode_grad="reversible")],
                         ids=lambda k: f"{k['ode_solver']}-{k['ode_grad']}")
def test_every_gradient_mode_takes_the_regularizers(kw):
    """Each mode differentiates the regularized loss: reversible equals direct backprop; the
    accepted steps replayed differ from it only by the step-size controller's dependence on
    the state, which direct backprop also follows (4e-5 here); the adjoint comes close."""
    idx = torch.randint(0, 29, (2, 6))
    m = build(**kw)
    m.depth.extras = SolveExtras(kinetic=True, jacobian=True)
    g = grads(m, idx)
    assert g and all(torch.isfinite(v).all() for v in g.values())
    assert set(m.last_regularizers) == {"kinetic", "jacobian"}
    ref = build(**{**kw, "ode_grad": "direct"})
    ref.depth.extras = SolveExtras(kinetic=True, jacobian=True)
    want = grads(ref, idx)
    assert g.keys() == want.keys()
    a, b = (torch.cat([d[n].flatten() for n in sorted(want)]) for d in (g, want))
    bound = {"reversible": 1e-10, "checkpoint": 1e-3, "adjoint": 3e-2}[kw["ode_grad"]]
    assert ((a - b).norm() / b.norm()).item() < bound


def test_only_in_training_and_steer_moves_the_end_time():
    m = build(ode_solver="euler", ode_steps=2)
    idx = torch.randint(0, 29, (1, 5))
    m.eval()
    with torch.no_grad():
        ref = m(idx)[0]
        m.depth.extras = SolveExtras(kinetic=True, t1=1.3)
        assert torch.equal(m(idx)[0], ref) and m.last_regularizers == {}
    m.train()
    with torch.no_grad():
        longer = m(idx)[0]
    m.depth.extras = None
    m2 = build(ode_solver="euler", ode_steps=2, ode_t1=1.3)
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(longer, m2.train()(idx)[0], rtol=0, atol=1e-12)


def reg_cfg(corpus, *extra):
    return load_config(None, [
        "data.dataset=text", f'data.path="{corpus}"', "model.hidden_size=32",
        "model.num_heads=2", "model.num_layers=1", "model.depth=ode", "model.dropout=0.1",
        "model.ode_solver=tsit5", "model.ode_rtol=1e-3", "model.ode_atol=1e-4",
        "train.regularize.kinetic_weight=0.1",
        "train.regularize.jacobian_weight=0.01", "train.regularize.steer=0.25", "train.batch_size=4",
        "train.seq_len=16", "train.max_steps=8", "train.lr_decay_steps=8",
        "train.warmup_steps=2", "train.log_interval=1", "train.eval_interval=4",
        "train.eval_iters=2", "train.checkpoint_interval=3", "train.device=cpu", *extra])


def test_training_logs_them_and_a_resumed_run_repeats_them(tiny_corpus, tmp_path):
    from continuumlm.train import Trainer
    from continuumlm.train.logging import read_metrics

    Trainer(reg_cfg(tiny_corpus), tmp_path / "full", quiet=True).run()
    Trainer(reg_cfg(tiny_corpus, "train.max_steps=3"), tmp_path / "cut", quiet=True).run()
    Trainer(reg_cfg(tiny_corpus), tmp_path / "cut", resume=True, quiet=True).run()

    def events(run):
        return {e["step"]: e for e in read_metrics(run) if "loss" in e}

    a, b = events(tmp_path / "full"), events(tmp_path / "cut")
    keys = ("loss", "kinetic", "jacobian", "ode_t1")
    assert {k: tuple(v[x] for x in keys) for k, v in a.items()} == \
        {k: tuple(v[x] for x in keys) for k, v in b.items()}
    assert all(e["kinetic"] > 0 and e["jacobian"] > 0 for e in a.values())
    assert len({e["ode_t1"] for e in a.values()}) == len(a)
    assert all(0.75 <= e["ode_t1"] <= 1.25 for e in a.values())


def test_seminorm_needs_an_adaptive_adjoint():
    with pytest.raises(ConfigError, match="needs ode_grad = 'adjoint' with an adaptive"):
        ModelConfig(**{**BASE, "ode_adjoint_norm": "seminorm", "ode_solver": "rk4",
                       "ode_grad": "adjoint"})
    ModelConfig(**{**BASE, "ode_adjoint_norm": "seminorm", "ode_solver": "tsit5",
                   "ode_grad": "adjoint"})


@pytest.mark.parametrize("extra,needle", [
    (["model.depth=discrete"], "regularizes an ODE model"),
    (["train.regularize.steer=1.0"], "must be below"),
    (["train.regularize.kinetic_weight=-1"], ">= 0"),
    (["train.compile=true"], "recompile"),
    (["model.ode_solver=rk4"], "fixed-grid 'rk4' every solve takes the same steps"),
])
def test_refusals(tiny_corpus, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        reg_cfg(tiny_corpus, *extra)


def test_jacobian_term_gradient_against_finite_differences():
    """The Jacobian term is differentiated through a vector-Jacobian product (a second
    derivative): its gradient on a few weights matches central differences of the term,
    computed with the same probe (same seed)."""
    m = build(ode_solver="tsit5", ode_rtol=1e-9, ode_atol=1e-11, dropout=0.0)
    m.depth.extras = SolveExtras(jacobian=True)
    idx = torch.randint(0, 29, (1, 5))

    def term():
        torch.manual_seed(11)
        m(idx)
        return m.last_regularizers["jacobian"]

    m.zero_grad()
    term().backward()
    w = m.depth.blocks[0].field.mlp.fc.weight
    for i, j in ((0, 0), (3, 5), (7, 2)):
        analytic = w.grad[i, j].item()
        eps = 1e-5
        with torch.no_grad():
            w[i, j] += eps
            up = term().item()
            w[i, j] -= 2 * eps
            down = term().item()
            w[i, j] += eps
        numeric = (up - down) / (2 * eps)
        assert abs(analytic - numeric) <= 1e-5 * max(1.0, abs(numeric)), (i, j, analytic, numeric)
    assert w.grad.abs().sum() > 0


def test_exit_refused_in_a_regularized_training_step():
    m = build(ode_solver="rk4")
    m.set_exit(0.5)
    m.depth.extras = SolveExtras(t1=1.1)
    with pytest.raises(ValueError, match="inference setting"):
        m(torch.randint(0, 29, (1, 5)))


@pytest.mark.parametrize("extra,needle", [
    (["train.elastic.steps=[2, 4]", "train.elastic.consistency_weight=0.5",
      "model.ode_solver=rk4", "train.regularize.kinetic_weight=0", "train.regularize.jacobian_weight=0"],
     "different intervals"),
    (["model.ode_solver=rk4", "model.ode_grad=binomial", "train.regularize.kinetic_weight=0",
      "train.regularize.jacobian_weight=0", "train.regularize.steer=0", "train.elastic.steps=[2, 5000]"],
     "at most 4096"),
])
def test_more_refusals(tiny_corpus, extra, needle):
    with pytest.raises(ConfigError, match=needle):
        reg_cfg(tiny_corpus, *extra)


@pytest.mark.parametrize("grad", ["direct", "checkpoint"])
def test_step_readout_is_the_readout_loss_of_every_state_between_steps(grad):
    """train.regularize.step_readout_weight: the term is the mean cross-entropy of the read-out of the
    states after steps 1..N-1 of every block, computed here by stepping the solver by hand;
    its gradient reaches the field (checkpointed steps too)."""
    import torch.nn.functional as F

    from continuumlm.ode.grad import grid
    from continuumlm.train.elastic import step_readout_loss

    m = build(ode_solver="rk4", ode_steps=3, ode_grad=grad, num_layers=2)
    idx, y = torch.randint(0, 29, (2, 7)), torch.randint(0, 29, (2, 7))
    y[0, :2] = -1  # ignored, as in the model's loss
    m.depth.extras = SolveExtras(readout=True)
    m(idx, y)
    term = step_readout_loss(m, y)
    assert len(m.depth.last_step_states) == 2 * 2  # two blocks, two states between 3 steps
    # by hand: the same blocks, stepped one at a time
    losses, x = [], m.tok_emb(idx)
    m.depth.extras = None
    for block in m.depth.blocks:
        block.eval()  # no dropout in BASE anyway; the hand-made solve below

        def f(t, h, block=block):
            return block.field(t, h, None)

        dt = 1.0 / 3
        h = x
        for n, t in enumerate(grid(0.0, 1.0, 3)):
            h = block.solver.step(f, t, h, dt)
            if n < 2:
                logits = m.lm_head(m.norm_f(h))
                losses.append(F.cross_entropy(logits.flatten(0, 1), y.reshape(-1),
                                              ignore_index=-1))
        x = h
    m.train()
    torch.testing.assert_close(term, torch.stack(losses).mean(), rtol=1e-10, atol=1e-12)
    term.backward()
    grads = [p.grad for p in m.depth.blocks[0].field.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    m.depth.extras = None
    m(idx)  # without the extras nothing is kept
    assert m.depth.last_step_states == []
    m.set_solver("rk4", 1)  # an elastic draw of one step: no state between steps, term 0
    m.depth.extras = SolveExtras(readout=True)
    m(idx, y)
    assert step_readout_loss(m, y).item() == 0.0


def test_training_with_step_readout_logs_it_and_resumes_exactly(tiny_corpus, tmp_path):
    from continuumlm.train import Trainer
    from continuumlm.train.logging import read_metrics

    sets = ["model.ode_solver=rk4", "model.ode_steps=2", "train.regularize.kinetic_weight=0",
            "train.regularize.jacobian_weight=0", "train.regularize.steer=0", "train.regularize.step_readout_weight=0.5"]
    Trainer(reg_cfg(tiny_corpus, *sets), tmp_path / "full", quiet=True).run()
    Trainer(reg_cfg(tiny_corpus, *sets, "train.max_steps=3"), tmp_path / "cut", quiet=True).run()
    Trainer(reg_cfg(tiny_corpus, *sets), tmp_path / "cut", resume=True, quiet=True).run()

    def events(run):
        return {e["step"]: (e["loss"], e["step_readout"]) for e in read_metrics(run)
                if "loss" in e}

    assert events(tmp_path / "full") == events(tmp_path / "cut")
    assert all(r > 0 for _, r in events(tmp_path / "full").values())


@pytest.mark.parametrize("extra,needle", [
    (["model.depth=discrete"], "has none"),
    (["model.ode_solver=dopri5"], "'dopri5' is adaptive"),
    (["model.ode_solver=reversible_heun", "model.ode_grad=reversible"], "is reversible"),
    (["model.ode_solver=rk4", "model.ode_grad=adjoint"], "'direct' or 'checkpoint'"),
    (["model.ode_solver=rk4", "model.ode_steps=1"], "at least two steps"),
    (["model.ode_solver=rk4", "model.ode_steps=4", "train.elastic.steps=[1]"],
     r"train.elastic.steps = \[1\] has none"),
    (["model.ode_solver=rk4", "train.elastic.steps=[2]", "train.elastic.solvers=[\"dopri5\"]"],
     "'dopri5' is adaptive"),
])
def test_step_readout_refusals(tiny_corpus, extra, needle):
    base = ["train.regularize.kinetic_weight=0", "train.regularize.jacobian_weight=0", "train.regularize.steer=0",
            "train.regularize.step_readout_weight=0.1"]
    with pytest.raises(ConfigError, match=needle):
        reg_cfg(tiny_corpus, *base, *extra)
    # the elastic choices are what training integrates with: an adaptive model solver is
    # not used then
    reg_cfg(tiny_corpus, *base, "train.elastic.steps=[1, 2]",
            "train.elastic.solvers=[\"rk4\"]")


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_the_jacobian_term_trains_with_every_mixer(mixer):
    """The Jacobian term is differentiated twice; a mixer whose fast kernel has a
    once-differentiable backward (chunkwise DeltaNet) uses a twice-differentiable form there
    instead of failing at the first step. Its gradient equals the central difference of the
    term (float64; the cross-entropy is computed in float32) along a random direction."""
    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(**{**BASE, "mixer": mixer, "ode_solver": "rk4",
                                     "ode_steps": 2, "dropout": 0.0})).double().train()
    m.depth.extras = SolveExtras(jacobian=True)
    idx = torch.randint(0, 29, (2, 7))

    def objective():
        torch.manual_seed(3)  # the same probe every time
        m(idx)
        return m.last_regularizers["jacobian"]

    m.zero_grad()
    objective().backward()
    params = [p for p in m.parameters() if p.grad is not None]
    direction = [torch.randn_like(p) for p in params]
    slope = sum((p.grad * d).sum() for p, d in zip(params, direction)).item()
    eps = 1e-5  # DeltaNet's per-head norm computes in float32: smaller steps hit its round-off
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            with torch.enable_grad():  # the probe's vector-Jacobian product needs a graph
                values.append(objective().item())
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
    assert slope == pytest.approx((values[0] - values[1]) / (2 * eps), rel=1e-3)
