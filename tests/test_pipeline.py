"""Pipelined self-speculative decoding (decoding/pipeline.py, ``Draft(pipeline=True)``): the
drafts made ahead by a forked drafting process (decoding/drafter.py). Greedy, plain decoding's tokens on ODE blocks
and discrete stacks, up to the learned positions' end and through an end-of-text token;
sampled, the same draws for the same seed, and each position's token distributed as the
model's own distribution (computed exactly by enumeration, a chi-square test that the drafts'
own distribution fails); the drafting process kept between a decoder's streams only while
the weights are unchanged; a failure in it raised in the caller with its traceback; and what
it refuses, by name."""

from __future__ import annotations

import math

import pytest
import torch

from continuumlm import Draft
from continuumlm.decoding import Decoder, probabilities
from continuumlm.decoding import drafter as dr
from continuumlm.testing import small_model

pytestmark = pytest.mark.skipif("fork" not in __import__("multiprocessing")
                                .get_all_start_methods(), reason="needs fork (Linux)")


def _ode(steps: int = 4, **kw):
    """Float64, one block, RK4 x ``steps`` with the memory from the block's input; noise on
    every weight, so that Euler x 1 drafts disagree with the own solve often."""
    model = small_model(depth="ode", ode_solver="rk4", ode_steps=steps, num_layers=1,
                        ode_kv="block", position="learned", **kw).double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _stack():
    model = small_model(num_layers=3, position="learned").double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _prompt(n: int, seed: int, vocab: int = 37) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _tokens(decoder, prompt, n, draft=None, **kw) -> tuple[list[int], object]:
    stream = decoder.stream(prompt, n, draft=draft, **kw)
    return [int(t) for t in stream], getattr(stream, "stats", None)


@pytest.mark.parametrize("kind,draft", [
    ("ode", Draft("euler", 1, 1, pipeline=True)),
    ("ode", Draft("euler", 1, 3, pipeline=True)),
    ("ode", Draft("midpoint", 1, 8, pipeline=True)),
    ("stack", Draft(tokens=2, layers=1, pipeline=True)),
    ("stack", Draft(tokens=8, layers=2, pipeline=True)),
])
def test_greedy_tokens_are_plain_decodings(kind, draft):
    """Prompts of 1, 6 and 17 tokens, every one decoded to the last learned position (64):
    the rounds end at the table's end, on a short stream and everywhere between."""
    model = _ode() if kind == "ode" else _stack()
    decoder = Decoder(model)
    try:
        for i, length in enumerate((1, 6, 17)):
            prompt = _prompt(length, i)
            for n in (1, 2, 64 - length):
                plain, _ = _tokens(decoder, prompt, n, greedy=True)
                got, stats = _tokens(decoder, prompt, n, draft, greedy=True)
                assert got == plain, (kind, draft, length, n)
                assert "pipelined" in stats.drafted_by and stats.verified_by == "lean step"
                assert stats.tokens == n
        assert stats.rounds > 0 and stats.drafted > 0 and stats.nfe > 0
    finally:
        decoder.close()


def test_greedy_stops_at_the_end_of_text_token_as_plain_decoding_does():
    model = _ode()
    decoder = Decoder(model)
    try:
        prompt = _prompt(5, 3)
        plain, _ = _tokens(decoder, prompt, 40, greedy=True)
        eos = plain[17]
        want, _ = _tokens(decoder, prompt, 40, greedy=True, eos_token_id=eos)
        got, _ = _tokens(decoder, prompt, 40, Draft("euler", 1, 4, pipeline=True),
                         greedy=True, eos_token_id=eos)
        assert got == want and got[-1] == eos and len(got) <= 18
    finally:
        decoder.close()


def test_sampled_draws_are_the_seeds():
    """The rounds take drafts by the tokens alone and the drafter draws from a generator
    seeded from the stream's: the same seed, the same text, run after run, whatever the two
    processes' timing; another seed, another text."""
    model = _ode()
    decoder = Decoder(model)
    draft = Draft("euler", 1, 4, pipeline=True)
    try:
        prompt = _prompt(4, 5)
        runs = [_tokens(decoder, prompt, 50, draft, temperature=1.3,
                        generator=torch.Generator().manual_seed(s))[0] for s in (11, 11, 11, 12)]
        assert runs[0] == runs[1] == runs[2]
        assert runs[3] != runs[0]
    finally:
        decoder.close()


def _exact_marginals(model, prompt: list[int], n: int, temperature: float, top_k):
    """Each new position's token distribution (n, V), enumerated over every prefix."""
    V = model.config.vocab_size
    marg = torch.zeros(n, V, dtype=torch.float64)
    with torch.inference_mode():
        frontier = {(): 1.0}
        for pos in range(n):
            nxt = {}
            for prefix, w in frontier.items():
                logits = model(torch.tensor([prompt + list(prefix)]))[0][0, -1]
                p = probabilities(logits, temperature, top_k).double()
                marg[pos] += w * p
                if pos + 1 < n:
                    for t in range(V):
                        if p[t] > 0:
                            nxt[prefix + (t,)] = w * float(p[t])
            frontier = nxt
    return marg


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against ``probs``; infinite when a token of
    probability 0 was counted."""
    expected = probs * counts.sum()
    keep = expected > 0
    if counts[~keep].sum() > 0:
        return math.inf
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("top_k", [None, pytest.param(3, marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_models_distribution(top_k):
    """Five new tokens on a 5-token vocabulary, 1000 seeded streams with two drafts per
    round: each position's token counts against its exact distribution (chi-square, 4 degrees
    of freedom or fewer; 30 is far in the tail, p < 1e-5). The same test on the drafts' own
    distribution (what a loop that kept every draft would give) fails it."""
    model, N = _ode(steps=1, vocab_size=5), 1000
    n, temperature, prompt = 5, 1.0, [1, 3, 0, 2]
    exact = _exact_marginals(model, prompt, n, temperature, top_k)
    decoder = Decoder(model)
    draft = Draft("euler", 1, 2, pipeline=True)
    counts = torch.zeros(n, 5, dtype=torch.float64)
    kept = drafted = 0
    try:
        for s in range(N):
            out, stats = _tokens(decoder, torch.tensor([prompt]), n, draft,
                                 temperature=temperature, top_k=top_k,
                                 generator=torch.Generator().manual_seed(s))
            for i, t in enumerate(out):
                counts[i, t] += 1
            kept, drafted = kept + stats.accepted, drafted + stats.drafted
    finally:
        decoder.close()
    assert 0.2 < kept / drafted < 0.98  # drafts both kept and refused: both paths ran
    for i in range(n):
        assert _chi2(counts[i], exact[i]) < 30, (i, counts[i], exact[i])
    # the drafts' own distribution (Euler x 1, the draft solve) fails the same yardstick
    with torch.inference_mode():
        model.set_solver("euler", 1)
        try:
            drafts_own = _exact_marginals(model, prompt, n, temperature, top_k)
        finally:
            model.set_solver("rk4", 1)
    assert max(_chi2(drafts_own[i] * N, exact[i]) for i in range(n)) > 30


def test_the_drafting_process_is_kept_while_the_weights_are_unchanged():
    model = _ode()
    decoder = Decoder(model)
    draft = Draft("euler", 1, 3, pipeline=True)
    prompt = _prompt(4, 2)
    try:
        _tokens(decoder, prompt, 20, draft, greedy=True)
        (proc,) = decoder._pool._idle.values()
        _tokens(decoder, prompt, 20, draft, greedy=True)
        assert decoder._pool._idle[next(iter(decoder._pool._idle))] is proc  # the same one
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # the weights change: a new process
        changed, _ = _tokens(decoder, prompt, 20, draft, greedy=True)
        assert not proc.proc.is_alive()
        (new,) = decoder._pool._idle.values()
        assert new is not proc and new.proc.is_alive()
        assert changed == _tokens(decoder, prompt, 20, greedy=True)[0]
        with torch.no_grad():  # new storage, the same version counters: a new process too
            for p in model.parameters():
                p.data = p.data.clone()
        _tokens(decoder, prompt, 20, draft, greedy=True)
        (newer,) = decoder._pool._idle.values()
        assert newer is not new and not new.proc.is_alive()
    finally:
        decoder.close()
    assert not newer.proc.is_alive()


def test_interleaved_streams_put_the_thread_count_back_when_the_last_ends():
    model = _ode()
    decoder = Decoder(model)
    draft = Draft("euler", 1, 3, pipeline=True)
    found = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = decoder.stream(_prompt(4, 1), 12, draft=draft, greedy=True)
        b = decoder.stream(_prompt(4, 2), 12, draft=draft, greedy=True)
        next(a)
        next(b)
        assert torch.get_num_threads() == 1
        list(a)
        assert torch.get_num_threads() == 1  # `b` still runs
        list(b)
        assert torch.get_num_threads() == 2
    finally:
        decoder.close()
        torch.set_num_threads(found)


def test_a_stream_left_early_leaves_the_drafter_ready():
    model = _ode()
    decoder = Decoder(model)
    draft = Draft("euler", 1, 4, pipeline=True)
    prompt = _prompt(4, 2)
    try:
        stream = decoder.stream(prompt, 40, draft=draft, greedy=True)
        head = [int(next(stream)) for _ in range(7)]
        stream.close()  # the consumer stops: the drafter stops and is kept
        want, _ = _tokens(decoder, prompt, 40, greedy=True)
        assert head == want[:7]
        assert _tokens(decoder, prompt, 40, draft, greedy=True)[0] == want
    finally:
        decoder.close()


def test_a_failure_in_the_drafting_process_is_raised_with_its_traceback(monkeypatch):
    def broken(self, token):
        raise ValueError("the draft step broke")

    monkeypatch.setattr(dr._Drafter, "row", broken)  # forked after this: the child has it
    model = _ode()
    decoder = Decoder(model)
    try:
        with pytest.raises(RuntimeError, match="drafting process failed(.|\n)*the draft step "
                                               "broke"):
            _tokens(decoder, _prompt(4, 1), 20, Draft("euler", 1, 4, pipeline=True),
                    greedy=True)
    finally:
        decoder.close()


@pytest.mark.parametrize("draft,match", [
    (Draft("euler", 1, "auto", pipeline=True), "fixed number of drafts"),
    (Draft("euler", 1, 4, confidence=0.5, pipeline=True), "drop confidence"),
    (Draft("euler", 1, 4, lean=False, pipeline=True), "drop lean=False"),
])
def test_refusals_name_the_setting(draft, match):
    with pytest.raises(ValueError, match=match):
        Decoder(_ode()).stream(_prompt(4, 0), 8, draft=draft, greedy=True)


def test_refusals_of_the_decoder_and_the_model():
    model = _ode()
    draft = Draft("euler", 1, 4, pipeline=True)
    with pytest.raises(ValueError, match="runs eagerly through the lean steps"):
        Decoder(model, lean=False).stream(_prompt(4, 0), 8, draft=draft, greedy=True)
    with pytest.raises(ValueError, match="runs eagerly through the lean steps"):
        Decoder(model, compile=True).stream(_prompt(4, 0), 8, draft=draft, greedy=True)
    handle = model.depth.register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(ValueError, match="own solve does not run as the lean step"):
            Decoder(model).stream(_prompt(4, 0), 8, draft=draft, greedy=True)
    finally:
        handle.remove()
    with pytest.raises(ValueError, match="batch 1"):
        Decoder(model).stream(_prompt(4, 0).repeat(2, 1), 8, draft=draft, greedy=True)
    assert Draft("euler", 1, 4, pipeline=True).pipeline
    with pytest.raises(ValueError, match="pipeline"):
        Draft(pipeline=1)


def test_chi2_helper_counts_the_tail():
    """The test's own yardstick: uniform counts against the uniform distribution read 0, a
    lopsided draw reads large."""
    u = torch.full((5,), 0.2, dtype=torch.float64)
    assert _chi2(torch.full((5,), 100.0, dtype=torch.float64), u) == 0
    assert _chi2(torch.tensor([300.0, 50, 50, 50, 50], dtype=torch.float64), u) > 30
    assert math.isfinite(_chi2(torch.tensor([1.0, 0, 0, 0, 0]), u))
