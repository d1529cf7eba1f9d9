"""Self-speculative decoding through depth (model/speculative.py): the same greedy tokens as
plain cached decoding for every mixer and fixed-grid solver, the statistics it reports, and
what it refuses."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from continuumlm import Draft
from continuumlm.registry import SOLVERS
from continuumlm.testing import small_model

FIXED_GRID = sorted(n for n in SOLVERS if getattr(SOLVERS.component_class(n), "fixed_grid",
                                                  False) and n != "rk2_gated")


def ode(mixer="softmax", solver="rk4", steps=2, **kw):
    components = {"deltanet": {"short_conv": 3}} if mixer == "deltanet" else {}
    return small_model(mixer=mixer, depth="ode", ode_solver=solver, ode_steps=steps,
                       components=components, **kw)


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
@pytest.mark.parametrize("tokens", [1, 3, "auto"])
def test_greedy_tokens_equal_plain_decoding(mixer, tokens):
    model = ode(mixer)
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(1))
    plain = model.generate(prompt, 30, greedy=True)
    stream = model.generate_stream(prompt, 30, greedy=True,
                                   draft=Draft("euler", 1, tokens=tokens))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    s = stream.stats
    assert s.tokens == 30 and 0 <= s.accepted <= s.drafted and s.rounds >= 1
    assert sum(s.kept_per_round) + 1 >= 30  # the first token comes from the prompt's pass


@pytest.mark.parametrize("solver", FIXED_GRID)
def test_every_fixed_grid_solver_as_the_full_solve(solver):
    model = ode("softmax", solver)
    prompt = torch.randint(0, 37, (1, 4), generator=torch.Generator().manual_seed(2))
    plain = model.generate(prompt, 16, greedy=True)
    for draft in (Draft("euler", 1, 2), Draft("midpoint", 1, 4)):
        assert model.generate(prompt, 16, greedy=True, draft=draft).tolist() == plain.tolist()
    assert model.config.ode_solver == solver  # the draft's solve was put back


def test_a_draft_equal_to_the_model_keeps_every_token():
    """Drafting with the model's own solve: every draft is the model's token, so every round
    keeps all of them, and the field evaluations per token fall below the plain ones."""
    model = ode("softmax", "rk4", 2)
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(3))
    stream = model.generate_stream(prompt, 25, greedy=True, draft=Draft("rk4", 2, 4))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == model.generate(prompt, 25, greedy=True).tolist()
    assert stream.stats.accepted == stream.stats.drafted > 0


def test_end_of_text_and_learned_positions_near_their_limit():
    model = ode("softmax", position="learned", max_seq_len=24)
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(4))
    plain = model.generate(prompt, 20, greedy=True)  # up to the last position
    assert model.generate(prompt, 20, greedy=True, draft=Draft(tokens=6)).tolist() \
        == plain.tolist()
    stop = int(plain[0, 12])  # a token the model produces: generation stops at it
    a = model.generate(prompt, 20, greedy=True, eos_token_id=stop)
    b = model.generate(prompt, 20, greedy=True, eos_token_id=stop, draft=Draft(tokens=5))
    assert a.tolist() == b.tolist() and int(b[0, -1]) == stop


def test_refusals_name_the_reason():
    model = ode()
    prompt = torch.randint(0, 37, (1, 4))
    cases = [
        (small_model(), {}, "discrete model has no solve"),
        (model, {"greedy": False}, "greedy decoding only"),
        (model, {"use_cache": False}, "through the cache"),
        (model, {"compile": True}, "eagerly"),
        (ode(solver="dopri5"), {}, "adaptive"),
    ]
    for m, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            m.generate(prompt, 4, **{"greedy": True, "draft": Draft(), **kw})
    with pytest.raises(ValueError, match="batch 1"):
        model.generate(torch.randint(0, 37, (2, 4)), 4, greedy=True, draft=Draft())
    with pytest.raises(ValueError, match="adaptive"):
        model.generate(prompt, 4, greedy=True, draft=Draft("dopri5", 1))
    with pytest.raises(ValueError, match="positive number of drafted tokens"):
        Draft(tokens=0)


def test_cli_draft_flags(tmp_path, tiny_corpus):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nhidden_size = 16\nnum_heads = 2\nnum_layers = 1\n'
                   f'depth = "ode"\node_solver = "rk4"\node_steps = 2\n'
                   f'max_seq_len = 64\n[data]\ndataset = "text"\npath = "{tiny_corpus}"\n'
                   f'[train]\nmax_steps = 2\nbatch_size = 2\nseq_len = 8\neval_interval = 2\n'
                   f'eval_iters = 1\nwarmup_steps = 1\ndevice = "cpu"\n')
    assert run_cli("train", "--config", cfg, "--out", tmp_path / "run").returncode == 0
    base = ["generate", "--checkpoint", tmp_path / "run", "--prompt", "the", "--greedy",
            "--max-new-tokens", "20"]
    plain = run_cli(*base)
    drafted = run_cli(*base, "--draft-solver", "euler", "--draft-tokens", "auto")
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "speculative:" in drafted.stderr and "field evaluations per token" in drafted.stderr
    r = run_cli(*base, "--draft-tokens", "0")
    assert r.returncode == 2 and "--draft-tokens" in r.stderr
    r = run_cli(*base[:-3], "--draft-steps", "2")  # not greedy
    assert r.returncode == 2 and "greedy decoding only" in r.stderr
