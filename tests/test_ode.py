import logging
import re
import types

import pytest
import torch

from conftest import assert_cached_decoding_exact
from continuumlm import ConfigError, LanguageModel, ModelConfig
from continuumlm.ode import ODESolverError, ReversibleHeun, integrate
from continuumlm.registry import FIELDS as FIELD_REGISTRY
from continuumlm.registry import MIXERS, SOLVERS

# every registered component, so a new one (or a plugin's) is covered by the same tests
FIXED = sorted(n for n in SOLVERS if SOLVERS.component_class(n).fixed_grid)
NON_REVERSIBLE_FIXED = [n for n in FIXED if not SOLVERS.component_class(n).reversible]
ADAPTIVE = sorted(n for n in SOLVERS if not SOLVERS.component_class(n).fixed_grid)
FIELDS = sorted(FIELD_REGISTRY)
MIXER_NAMES = sorted(MIXERS)


def ode_cfg(**kw):
    base = dict(vocab_size=29, hidden_size=32, num_heads=4, num_layers=2, max_seq_len=64,
                depth="ode", field="sequential", ode_solver="rk4", ode_steps=3)
    base.update(kw)
    return ModelConfig(**base)


def ode_model(**kw):
    torch.manual_seed(0)
    return LanguageModel(ode_cfg(**kw))


# ------------------------------------------------------------------ solvers on a linear ODE

def _linear_problem():
    torch.manual_seed(0)
    A = torch.randn(4, 4, dtype=torch.float64) * 0.7
    y0 = torch.randn(3, 4, dtype=torch.float64)
    exact = y0 @ torch.linalg.matrix_exp(A).T
    return A, y0, exact


@pytest.mark.parametrize("name,order", [("euler", 1), ("midpoint", 2), ("heun", 2), ("rk4", 4),
                                        ("rk4_38", 4), ("reversible_heun", 2)])
def test_order_of_convergence(name, order):
    A, y0, exact = _linear_problem()
    solver = SOLVERS[name](ode_cfg())

    def err(steps):
        y = integrate(lambda t, y: y @ A.T, y0, 0.0, 1.0, solver, steps, "direct")
        return (y - exact).abs().max().item()

    ratio = err(16) / err(32)
    assert 2 ** order * 0.8 < ratio < 2 ** order * 1.25, ratio


def test_rk4_is_the_classical_rule_not_three_eighths():
    # on dy/dt = t^4 (y-independent) a single step is exact up to the quadrature rule:
    # Simpson (classical RK4) gives 5/24 and the 3/8 rule gives 11/54 for int_0^1 t^4 dt = 1/5
    y0 = torch.zeros(1, dtype=torch.float64)
    f = lambda t, y: torch.full_like(y, t ** 4)  # noqa: E731
    one = integrate(f, y0, 0.0, 1.0, SOLVERS["rk4"](ode_cfg()), 1, "direct").item()
    three8 = integrate(f, y0, 0.0, 1.0, SOLVERS["rk4_38"](ode_cfg()), 1, "direct").item()
    assert one == pytest.approx(5 / 24) and three8 == pytest.approx(11 / 54)


# ------------------------------------------------------------------ model-level invariants

@pytest.mark.parametrize("solver,steps,per_block", [("euler", 4, 4), ("rk4", 4, 16),
                                                   ("midpoint", 3, 6), ("reversible_heun", 4, 5)])
def test_nfe_counts(solver, steps, per_block):
    m = ode_model(ode_solver=solver, ode_steps=steps)
    m(torch.randint(0, 29, (1, 5)))
    assert m.last_nfe == 2 * per_block


@pytest.mark.parametrize("solver", FIXED)
def test_parameter_count_independent_of_steps(solver):
    counts = {ode_model(ode_solver=solver, ode_steps=s).num_parameters() for s in (1, 4, 16)}
    assert len(counts) == 1


@pytest.mark.parametrize("mixer", MIXER_NAMES)
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("solver", FIXED)
def test_fixed_grid_decoder_is_causal(solver, field, mixer):
    m = ode_model(ode_solver=solver, field=field, mixer=mixer).eval()
    idx = torch.randint(0, 29, (2, 12))
    ref, _ = m(idx)
    alt = idx.clone()
    alt[:, 6:] = (alt[:, 6:] + 1) % 29
    out, _ = m(alt)
    torch.testing.assert_close(out[:, :6], ref[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(out[:, 6:], ref[:, 6:])


def test_adaptive_solver_couples_positions(caplog):
    """The documented pitfall: one error norm over the whole state leaks the future (said
    once per solver and process)."""
    from continuumlm.model import depth

    depth._WARNED.discard("dopri5")
    with caplog.at_level(logging.WARNING, logger="continuumlm"):
        m = ode_model(ode_solver="dopri5", ode_rtol=1e-3, ode_atol=1e-4).eval()
    assert "not exactly causal" in caplog.text
    idx = torch.randint(0, 29, (2, 12))
    alt = idx.clone()
    alt[:, 6:] = (alt[:, 6:] + 1) % 29
    ref, out = m(idx)[0], m(alt)[0]
    assert not torch.equal(out[:, :6], ref[:, :6])  # earlier positions moved
    torch.testing.assert_close(out[:, :6], ref[:, :6], rtol=0, atol=1e-2)  # but only slightly


@pytest.mark.parametrize("method", ADAPTIVE)
def test_adaptive_max_steps_is_a_clear_error(method, monkeypatch):
    """The message names the block and the step torchdiffeq last attempted (it gave the gap
    between the last two evaluations: always 0 for dopri5, whose last stages share a time)."""
    import continuumlm.ode.adaptive as ad

    attempted = []
    original = ad._Func.callback_step
    monkeypatch.setattr(ad._Func, "callback_step", lambda self, t0, y0, dt: (
        attempted.append((float(t0.detach()), float(dt.detach()))), original(self, t0, y0, dt)))
    m = ode_model(ode_solver=method, ode_rtol=1e-9, ode_atol=1e-9, ode_max_steps=3)
    with pytest.raises(ODESolverError, match=rf"ODE block 0: the solve of the adaptive solver "
                                             rf"{method} stopped at t = .*step size") as e:
        m(torch.randint(0, 29, (1, 8)))
    t, step = (float(x) for x in re.search(r"t = (\S+) with step size (\S+) ", str(e.value)).groups())
    assert step > 0 and (t, step) == pytest.approx(attempted[-1], rel=5e-3)  # 3 digits shown


def test_adjoint_backward_running_out_of_steps_is_a_solver_error():
    """The adjoint's backward solve runs inside loss.backward(), past the forward's error
    translation: solver_errors() (which the trainers wrap backward in) names it."""
    from continuumlm.ode import solver_errors

    idx = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(3))
    for max_steps in range(2, 400):  # the fewest steps the forward solve needs
        m = ode_model(num_layers=1, hidden_size=16, num_heads=2, ode_solver="adaptive_heun",
                      ode_rtol=1e-6, ode_atol=1e-6, ode_max_steps=max_steps, ode_grad="adjoint")
        try:
            _, loss = m(idx, idx)
            break
        except ODESolverError:
            continue
    with pytest.raises(ODESolverError, match=r"ODE block 0: the backward \(adjoint\) solve of "
                                             r"the adaptive solver adaptive_heun stopped at t ="):
        with solver_errors():
            loss.backward()
    with pytest.raises(AssertionError, match="unrelated"), solver_errors():
        raise AssertionError("unrelated")  # other assertions pass through unchanged


def test_adaptive_direct_gradient_follows_the_time_the_field_reads():
    """dopri5 with a time-dependent field, float64: direct backprop must give the derivative
    of what the model computed (finite differences). With t cut to a float before the time
    embedding, it was 4e-4 off at every tolerance."""
    torch.manual_seed(0)
    m = LanguageModel(ode_cfg(num_layers=1, hidden_size=16, num_heads=2, ode_solver="dopri5",
                              ode_rtol=1e-10, ode_atol=1e-10, ode_max_steps=100000,
                              ode_time_embedding="sinusoidal")).double()
    proj = m.depth.blocks[0].field.time.proj
    with torch.no_grad():
        proj.weight.normal_(0, 0.3)
        proj.bias.normal_(0, 0.3)
    idx = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(3))
    w = torch.randn(2, 7, 29, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    loss = lambda: (m(idx)[0] * w).sum()  # noqa: E731
    p = m.depth.blocks[0].field.mlp.fc.weight
    d = torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    loss().backward()
    direct = (p.grad * d).sum().item()
    eps = 1e-6
    with torch.no_grad():
        p += eps * d
        up = loss().item()
        p -= 2 * eps * d
        down = loss().item()
        p += eps * d
    assert direct == pytest.approx((up - down) / (2 * eps), rel=1e-6)


def test_torchdiffeq_keeps_float64_time_for_a_float64_state():
    """The adjoint's fixed grid on [0.1, 1.3] in float64 integrates the same interval as our
    direct solver (it was built in float32: 0.1 became 0.10000000149, a 1e-7 difference)."""
    torch.manual_seed(0)
    a = torch.randn(4, 4, dtype=torch.float64) * 0.7
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    times = []

    def f(t, y):
        times.append(float(t))
        return y @ a.T

    cfg = ode_cfg()
    direct = integrate(f, y0, 0.1, 1.3, SOLVERS["rk4"](cfg), 4, "direct")
    times.clear()
    adjoint = integrate(f, y0, 0.1, 1.3, SOLVERS["rk4"](cfg), 4, "adjoint")
    assert times[0] == 0.1 and times[-1] == pytest.approx(1.3, abs=1e-15)
    torch.testing.assert_close(adjoint, direct, rtol=0, atol=1e-13)


@pytest.mark.parametrize("key,value,valid", [
    ("ode_solver", "rk5", "rk4"), ("field", "paralel", "parallel"), ("ode_grad", "adjiont", "adjoint"),
])
def test_unknown_ode_selectors_list_valid_names(key, value, valid):
    with pytest.raises(ConfigError, match=f"available: .*{valid}"):
        ode_cfg(**{key: value})


@pytest.mark.parametrize("kw,needle", [
    (dict(ode_grad="reversible", ode_solver="rk4"), "reversible_heun"),
    (dict(ode_grad="adjoint", ode_solver="rk2_gated"), "adjoint"),
    (dict(ode_grad="binomial", ode_solver="dopri5"), "fixed-grid"),
    (dict(ode_grad="checkpoint", ode_solver="reversible_heun"), "ode_grad = 'reversible'"),
    (dict(ode_t0=1.0, ode_t1=0.5), "greater"),
])
def test_invalid_combinations(kw, needle):
    with pytest.raises(ConfigError, match=needle):
        ode_cfg(**kw)


# ------------------------------------------------------------------ gradients

def _grads(model, idx):
    model.zero_grad()
    _, loss = model(idx, idx)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _same_weights(ref, **kw):
    m = LanguageModel(ode_cfg(**kw)).to(next(ref.parameters()).dtype)
    m.load_state_dict(ref.state_dict())
    return m


@pytest.mark.parametrize("solver", NON_REVERSIBLE_FIXED)
def test_checkpoint_gradients_equal_direct(solver):
    ref = ode_model(ode_solver=solver, dropout=0.1)  # dropout masks must match in recompute
    idx = torch.randint(0, 29, (2, 9))
    torch.manual_seed(1)
    g_direct = _grads(ref, idx)
    ckpt = _same_weights(ref, ode_solver=solver, ode_grad="checkpoint", dropout=0.1)
    torch.manual_seed(1)
    g_ckpt = _grads(ckpt, idx)
    torch.testing.assert_close(g_ckpt, g_direct, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("field", FIELDS)
def test_reversible_gradients_equal_direct(field):
    ref = ode_model(ode_solver="reversible_heun", ode_steps=8, field=field, dropout=0.1,
                    ode_time_embedding="sinusoidal")
    with torch.no_grad():  # a non-zero time embedding, so t matters in the check
        for b in ref.depth.blocks:
            b.field.time.proj.weight.normal_(0, 0.1)
    idx = torch.randint(0, 29, (2, 9))
    torch.manual_seed(1)
    g_direct = _grads(ref, idx)
    rev = _same_weights(ref, ode_solver="reversible_heun", ode_steps=8, field=field, dropout=0.1,
                        ode_grad="reversible", ode_time_embedding="sinusoidal")
    torch.manual_seed(1)
    g_rev = _grads(rev, idx)
    torch.testing.assert_close(g_rev, g_direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_reversible_gradients_equal_direct_under_bf16_autocast(mixer):
    """Mixed precision: the field runs in bf16 but the solver's state stays float32, and the
    backward re-evaluates f under the forward's autocast, so the rebuilt states and gradients
    match direct backprop to float32 round-off. (Autocast's weight-cast cache is off here: with
    it, direct backprop sums the gradients of every evaluation in bf16 at the shared cast.)
    DeltaNet's kernel has its own backward, which must then run with autocast off."""
    ref = ode_model(ode_solver="reversible_heun", ode_steps=8, mixer=mixer)
    rev = _same_weights(ref, ode_solver="reversible_heun", ode_steps=8, ode_grad="reversible",
                        mixer=mixer)
    idx = torch.randint(0, 29, (2, 9))
    grads = []
    for m in (ref, rev):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            grads.append(_grads(m, idx))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    for block in rev.depth.blocks:
        assert block.solver.last_reconstruction_error <= 1e-5


def test_reversible_reconstruction_error_32_steps():
    torch.manual_seed(0)
    m = ode_model(ode_solver="reversible_heun", ode_grad="reversible", ode_steps=32)
    _grads(m, torch.randint(0, 29, (2, 16)))
    for block in m.depth.blocks:
        assert isinstance(block.solver, ReversibleHeun)
        assert block.solver.last_reconstruction_error <= 1e-5


@pytest.mark.parametrize("solver,steps,tol", [("euler", 64, 5e-2), ("rk4", 8, 1e-3),
                                              ("rk4_38", 8, 1e-3), ("dopri5", None, 1e-5)])
def test_adjoint_gradients_agree_with_direct(solver, steps, tol):
    """The backsolve adjoint differentiates the continuous ODE, not the discretization: it
    matches the direct gradient up to the discretization error (tight for adaptive solves)."""
    extra = dict(ode_rtol=1e-9, ode_atol=1e-10) if steps is None else dict(ode_steps=steps)
    ref = ode_model(ode_solver=solver, num_layers=1, **extra).double()
    idx = torch.randint(0, 29, (2, 7))
    g_direct = _grads(ref, idx)
    g_adj = _grads(_same_weights(ref, ode_solver=solver, num_layers=1, ode_grad="adjoint", **extra), idx)
    rel = ((g_adj - g_direct).norm() / g_direct.norm()).item()
    assert rel < tol, rel


def test_dropout_mask_fixed_within_a_solve():
    m = ode_model(ode_solver="rk4", dropout=0.5).train()
    field = m.depth.blocks[0].field
    x = torch.randn(1, 5, 32)
    a = field(0.0, x)
    b = field(0.5, x)
    torch.testing.assert_close(a, b)  # same masks at every stage (autonomous field)
    m(torch.randint(0, 29, (1, 5)))  # a new forward draws new masks
    assert not torch.equal(field(0.0, x), a)


# ------------------------------------------------------------------ decoding through depth

@pytest.mark.parametrize("mixer", MIXER_NAMES)
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("solver", FIXED)
def test_ode_kv_cache_equals_recompute(solver, field, mixer):
    m = ode_model(ode_solver=solver, field=field, ode_steps=2, mixer=mixer).eval()
    assert_cached_decoding_exact(m, torch.randint(0, 29, (2, 5)), 24)


def test_adaptive_generation_falls_back_to_recompute():
    m = ode_model(ode_solver="bosh3").eval()
    prompt = torch.randint(0, 29, (1, 4))
    out = m.generate(prompt, 5, greedy=True)  # use_cache=True is overridden, not an error
    assert out.shape == (1, 9)
    with pytest.raises(ValueError, match="adaptive"):
        m.step(prompt, m.init_state(1))


def test_set_solver_changes_integration_and_validates():
    """Anytime depth: the same weights integrated with another solver or step count; bad
    values are refused like any config value (0 steps is not "keep the old count")."""
    m = ode_model(ode_solver="rk4", ode_steps=3).eval()
    idx = torch.randint(0, 29, (1, 7))
    ref = m(idx)[0]
    m.set_solver(ode_solver="euler", ode_steps=12)
    euler = m(idx)[0]
    assert m.last_nfe == 2 * 12 and not torch.equal(euler, ref)
    m.set_solver(ode_solver="rk4", ode_steps=3)
    torch.testing.assert_close(m(idx)[0], ref, rtol=0, atol=0)
    for bad, needle in ((dict(ode_steps=0), "positive"), (dict(ode_solver="rk5"), "rk4")):
        with pytest.raises(ConfigError, match=needle):
            m.set_solver(**bad)
    assert m.config.ode_steps == 3 and m.config.ode_solver == "rk4"  # unchanged by a refusal
    with pytest.raises(ValueError, match="rk2_gated"):
        m.set_solver(ode_solver="rk2_gated")
    ck = ode_model(ode_solver="rk4", ode_grad="checkpoint")
    with pytest.raises(ConfigError, match="reversible"):  # checkpointing does not suit it
        ck.set_solver(ode_solver="reversible_heun")
    ck.set_solver(ode_solver="reversible_heun", ode_grad="direct")  # what evaluation asks
    assert ck.config.ode_solver == "reversible_heun" and ck.config.ode_grad == "direct"
    with pytest.raises(ValueError, match="discrete"):
        LanguageModel(ModelConfig(vocab_size=29, hidden_size=32, num_heads=4)).set_solver("rk4")


def test_reversible_heun_refuses_a_trajectory_it_cannot_rebuild():
    """dh/dt = lambda h with lambda = -10 (dissipative forward, growing in backward time): the
    parasitic root makes the float32 reconstruction fail; the backward says so instead of
    returning gradients of another trajectory (the trainer counts the error as a bad step)."""
    from continuumlm.ode import ODESolverError, ReversibleError
    from continuumlm.ode.solvers import grid

    solver = ReversibleHeun(types.SimpleNamespace(reversible_tol=1e-3))
    lam = torch.tensor(-10.0, requires_grad=True)
    h0 = torch.ones(4, requires_grad=True)
    times = grid(0.0, 1.0, 64)
    h1 = solver.integrate_reversible(lambda t, h: lam * h, h0, times, 1 / 64, (lam,))
    with pytest.raises(ReversibleError, match="stability region") as e:
        h1.sum().backward()
    assert isinstance(e.value, ODESolverError) and solver.last_reconstruction_error > 1e-3
    # a field inside the region (oscillatory, small steps) rebuilds and passes
    w = torch.tensor(1.0, requires_grad=True)
    h = torch.tensor([1.0, 0.0], requires_grad=True)
    rot = lambda t, s: w * torch.stack([-s[1], s[0]])  # noqa: E731
    solver.integrate_reversible(rot, h, times, 1 / 64, (w,)).sum().backward()
    assert solver.last_reconstruction_error < 1e-5 and w.grad is not None


def test_gated_rk2_changes_its_step_count_and_keeps_its_gate():
    m = ode_model(ode_solver="rk2_gated", ode_steps=2).eval()
    gates = [b.solver.gate for b in m.depth.blocks]
    idx = torch.randint(0, 29, (1, 6))
    m.set_solver(ode_steps=8)
    with torch.no_grad():
        m(idx)
    assert m.last_nfe == 2 * 8 * len(gates)
    assert [b.solver.gate for b in m.depth.blocks] == gates  # the trained weights stay
    with pytest.raises(ValueError, match="weights of its own"):
        m.set_solver("rk4")


@pytest.mark.parametrize("grad,solver", [("adjoint", "rk4"), ("adjoint", "dopri5"),
                                         ("binomial", "rk4"), ("checkpoint", "rk4"),
                                         ("checkpoint", "dopri5"),
                                         ("reversible", "reversible_heun")])
def test_backward_evaluates_the_field_in_the_forwards_autocast(grad, solver):
    """The trainer calls backward() outside autocast: every mode that evaluates the field again
    in its backward pass does so in the forward's precision (the adjoint's backward solve ran
    in float32 under a bfloat16 forward: another field than the one integrated)."""
    lin = torch.nn.Linear(8, 8)
    seen = []

    def f(t, h):
        out = torch.tanh(lin(h))
        seen.append(out.dtype)
        return out

    cfg = ModelConfig(vocab_size=29, hidden_size=8, num_heads=2)
    h0 = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = integrate(f, h0, 0.0, 1.0, SOLVERS[solver](cfg), 2, grad, tuple(lin.parameters()))
    forward = len(seen)
    out.float().sum().backward()
    assert forward and len(seen) > forward
    assert set(seen) == {torch.bfloat16}, (seen[:forward], seen[forward:])


@pytest.mark.parametrize("grad", ["checkpoint", "binomial"])
def test_a_forward_between_forward_and_backward_changes_no_gradient(grad):
    """The backward passes that evaluate the field again read the dt embedding's step size and
    the dropout masks of their own forward, not whatever a later forward (a finer monitoring
    solve, another batch) left in the modules: that made checkpointed gradients 59% off."""
    def build(**kw):
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=29, hidden_size=16, num_heads=2, num_layers=1,
                                      max_seq_len=32, depth="ode", ode_solver="rk4",
                                      ode_steps=4, ode_dt_embedding=True, dropout=0.2,
                                      **kw)).double().train()
        with torch.no_grad():
            for b in m.depth.blocks:
                b.field.step_size.proj.weight.normal_(0, 0.5)
        return m

    idx = torch.randint(0, 29, (2, 6))
    got = {}
    for mode in ("direct", grad):
        m = build(ode_grad=mode)
        torch.manual_seed(1)
        _, loss = m(idx, idx.roll(-1, 1))
        m.set_solver(ode_steps=8)
        with torch.no_grad():
            m(idx)  # new masks and another dt in the modules
        m.set_solver(ode_steps=4)
        loss.backward()
        got[mode] = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    torch.testing.assert_close(got[grad], got["direct"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("solver,grad,needle", [
    ("rk4", "reversible", "reversible solver"),
    ("rk4", "adjiont", r"ode_grad = 'adjiont' is not available \(did you mean 'adjoint'"),
    ("dopri5", "binomial", "fixed-grid"), ("dopri5", "reversible", "reversible solver"),
    ("rk2_gated", "adjoint", "'adjoint' works with")])
def test_integrate_refuses_a_mode_its_solver_lacks(solver, grad, needle):
    """integrate() is the solver interface: it never falls back to direct backprop silently."""
    lin = torch.nn.Linear(8, 8)
    cfg = ModelConfig(vocab_size=29, hidden_size=8, num_heads=2)
    with pytest.raises(ValueError, match=needle):
        integrate(lambda t, h: torch.tanh(lin(h)), torch.randn(2, 8, requires_grad=True), 0.0,
                  1.0, SOLVERS[solver](cfg), 2, grad, tuple(lin.parameters()))


def test_the_gradient_modes_are_a_registry_with_their_own_refusals():
    """model.ode_grad names an entry of registry.GRADS; each mode states which solvers it
    refuses, and the config check and integrate() read the same statement."""
    from continuumlm.config import GRAD_MODES
    from continuumlm.ode.grad import refusal
    from continuumlm.registry import GRADS

    assert set(GRADS) == {"direct", "checkpoint", "binomial", "adjoint", "reversible"}
    assert GRAD_MODES is GRADS and "adjoint" in GRAD_MODES
    table = {(grad, solver): refusal(solver, grad, adaptive, reversible, 8) is None
             for grad in GRADS
             for solver, adaptive, reversible in (("rk4", False, False), ("euler", False, False),
                                                  ("tsit5", True, False),
                                                  ("reversible_heun", False, True))}
    assert [k for k, ok in table.items() if not ok] == [
        ("checkpoint", "reversible_heun"), ("binomial", "tsit5"),
        ("binomial", "reversible_heun"), ("adjoint", "reversible_heun"),
        ("reversible", "rk4"), ("reversible", "euler"), ("reversible", "tsit5")]
    assert refusal("rk4", "binomial", False, False, 10**9) is not None  # past its plan
    with pytest.raises(ConfigError, match="ode_grad = 'revers' is not available"):
        ModelConfig(depth="ode", ode_grad="revers")
