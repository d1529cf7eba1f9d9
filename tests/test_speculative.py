"""Self-speculative decoding through depth (decoding/speculative.py): the same greedy tokens as
plain cached decoding for every mixer and fixed-grid solver; speculative sampling equal, draw
for draw, to a slow reference of the algorithm and distributed as the model's own sampling
(chi-square); the statistics it reports, and what it refuses."""

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


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
def test_greedy_tokens_over_many_refused_drafts(mixer):
    """Float64 weights made sharp, so that drafts are refused often and the states are cut
    back round after round, for more tokens than a recurrent cache's stride of kept states
    (16): the tokens are plain greedy decoding's."""
    model = _noisy(ode(mixer, steps=4).double())
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = model.generate(prompt, 48, greedy=True)
    stream = model.generate_stream(prompt, 48, greedy=True, draft=Draft("euler", 2, "auto"))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    assert 0 < stream.stats.accepted < stream.stats.drafted  # kept some, refused some


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
@pytest.mark.parametrize("how", [pytest.param("compile", marks=pytest.mark.slow), "graphs"])
def test_compiled_and_replayed_drafting_keep_the_tokens(mixer, how):
    """The draft's tokens through the frozen one-token step, compiled (``compile=True``) or
    recorded and replayed (``cuda_graph``, emulated on the CPU), the draft state cut back in
    place after every round, across a refreeze to a larger capacity: greedy, plain decoding's
    tokens; sampling, with one seed, the eager drafts' tokens (float64: the frozen step and
    the eager one agree far below any draw's margin)."""
    from continuumlm.decoding import Decoder
    from continuumlm.decoding.replay import EmulatedGraphRecorder

    model = _noisy(ode(mixer, steps=4).double())
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = model.generate(prompt, 40, greedy=True)
    recorder = EmulatedGraphRecorder() if how == "graphs" else None
    kw = {"compile": True} if how == "compile" else {"cuda_graph": recorder}
    decoder = Decoder(model, min_capacity=16, **kw)
    stream = decoder.stream(prompt, 40, greedy=True, draft=Draft("euler", 2, "auto"))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    assert decoder.compile_refused is None and decoder.capture_refused is None
    assert 0 < stream.stats.accepted < stream.stats.drafted
    if recorder is not None:
        assert recorder.replays > 0  # the drafts were replayed, not run directly
    sampled = dict(temperature=0.9, top_k=20, draft=Draft("euler", 2, 3))
    eager = model.generate(prompt, 30, generator=torch.Generator().manual_seed(7), **sampled)
    frozen = Decoder(model, min_capacity=16, **kw).generate(
        prompt, 30, generator=torch.Generator().manual_seed(7), **sampled)
    assert frozen.tolist() == eager.tolist()


def test_a_frozen_cache_without_a_crop_is_refused_before_any_token(monkeypatch):
    """A cache type whose frozen layout has no crop of its own (a plugin's written before
    frozen states were cut back): compiled or replayed drafting refuses it by name before
    the first token; eager drafting still works."""
    from continuumlm.decoding import Decoder
    from continuumlm.decoding.replay import EmulatedGraphRecorder
    from continuumlm.mixers.cache import FrozenCache, FrozenSeqCache

    monkeypatch.setattr(FrozenSeqCache, "crop", FrozenCache.crop)
    model = ode("softmax")
    prompt = torch.randint(0, 37, (1, 5))
    stream = Decoder(model, cuda_graph=EmulatedGraphRecorder()).stream(
        prompt, 10, greedy=True, draft=Draft("euler", 1, 2))
    with pytest.raises(ValueError, match="compile or CUDA graphs: .*FrozenSeqCache.*eagerly"):
        next(stream)
    assert model.generate(prompt, 10, greedy=True, draft=Draft("euler", 1, 2)).tolist() \
        == model.generate(prompt, 10, greedy=True).tolist()


@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_a_discrete_model_drafts_through_replayed_steps(mixer):
    """A discrete stack's first layers drafting through the frozen one-token step and its
    whole stack verifying through the frozen block step, both recorded and replayed
    (emulated): plain greedy decoding's tokens."""
    from continuumlm.decoding import Decoder
    from continuumlm.decoding.replay import EmulatedGraphRecorder

    model = _noisy(small_model(mixer=mixer, num_layers=3).double())
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = model.generate(prompt, 30, greedy=True)
    recorder = EmulatedGraphRecorder()
    decoder = Decoder(model, min_capacity=16, cuda_graph=recorder)
    stream = decoder.stream(prompt, 30, greedy=True, draft=Draft(layers=2, tokens="auto"))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    assert recorder.replays > 0 and 0 < stream.stats.accepted < stream.stats.drafted


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
def test_a_discrete_model_drafts_with_its_first_layers(mixer):
    """LayerSkip's early exit as the draft: the first layers through the model's own norm and
    head; greedy tokens equal plain decoding's, and the stack is whole again after. (A small
    model's greedy text repeats a token, which every draft predicts: refused drafts are
    compared in the sampling test below.)"""
    model = _sharp(small_model(mixer=mixer, num_layers=3), field=4.0)
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(4))
    plain = model.generate(prompt, 24, greedy=True)
    for layers, k in ((1, 3), (2, "auto")):
        stream = model.generate_stream(prompt, 24, greedy=True, draft=Draft(layers=layers,
                                                                             tokens=k))
        got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
        assert got.tolist() == plain.tolist()
        assert len(model.depth.layers) == 3
        assert stream.stats.nfe < 24 * 3  # the drafts ran fewer layers


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
        (small_model(), {}, "discrete model has no solve.*Draft\\(layers=N\\)"),
        (small_model(), {"draft": Draft(layers=2)}, "from 1 to 1, got 2"),
        (model, {"draft": Draft(layers=1)}, "not with fewer layers"),
        (model, {"use_cache": False}, "through the cache"),
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
    with pytest.raises(ValueError, match="positive number of layers"):
        Draft(layers=0)


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
    sure = run_cli(*base, "--draft-tokens", "8", "--draft-confidence", "0.3")
    assert sure.returncode == 0 and sure.stdout == plain.stdout, sure.stderr
    for bad in ("0", "1", "nan", "x"):
        r = run_cli(*base, "--draft-confidence", bad)
        assert r.returncode == 2 and "--draft-confidence" in r.stderr, bad
    r = run_cli(*base, "--draft-layers", "1")  # an ODE model drafts with a coarser solve
    assert r.returncode == 2 and "not with fewer layers" in r.stderr
    sampled = run_cli("generate", "--checkpoint", tmp_path / "run", "--prompt", "the",
                      "--max-new-tokens", "20", "--draft-steps", "2", "--seed", "3")
    assert sampled.returncode == 0 and "speculative:" in sampled.stderr, sampled.stderr
    # drafts made ahead by a process of their own (pipeline.py): the same greedy text; a
    # sampled text the seed fixes; settings it cannot run refused with status 2
    piped = run_cli(*base, "--draft-pipeline", "--draft-tokens", "3")
    assert piped.returncode == 0 and piped.stdout == plain.stdout, piped.stderr
    assert "pipelined" in piped.stderr
    again = [run_cli("generate", "--checkpoint", tmp_path / "run", "--prompt", "the",
                     "--max-new-tokens", "20", "--draft-pipeline", "--seed", "3").stdout
             for _ in range(2)]
    assert again[0] == again[1]
    r = run_cli(*base, "--draft-pipeline", "--draft-tokens", "auto")
    assert r.returncode == 2 and "fixed number of drafts" in r.stderr, r.stderr


# ---------------------------------------------------------------------------- sampling

def reference_speculative_sampling(model, prompt: list[int], n: int, solver: str, steps: int,
                                   k: int, temperature: float = 1.0, top_k=None, top_p=None,
                                   seed: int = 0, layers: int | None = None,
                                   confidence: float | None = None) -> list[int]:
    """Speculative sampling written out plainly: every distribution by a full forward of the
    whole sequence (no cache), the draft's by the model integrated with the draft solve; the
    same random draws in the same order as the implementation documents. ``confidence``: a
    round stops drafting after a draft its own distribution gives less than that."""
    from continuumlm.decoding import probabilities

    g = torch.Generator().manual_seed(seed)
    full = (model.config.ode_solver, model.config.ode_steps)
    draft_solve = "layers" if layers is not None else (solver, steps)

    def dist(seq, solve):
        if solve == "layers":  # a discrete model's first layers, through its norm and head
            with torch.no_grad():
                x = model.tok_emb(torch.tensor([seq]))
                for layer in list(model.depth.layers)[:layers]:
                    x = layer(x)
                logits = model.lm_head(model.norm_f(x))[0, -1]
            return probabilities(logits, temperature, top_k, top_p)
        if model.config.depth != "ode":
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0][0, -1]
            return probabilities(logits, temperature, top_k, top_p)
        model.set_solver(*solve)
        try:
            with torch.no_grad():
                logits = model(torch.tensor([seq]))[0][0, -1]
        finally:
            model.set_solver(*full)
        return probabilities(logits, temperature, top_k, top_p)

    def draw(probs):
        return int(torch.multinomial(probs, 1, generator=g))

    seq, out = list(prompt), []
    out.append(draw(dist(seq, full)))
    seq.append(out[-1])
    while len(out) < n:
        k_now = min(k, n - len(out) - 1)
        drafts, qs = [], []
        for _ in range(k_now):
            qs.append(dist(seq + drafts, draft_solve))
            drafts.append(draw(qs[-1]))
            if confidence is not None and float(qs[-1][drafts[-1]]) < confidence:
                break
        new = None
        for i, x in enumerate(drafts):
            p = dist(seq + drafts[:i], full)
            u = float(torch.rand((), generator=g))
            if u < min(1.0, float(p[x]) / float(qs[i][x])):
                continue  # accepted
            residual = (p - qs[i]).clamp_min(0)
            new = drafts[:i] + [draw(residual / residual.sum())]
            break
        if new is None:  # every draft accepted: one more token from the model
            new = drafts + [draw(dist(seq + drafts, full))]
        for t in new[:n - len(out)]:
            out.append(t)
            seq.append(t)
    return out


def _noisy(model, scale: float = 0.3):
    """Every weight moved by ``scale`` standard normal noise (seeded): a model whose greedy
    text does not repeat one token and whose coarse solve disagrees with its own often."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def _sharp(model, logits: float = 1.0, field: float = 6.0):
    """A field strong enough (its projections scaled by ``field``) that the draft solve's
    distribution differs from the model's (drafts are refused often), and logits of about
    ``logits`` standard deviation (the head, tied to the embedding, rescaled)."""
    with torch.no_grad():
        for m in model.depth.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.mul_(field)
        w = model.lm_head.weight
        w.mul_(logits / (w.std() * w.shape[1] ** 0.5))
    return model


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.7, top_k=20),
                                dict(temperature=1.3, top_p=0.9)])
@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_speculative_sampling_draws_what_the_reference_draws(kw, mixer):
    """With one seed, the implementation (cached, cut back) and the slow reference (full
    forwards) give the same tokens: the algorithm, the draws and their order are the
    reference's. float64, so cache and recompute agree far below any draw's margin."""
    model = _sharp(ode(mixer, "rk4", 2).double())
    prompt = [3, 1, 4, 1, 5]
    accepted = drafted = 0
    for seed, k in ((0, 3), (1, 1), (2, 4), (3, 2)):
        gen = torch.Generator().manual_seed(seed)
        stream = model.generate_stream(torch.tensor([prompt]), 14, generator=gen,
                                       draft=Draft("euler", 1, tokens=k), **kw)
        got = [int(t) for t in stream]
        want = reference_speculative_sampling(model, prompt, 14, "euler", 1, k, seed=seed,
                                              **kw)
        assert got == want, (seed, k)
        accepted, drafted = accepted + stream.stats.accepted, drafted + stream.stats.drafted
    assert 0 < accepted < drafted  # drafts were kept and refused: both branches compared


@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_a_confidence_stop_draws_what_the_reference_draws(mixer):
    """Draft(confidence=c): each round stops drafting after the first draft its own
    distribution gives less than c; the tokens and the draws are the reference's with that
    rule, and rounds end early (fewer drafts than k per round)."""
    model = _sharp(ode(mixer, "rk4", 2).double())
    prompt = [3, 1, 4, 1, 5]
    for seed, k, c in ((0, 4, 0.3), (1, 6, 0.6)):
        gen = torch.Generator().manual_seed(seed)
        stream = model.generate_stream(torch.tensor([prompt]), 16, generator=gen,
                                       temperature=0.9,
                                       draft=Draft("euler", 1, tokens=k, confidence=c))
        got = [int(t) for t in stream]
        want = reference_speculative_sampling(model, prompt, 16, "euler", 1, k,
                                              temperature=0.9, seed=seed, confidence=c)
        assert got == want, (seed, k, c)
        s = stream.stats
        assert s.drafted < k * s.rounds  # the rule ended rounds before k drafts


def test_a_confidence_stop_keeps_greedy_tokens_and_bounds_each_round():
    """Greedy with Draft(confidence=c): the tokens are plain decoding's; with c near 1 every
    round drafts one token (no draft is that sure), with c near 0 the rounds are those without
    the rule; a confidence outside (0, 1) is refused by name."""
    model = _noisy(ode("softmax", steps=4).double())
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(5))
    plain = model.generate(prompt, 40, greedy=True)
    stats = {}
    for c in (None, 1e-12, 0.5, 1 - 1e-9):
        stream = model.generate_stream(prompt, 40, greedy=True,
                                       draft=Draft("euler", 2, tokens=6, confidence=c))
        got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
        assert got.tolist() == plain.tolist(), c
        stats[c] = stream.stats
    sure = stats[1 - 1e-9]  # one draft a round (the last round, one token left, drafts none)
    assert max(sure.kept_per_round) <= 2 and sure.rounds - 1 <= sure.drafted <= sure.rounds
    assert stats[1e-12].kept_per_round == stats[None].kept_per_round
    assert stats[None].drafted > stats[0.5].drafted > stats[1 - 1e-9].drafted
    for bad in (0, 1, 1.5, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match="confidence"):
            Draft("euler", 1, confidence=bad)


def _chi_square_bound(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at the normal quantile ``z`` (3.72: a 1e-4 false alarm), by
    the Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * a ** 0.5) ** 3


def test_a_discrete_models_sampling_draws_what_the_reference_draws():
    """Speculative sampling with the first layers drafting, against the reference whose draft
    runs those layers by hand (RoPE: no position table to add)."""
    model = _sharp(small_model(mixer="softmax", num_layers=3, position="rope").double(),
                   field=16.0)
    prompt = [3, 1, 4, 1, 5]
    accepted = drafted = 0
    for seed, k, layers in ((0, 3, 1), (1, 2, 2), (2, 4, 1)):
        gen = torch.Generator().manual_seed(seed)
        stream = model.generate_stream(torch.tensor([prompt]), 14, generator=gen,
                                       temperature=0.9, draft=Draft(layers=layers, tokens=k))
        got = [int(t) for t in stream]
        want = reference_speculative_sampling(model, prompt, 14, "", 0, k, temperature=0.9,
                                              seed=seed, layers=layers)
        assert got == want, (seed, k, layers)
        accepted, drafted = accepted + stream.stats.accepted, drafted + stream.stats.drafted
    assert 0 < accepted < drafted


def test_one_verified_position_is_distributed_as_the_model():
    """The verification alone (no model): a draft drawn from q and verified against p gives,
    at that position, a token distributed as p, whatever q (one that covers p's support, one
    that misses part of it, one equal to p), and the token after an accepted draft comes from
    the next distribution. 10,000 draws per case, chi-square at a 1e-4 false alarm."""
    from continuumlm.decoding.speculative import Sampling, verify

    g = torch.Generator().manual_seed(0)
    how = Sampling(greedy=False, generator=g)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.0, 3.0, 0.0, -2.0]])
    p0, p1 = how.probs(logits[0]).double(), how.probs(logits[1]).double()
    for q in (torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1]), torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]),
              p0.float()):
        first, second = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
        n = 10000
        for _ in range(n):
            x = int(torch.multinomial(q, 1, generator=g))
            kept, after = verify([x], [q], logits, how)
            if kept:
                first[x] += 1
                second[after] += 1
            else:
                first[after] += 1
        assert float(((first - n * p0) ** 2 / (n * p0)).sum()) < _chi_square_bound(4)
        m = second.sum()  # given the draft kept, the next token is the model's next draw
        assert float(((second - m * p1) ** 2 / (m * p1)).sum()) < _chi_square_bound(4)
    # the statistic tells a wrong distribution (the first q's) apart at this many draws
    wrong = torch.tensor([0.1, 0.1, 0.5, 0.2, 0.1], dtype=torch.float64)
    assert float(((n * wrong - n * p0) ** 2 / (n * p0)).sum()) > _chi_square_bound(4)


@pytest.mark.slow
def test_speculative_sampling_is_distributed_as_the_model():
    """On a 4-token vocabulary, 3 new tokens sampled 3,000 times with speculative sampling:
    the counts of the 64 continuations match the model's own probabilities of them (a full
    forward per prefix) within the chi-square bound of a 1e-4 false alarm. The same test
    refuses the draft's own samples (what keeping every draft would give), so it can fail."""
    model = _sharp(ode("softmax", "rk4", 2, vocab_size=4))
    prompt = torch.tensor([[0, 1, 2]])
    n, V, samples = 3, 4, 3000

    def exact(solver, steps):
        full = (model.config.ode_solver, model.config.ode_steps)
        model.set_solver(solver, steps)
        try:
            with torch.no_grad():
                probs = torch.zeros(V ** n, dtype=torch.float64)
                for c in range(V ** n):
                    seq = [int(d) for d in torch.tensor([c // V ** i % V for i in
                                                         reversed(range(n))])]
                    ids = torch.cat([prompt, torch.tensor([seq])], 1)
                    p = torch.softmax(model(ids)[0][0, -n - 1:-1].double(), -1)
                    probs[c] = p[torch.arange(n), seq].prod()
        finally:
            model.set_solver(*full)
        return probs

    p, q = exact("rk4", 2), exact("euler", 1)
    assert abs(float(p.sum()) - 1) < 1e-9
    assert 0.5 * float((p - q).abs().sum()) > 0.1  # the draft differs from the model

    def counts(**kw):
        gen = torch.Generator().manual_seed(0)
        c = torch.zeros(V ** n, dtype=torch.float64)
        for _ in range(samples):
            out = model.generate(prompt, n, generator=gen, **kw)[0, -n:].tolist()
            c[sum(t * V ** (n - 1 - i) for i, t in enumerate(out))] += 1
        return c

    def chi2(c):
        return float(((c - samples * p) ** 2 / (samples * p)).sum())

    bound = _chi_square_bound(V ** n - 1)
    spec = counts(draft=Draft("euler", 1, tokens=2))
    assert chi2(spec) < bound, (chi2(spec), bound)
    spec = counts(draft=Draft("euler", 1, tokens=2, confidence=0.4))  # rounds cut short too
    assert chi2(spec) < bound, (chi2(spec), bound)
    model.set_solver("euler", 1)  # the draft's own distribution
    try:
        drafted = counts()
    finally:
        model.set_solver("rk4", 2)
    assert chi2(drafted) > bound, (chi2(drafted), bound)


@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_layer_drafts_reuse_the_first_layers_states_and_caches(mixer):
    """Draft(layers=n) shares the first n layers' caches between draft and verifier, and the
    verifying pass goes on from the drafts' states there (LayerSkip's reuse): the same tokens,
    greedy and sampled (the same random draws), as recomputing them, with fewer token rows
    through the first layers."""
    model = _sharp(small_model(mixer=mixer, num_layers=3).double(), field=4.0)
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(4))
    rows = []
    model.depth.layers[0].register_forward_hook(lambda m, a, out: rows.append(a[0].shape[1]))
    for layers, k in ((1, 3), (2, "auto"), (1, 1)):
        for sample in (False, True):
            outs, counts = [], []
            for reuse in (True, False):
                rows.clear()
                kw = (dict(temperature=0.9, generator=torch.Generator().manual_seed(7))
                      if sample else dict(greedy=True))
                stream = model.generate_stream(prompt, 20, draft=Draft(layers=layers, tokens=k,
                                                                       reuse=reuse), **kw)
                outs.append([int(t) for t in stream])
                counts.append(sum(rows))
                assert len(model.depth.layers) == 3
            assert outs[0] == outs[1], (layers, k, sample)
            assert counts[0] < counts[1], (layers, k, sample)
    with pytest.raises(ValueError, match="True or False"):
        Draft(layers=1, reuse=1)


def test_a_state_shares_caches_only_when_empty_and_only_those_held():
    from continuumlm.model.cache import DecodeState

    model = small_model(num_layers=2)
    main = model.init_state(1)
    side = DecodeState(1)
    with pytest.raises(ValueError, match="no cache for"):
        side.share(main, [("layer", 0)])
    model.step(torch.zeros(1, 3, dtype=torch.long), main)
    side.share(main, [("layer", 0)])
    assert side.pos == 3 and side.cache(("layer", 0), None) is main.cache(("layer", 0), None)
    with pytest.raises(ValueError, match="already holds"):
        side.share(main, [("layer", 1)])
