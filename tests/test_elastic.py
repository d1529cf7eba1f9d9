"""Elastic depth: step counts and solvers drawn per step (reproducible across resume), the
dt embedding (causal, exact cached decoding, parameter count free of steps), the consistency
term, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from continuumlm import ConfigError, load_config
from continuumlm.testing import (
    check_cached_decoding,
    check_causal,
    check_size_ignores_steps,
    small_model,
)
from continuumlm.train import Trainer
from continuumlm.train.elastic import ElasticDepth
from continuumlm.train.logging import read_metrics


def elastic_cfg(corpus, *extra):
    return load_config(None, [
        "data.dataset=text", f'data.path="{corpus}"', "model.hidden_size=32",
        "model.num_heads=2", "model.num_layers=1", "model.depth=ode", "model.dropout=0.1",
        "model.ode_dt_embedding=true", "train.elastic.steps=[1, 2, 4]",
        "train.elastic.solvers=['euler', 'rk4']", "train.batch_size=4", "train.seq_len=16",
        "train.max_steps=12", "train.lr_decay_steps=12", "train.warmup_steps=2",
        "train.log_interval=1", "train.eval_interval=4", "train.eval_iters=2",
        "train.checkpoint_interval=3", "train.device=cpu", *extra])


def test_draws_vary_and_a_resumed_run_repeats_them(tiny_corpus, tmp_path):
    extra = ["train.elastic.consistency_weight=0.5"]
    Trainer(elastic_cfg(tiny_corpus, *extra), tmp_path / "full", quiet=True).run()
    Trainer(elastic_cfg(tiny_corpus, *extra, "train.max_steps=6"), tmp_path / "cut",
            quiet=True).run()
    Trainer(elastic_cfg(tiny_corpus, *extra), tmp_path / "cut", resume=True, quiet=True).run()

    def events(run):
        return {e["step"]: e for e in read_metrics(run) if "loss" in e}

    a, b = events(tmp_path / "full"), events(tmp_path / "cut")
    assert sorted(b) == list(range(1, 13))
    assert {k: (v["loss"], v["ode_solver"], v["ode_steps"], v.get("consistency"))
            for k, v in a.items()} \
        == {k: (v["loss"], v["ode_solver"], v["ode_steps"], v.get("consistency"))
            for k, v in b.items()}
    draws = {(e["ode_solver"], e["ode_steps"]) for e in a.values()}
    assert len(draws) >= 3  # 12 steps over six (solver, steps) pairs
    for e in a.values():  # the NFE logged is the drawn solve's
        assert e["nfe"] == e["ode_steps"] * (4 if e["ode_solver"] == "rk4" else 1)
    # consistency: logged (and positive) where a finer step count exists, absent for the finest
    assert all(("consistency" in e) == (e["ode_steps"] < 4) for e in a.values())
    assert all(e["consistency"] > 0 for e in a.values() if "consistency" in e)
    # checkpoints and evaluation keep the configured solver
    from continuumlm.train import load_model_and_tokenizer

    m, _, _ = load_model_and_tokenizer(tmp_path / "cut", "last")
    assert (m.config.ode_solver, m.config.ode_steps) == ("rk4", 4)


def test_the_draw_is_a_function_of_seed_and_step():
    model = small_model(depth="ode", num_layers=1)
    t = load_config(None, ["model.depth=ode", "train.elastic.steps=[1, 2, 4, 8]",
                           "train.seed=5"]).train
    a, b = ElasticDepth(model, t), ElasticDepth(model, t)
    assert [a.draw(s) for s in range(50)] == [b.draw(s) for s in range(50)]  # any rank, any run
    assert {n for _, n in (a.draw(s) for s in range(50))} == {1, 2, 4, 8}
    assert a.finer(2) == 4 and a.finer(8) is None


def test_consistency_every_n_steps(tiny_corpus, tmp_path):
    every = ["train.elastic.consistency_weight=0.5", "train.elastic.consistency_every=3",
             "train.elastic.steps=[1, 2]", "train.max_steps=9", "train.lr_decay_steps=9"]
    Trainer(elastic_cfg(tiny_corpus, *every), tmp_path / "every", quiet=True).run()
    events = {e["step"]: e for e in read_metrics(tmp_path / "every") if "loss" in e}
    # logged step s is optimizer step s - 1: the term on steps 0, 3, 6, where the draw has a
    # finer step count (1 step; 2 is the finest)
    want = {s for s, e in events.items() if (s - 1) % 3 == 0 and e["ode_steps"] == 1}
    assert want and {s for s, e in events.items() if "consistency" in e} == want
    # a run without the term on those steps draws and trains alike on the others: the losses
    # agree up to the first step with the term
    Trainer(elastic_cfg(tiny_corpus, *every[2:]), tmp_path / "none", quiet=True).run()
    plain = {e["step"]: e["loss"] for e in read_metrics(tmp_path / "none") if "loss" in e}
    first = min(want)
    assert all(events[s]["loss"] == plain[s] for s in events if s <= first)
    assert any(events[s]["loss"] != plain[s] for s in events if s > first)


def test_max_nfe_draws_only_solves_within_the_cap(tiny_corpus, tmp_path):
    model = small_model(depth="ode", num_layers=1)
    t = load_config(None, ["model.depth=ode", "train.elastic.steps=[2, 4, 8, 16]",
                           "train.elastic.solvers=['euler', 'rk4']",
                           "train.elastic.max_nfe=32"]).train
    e = ElasticDepth(model, t)
    draws = [e.draw(s) for s in range(400)]
    nfe = {"euler": 1, "rk4": 4}
    assert set(draws) == {("euler", 2), ("euler", 4), ("euler", 8), ("euler", 16),
                          ("rk4", 2), ("rk4", 4), ("rk4", 8)}  # rk4 x 16 (64) left out
    assert draws == [ElasticDepth(model, t).draw(s) for s in range(400)]
    assert max(n * nfe[solver] for solver, n in draws) <= 32
    # the consistency term's finer solve stays within the cap as well
    assert e.finer(8, "euler") == 16 and e.finer(8, "rk4") is None and e.finer(4, "rk4") == 8
    # in training: every logged solve within the cap; the term only where a finer one fits
    Trainer(elastic_cfg(tiny_corpus, "train.elastic.steps=[1, 2, 4]",
                        "train.elastic.max_nfe=8", "train.elastic.consistency_weight=0.5"),
            tmp_path / "capped", quiet=True).run()
    events = [e for e in read_metrics(tmp_path / "capped") if "loss" in e]
    assert all(e["nfe"] <= 8 for e in events)
    assert {(e["ode_solver"], e["ode_steps"]) for e in events} <= {
        ("euler", 1), ("euler", 2), ("euler", 4), ("rk4", 1), ("rk4", 2)}
    for e in events:
        has_finer = e["ode_steps"] < (2 if e["ode_solver"] == "rk4" else 4)
        assert ("consistency" in e) == has_finer


def test_consistency_max_nfe_lets_only_the_finer_solve_past_the_cap(tiny_corpus, tmp_path):
    model = small_model(depth="ode", num_layers=1)
    sets = ["model.depth=ode", "train.elastic.steps=[2, 4, 8, 16]",
            "train.elastic.solvers=['euler', 'rk4']", "train.elastic.max_nfe=32",
            "train.elastic.consistency_weight=0.5"]
    plain = ElasticDepth(model, load_config(None, sets).train)
    wide = ElasticDepth(model, load_config(None, [*sets, "train.elastic.consistency_max_nfe=64"]).train)
    # the draws are the capped ones either way
    assert [plain.draw(s) for s in range(300)] == [wide.draw(s) for s in range(300)]
    assert ("rk4", 16) not in {wide.draw(s) for s in range(300)}
    # rk4 x 8 (32) now has a finer solve, rk4 x 16 (64); euler x 16 still none (32 not listed)
    assert plain.finer(8, "rk4") is None and wide.finer(8, "rk4") == 16
    assert wide.finer(4, "rk4") == 8 and wide.finer(16, "euler") is None
    # in training: a drawn rk4 x 1 (4 evaluations, the cap) gets its term from rk4 x 2 (8)
    Trainer(elastic_cfg(tiny_corpus, "train.elastic.steps=[1, 2]",
                        "train.elastic.solvers=['euler', 'rk4']", "train.elastic.max_nfe=4",
                        "train.elastic.consistency_max_nfe=8", "train.elastic.consistency_weight=0.5"),
            tmp_path / "wide", quiet=True).run()
    events = [e for e in read_metrics(tmp_path / "wide") if "loss" in e]
    assert {(e["ode_solver"], e["ode_steps"]) for e in events} <= {
        ("euler", 1), ("euler", 2), ("rk4", 1)}
    assert all(("consistency" in e) == (e["ode_steps"] == 1) for e in events)
    assert any(e["ode_solver"] == "rk4" and "consistency" in e for e in events)


def test_elastic_from_trains_fixed_first_then_draws_as_a_run_from_zero(tiny_corpus, tmp_path):
    model = small_model(depth="ode", num_layers=1)
    sets = ["model.depth=ode", "train.elastic.steps=[1, 2, 4]",
            "train.elastic.solvers=['euler', 'rk4']", "train.elastic.consistency_weight=0.5"]
    zero = ElasticDepth(model, load_config(None, sets).train)
    late = ElasticDepth(model, load_config(None, [*sets, "train.elastic.start=20"]).train)
    base = (model.config.ode_solver, model.config.ode_steps)
    assert [late.draw(s) for s in range(20)] == [base] * 20
    assert [late.draw(s) for s in range(20, 200)] == [zero.draw(s) for s in range(20, 200)]
    assert all(late.finer_at(s, "euler", 1) is None for s in range(20))
    assert late.finer_at(20, "euler", 1) == zero.finer_at(20, "euler", 1) == 2
    # in training: the configured solve and no consistency term before step 6 (logged 1-6),
    # draws from there on, and a resumed run repeats it
    extra = ["train.elastic.consistency_weight=0.5", "train.elastic.start=6"]
    Trainer(elastic_cfg(tiny_corpus, *extra), tmp_path / "full", quiet=True).run()
    Trainer(elastic_cfg(tiny_corpus, *extra, "train.max_steps=7"), tmp_path / "cut",
            quiet=True).run()
    Trainer(elastic_cfg(tiny_corpus, *extra), tmp_path / "cut", resume=True, quiet=True).run()
    a = {e["step"]: e for e in read_metrics(tmp_path / "full") if "loss" in e}
    b = {e["step"]: e for e in read_metrics(tmp_path / "cut") if "loss" in e}
    assert {k: (v["loss"], v["ode_solver"], v["ode_steps"]) for k, v in a.items()} \
        == {k: (v["loss"], v["ode_solver"], v["ode_steps"]) for k, v in b.items()}
    assert all((a[s]["ode_solver"], a[s]["ode_steps"]) == ("rk4", 4)
               and "consistency" not in a[s] for s in range(1, 7))
    assert len({(a[s]["ode_solver"], a[s]["ode_steps"]) for s in range(7, 13)}) >= 2


def test_a_choice_listed_twice_is_drawn_twice_as_often():
    model = small_model(depth="ode", num_layers=1)
    t = load_config(None, ["model.depth=ode", "train.elastic.steps=[2, 4, 4]"]).train
    draws = [ElasticDepth(model, t).draw(s)[1] for s in range(3000)]
    share = draws.count(4) / len(draws)
    assert abs(share - 2 / 3) < 0.03  # binomial sd 0.009
    assert ElasticDepth(model, t).finer(2) == 4 and ElasticDepth(model, t).finer(4) is None


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
@pytest.mark.parametrize("field", ["sequential", "parallel"])
def test_dt_embedding_keeps_causality_and_exact_decoding(mixer, field):
    m = small_model(depth="ode", num_layers=1, mixer=mixer, field=field, ode_dt_embedding=True,
                    ode_steps=3)
    for block in m.depth.blocks:  # it starts at zero: make it matter
        torch.nn.init.normal_(block.field.step_size.proj.weight)
    check_causal(m)
    check_cached_decoding(m, torch.randint(0, 37, (2, 5)), 6)
    x = torch.randint(0, 37, (1, 8))
    before = m(x)[0]
    m.set_solver(ode_steps=6)
    assert not torch.allclose(before, m(x)[0])  # another dt, another field
    check_size_ignores_steps(depth="ode", num_layers=1, ode_dt_embedding=True)


def test_dt_steps_range_clamps_the_embedded_step_size():
    m = small_model(depth="ode", num_layers=1, ode_dt_embedding=True, ode_steps=4,
                    ode_dt_steps_range=[2, 4], ode_t1=2.0)
    field = m.depth.blocks[0].field
    torch.nn.init.normal_(field.step_size.proj.weight)
    h = torch.randn(1, 3, field.norm1.weight.shape[0])

    def embedded(steps: int) -> torch.Tensor:
        field.dt = 2.0 / steps  # over [0, 2]: the range counts steps over the model's interval
        return field.temb(0.0, h)

    def reference(steps: int) -> torch.Tensor:  # the embedding of an unclamped step count
        return field.step_size(math.log2(steps / 2.0))

    for steps, read_as in [(1, 2), (2, 2), (3, 3), (4, 4), (8, 4), (1024, 4)]:
        torch.testing.assert_close(embedded(steps), reference(read_as), rtol=0, atol=0)
    assert not torch.equal(reference(2), reference(4))
    # a model without the range reads every step size as it is
    free = small_model(depth="ode", num_layers=1, ode_dt_embedding=True, ode_steps=4)
    assert free.depth.blocks[0].field.dt_bounds is None


def test_dt_steps_range_changes_the_model_only_outside_the_range():
    cfg = dict(depth="ode", num_layers=1, ode_dt_embedding=True, ode_steps=4)
    torch.manual_seed(0)
    free = small_model(**cfg)
    for block in free.depth.blocks:
        torch.nn.init.normal_(block.field.step_size.proj.weight, std=0.5)
    bounded = small_model(**cfg, ode_dt_steps_range=[2, 8])
    bounded.load_state_dict(free.state_dict())  # no new parameter or buffer
    x = torch.randint(0, 37, (2, 9))
    for steps in (2, 4, 8):
        free.set_solver(ode_steps=steps)
        bounded.set_solver(ode_steps=steps)
        torch.testing.assert_close(bounded(x)[0], free(x)[0], rtol=0, atol=0)
    free.set_solver(ode_steps=16)
    bounded.set_solver(ode_steps=16)
    assert not torch.allclose(bounded(x)[0], free(x)[0])
    check_causal(bounded)
    check_cached_decoding(bounded, torch.randint(0, 37, (2, 5)), 6)


def test_dt_embedding_reading_evaluations_gives_equal_cost_solves_one_embedding():
    cfg = dict(depth="ode", num_layers=1, ode_dt_embedding=True, ode_solver="rk4", ode_steps=4)
    torch.manual_seed(0)
    steps_read = small_model(**cfg)
    for block in steps_read.depth.blocks:
        torch.nn.init.normal_(block.field.step_size.proj.weight, std=0.5)
    evals_read = small_model(**cfg, ode_dt_embedding_reads="evaluation")
    evals_read.load_state_dict(steps_read.state_dict())  # no new parameter or buffer
    x = torch.randint(0, 37, (2, 7))
    field = evals_read.depth.blocks[0].field
    # the field reads the spacing of its evaluations: rk4 x 4 is 1/16, as euler x 16
    for solver, steps, dt in [("rk4", 4, 1 / 16), ("euler", 16, 1 / 16), ("rk4", 1, 1 / 4),
                              ("euler", 4, 1 / 4), ("midpoint", 2, 1 / 4)]:
        evals_read.set_solver(solver, steps)
        evals_read(x)
        assert field.dt == pytest.approx(dt)
    # Euler reads the same either way; RK4 x 4 reads what the step-reading model's x 16 does
    for steps in (2, 4):
        evals_read.set_solver("euler", steps)
        steps_read.set_solver("euler", steps)
        torch.testing.assert_close(evals_read(x)[0], steps_read(x)[0], rtol=0, atol=0)
    evals_read.set_solver("rk4", 4)
    steps_read.set_solver("rk4", 4)
    assert not torch.allclose(evals_read(x)[0], steps_read(x)[0])
    # the range counts evaluations: rk4 x 16 (64) reads the embedding of 32 under [2, 32]
    bounded = small_model(**cfg, ode_dt_embedding_reads="evaluation", ode_dt_steps_range=[2, 32])
    bounded.load_state_dict(steps_read.state_dict())
    bounded.set_solver("rk4", 16)
    bounded(x)
    b = bounded.depth.blocks[0].field
    h = torch.randn(1, 3, b.norm1.weight.shape[0])
    torch.testing.assert_close(b.temb(0.0, h), b.step_size(5.0), rtol=0, atol=0)
    check_causal(evals_read)
    check_cached_decoding(evals_read, torch.randint(0, 37, (2, 5)), 6)


@pytest.mark.parametrize("sets, needle", [
    (["model.depth=ode", "model.ode_dt_embedding=true", "model.ode_dt_steps_range=[4, 2]"],
     "fewest first"),
    (["model.depth=ode", "model.ode_dt_embedding=true", "model.ode_dt_steps_range=[0, 2]"],
     r"\[fewest, most\]"),
    (["model.depth=ode", "model.ode_dt_embedding=true", "model.ode_dt_steps_range=[2]"],
     r"\[fewest, most\]"),
    (["model.depth=ode", "model.ode_dt_steps_range=[2, 8]"], "has none"),
    (["model.depth=ode", "model.ode_dt_embedding_reads=evaluation"], "has none"),
    (["model.depth=ode", "model.ode_dt_embedding=true", "model.ode_dt_embedding_reads=nfe"],
     "'step'"),
    (["train.elastic.steps=[0, 2]"], "positive integers"),
    (["train.elastic.steps=[]"], "is empty"),
    (["train.elastic.consistency_every=0"], "positive integer"),
    (["train.elastic.max_nfe=0"], "positive integer"),
    (["model.depth=ode", "train.elastic.start=5"], "elastic training starts"),
    (["model.depth=ode", "train.elastic.steps=[2, 4]", "train.elastic.start=-1"],
     "integer >= 0"),
    (["model.depth=ode", "train.elastic.steps=[2, 4]", "train.max_steps=10",
      "train.elastic.start=10"], "no step would draw"),
    (["model.depth=ode", "train.elastic.max_nfe=8"], "train.elastic.steps"),
    (["model.depth=ode", "train.elastic.steps=[2, 4]", "train.elastic.consistency_weight=0.5",
      "train.elastic.consistency_max_nfe=8"], "set both max_nfe"),
    (["model.depth=ode", "train.elastic.steps=[2, 4]", "train.elastic.max_nfe=8",
      "train.elastic.consistency_max_nfe=8"], "set both max_nfe"),
    (["model.depth=ode", "train.elastic.steps=[2, 4]", "train.elastic.max_nfe=8",
      "train.elastic.consistency_weight=0.5", "train.elastic.consistency_max_nfe=4"], "at least"),
    (["model.depth=ode", "train.elastic.steps=[4, 8]", "model.ode_solver=rk4",
      "train.elastic.max_nfe=8"], "allows none"),
    (["model.depth=ode", "train.elastic.consistency_weight=0.1", "train.elastic.steps=[4]"],
     "at least two step counts"),
    (["train.elastic.steps=[1, 2]"], "depth = 'discrete' has none"),
    (["model.depth=ode", "train.elastic.solvers=['dopri5']"], "fixed-grid solvers"),
    (["model.depth=ode", "train.elastic.solvers=['nope']"], "nope"),
    # the model's own solver adaptive, a fixed-grid one drawn: the regularizers' refusal of
    # fixed grids reads the solvers training integrates with
    (["model.depth=ode", "model.ode_solver=tsit5", "train.elastic.solvers=['rk4']",
      "train.regularize.kinetic_weight=0.1"], "fixed-grid 'rk4'"),
    # every drawable solve must suit the gradient mode, or training stops at its first draw
    (["model.depth=ode", "model.ode_solver=reversible_heun", "model.ode_grad=reversible",
      "train.elastic.solvers=['rk4']"], "may draw ode_solver = 'rk4'"),
    (["model.depth=ode", "model.ode_grad=checkpoint",
      "train.elastic.solvers=['rk4', 'reversible_heun']"],
     "may draw ode_solver = 'reversible_heun'"),
    (["model.depth=ode", "model.ode_grad=binomial", "train.elastic.steps=[4, 5000]"],
     "4096"),
    (["model.depth=ode", "model.ode_solver=dopri5", "model.ode_dt_embedding=true"],
     "fixed step size"),
])
def test_elastic_settings_are_checked(sets, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, sets)
