import math

import pytest
import torch

from continuumlm.decoding import filter_logits, probabilities, sample_next
from continuumlm.decoding.sampling import draw

PROBS = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])


def _kept(logits):
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_k_largest():
    logits = PROBS.log()
    assert _kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert _kept(filter_logits(logits, top_k=5)) == [0, 1, 2, 3, 4]
    assert _kept(filter_logits(logits, top_k=99)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("p,expected", [
    (0.3, [1]),            # 0.4 alone reaches 0.3
    (0.4, [1]),            # exactly reached by the first token
    (0.5, [1, 3]),         # 0.4 < 0.5 -> add 0.3
    (0.75, [1, 3, 4]),     # 0.7 < 0.75 -> add 0.15
    (0.86, [1, 2, 3, 4]),  # 0.85 < 0.86 -> add 0.1
    (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p_hand_computed(p, expected):
    assert _kept(filter_logits(PROBS.log(), top_p=p)) == expected


def test_filtered_distribution_renormalizes():
    logits = filter_logits(PROBS.log(), top_k=3, top_p=0.6)  # top-3 {1,3,4}, renorm .47,.35,.18
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(probs, torch.tensor([0, 0.4, 0, 0.3, 0]) / 0.7)


@pytest.mark.parametrize("shape", [(1,), (5,), (65,), (3, 65), (1, 7), (50257,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_draw_is_torch_multinomials_draw(shape, dtype):
    """draw() skips multinomial's checking passes, not its draw: the same token as
    torch.multinomial(probs, 1) from the same generator, draw after draw, on awkward sizes,
    sharp and flat rows and rows with zeros (a top-k cut)."""
    gen = torch.Generator().manual_seed(7)
    for sharp in (0.1, 1.0, 8.0):
        logits = torch.randn(*shape, generator=gen, dtype=dtype) * sharp
        if shape[-1] > 3:
            logits[..., ::3] = -math.inf  # filtered tokens: probability 0, never drawn
        probs = torch.softmax(logits, -1)
        ours, theirs = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
        for _ in range(60):
            got = draw(probs, ours)
            want = torch.multinomial(probs.reshape(-1, shape[-1]), 1, generator=theirs)
            assert got.shape == shape[:-1]
            assert torch.equal(got.reshape(-1), want.reshape(-1))
        # the generators moved on alike: the next draws still agree
        assert torch.equal(torch.rand(3, generator=ours), torch.rand(3, generator=theirs))


@pytest.mark.parametrize("bad", [
    torch.tensor([0.5, float("nan"), 0.5]), torch.tensor([0.5, float("inf"), 0.5]),
    torch.zeros(4), torch.tensor([[0.5, 0.5], [0.0, 0.0]]), torch.full((2, 3, 4), 0.25)])
def test_draw_refuses_what_multinomial_refuses(bad):
    with pytest.raises(RuntimeError) as theirs:
        torch.multinomial(bad, 1)
    with pytest.raises(RuntimeError) as ours:
        draw(bad, torch.Generator().manual_seed(0))
    assert str(ours.value) == str(theirs.value)


def test_draw_after_an_exponential_of_zero_is_multinomials():
    """The rare path: an exponential draw of exactly 0 gives an infinite ratio, which both
    pick; draw() raises nothing for a valid row and leaves the global generator alone."""
    probs = torch.tensor([0.2, 0.5, 0.3])
    state = torch.get_rng_state()
    orig = torch.Tensor.exponential_
    try:
        torch.Tensor.exponential_ = lambda self, *a, **k: self.copy_(torch.tensor([1.0, 0.0,
                                                                                   1.0]))
        assert int(draw(probs, torch.Generator().manual_seed(0))) == 1
    finally:
        torch.Tensor.exponential_ = orig
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("top_k,top_p", [(None, None), (3, None), (40, None), (64, None),
                                         (None, 0.9), (40, 0.9)])
def test_probabilities_equal_the_out_of_place_formula(top_k, top_p):
    """probabilities() shifts, divides and cuts in place: bit for bit the distribution of the
    same steps written out of place, and the logits it was given untouched."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(65,), (9, 65), (2, 5)]:
        logits = torch.randn(*shape, generator=gen) * 3
        logits[..., 0] = logits[..., 1]  # a tie at the cut
        before = logits.clone()
        got = probabilities(logits, 0.8, top_k, top_p)
        want = torch.softmax(filter_logits((logits - logits.amax(-1, keepdim=True)) / 0.8,
                                           top_k, top_p), -1)
        assert torch.equal(got, want)
        assert torch.equal(logits, before)


def test_sample_frequencies_follow_filtered_distribution():
    logits = PROBS.log().repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    s = sample_next(logits, temperature=1.0, top_p=0.5, generator=g)
    frac = (s == 1).float().mean().item()
    assert set(s.unique().tolist()) == {1, 3}
    assert math.isclose(frac, 0.4 / 0.7, abs_tol=0.02)


def test_temperature_sharpens_and_greedy():
    logits = PROBS.log()[None]
    assert sample_next(logits, greedy=True).item() == 1
    g = torch.Generator().manual_seed(0)
    cold = sample_next(logits.repeat(2000, 1), temperature=0.05, generator=g)
    assert (cold == 1).float().mean() > 0.99


def test_batched_rows_filter_independently():
    logits = torch.stack([PROBS.log(), PROBS.flip(0).log()])
    out = filter_logits(logits, top_k=1)
    assert _kept(out[0]) == [1] and _kept(out[1]) == [3]


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_tiny_temperature_samples_the_argmax(temperature, top_p):
    """Dividing logits by a temperature near float32's smallest value overflowed them to inf
    (NaN probabilities, a crash in multinomial); such a temperature means argmax."""
    logits = torch.tensor([[2.0, 1.0, -3.0, 0.5], [20.0, 30.0, -3.0, 29.5]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=temperature, top_p=top_p, generator=g).tolist() == [0, 1]


def _scripted_cli(monkeypatch, logits_at):
    """A BPE tokenizer and a model whose head returns ``logits_at(call, rows, vocab)`` at each
    decoding step (prompt logits are zeros), served to the CLI as if loaded from a checkpoint."""
    import torch.nn as nn

    import continuumlm.runs as runs
    from continuumlm import LanguageModel, ModelConfig
    from continuumlm.data.tokenizers import BPETokenizer

    tok = BPETokenizer.train("the cat sat on the mat. " * 50, vocab_size=300)

    class ScriptedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, h):
            if h.dim() != 2:  # the prompt's positions
                return torch.zeros(*h.shape[:-1], tok.vocab_size)
            self.calls += 1
            return logits_at(self.calls, h.shape[0], tok)

    model = LanguageModel(ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, num_heads=2,
                                      num_layers=1, tie_embeddings=False)).eval()
    model.lm_head = ScriptedHead()
    monkeypatch.setattr(runs, "load_model_and_tokenizer", lambda *a, **k: (model, tok, None))
    return tok


def test_cli_samples_that_end_early_print_end_of_text_once(monkeypatch, capsys):
    """`generate --num-samples N` pads rows that produced end-of-text until every row is done;
    the CLI prints each sample up to its first end-of-text, not the padding."""
    from continuumlm.cli import main

    def logits_at(call, rows, tok):  # row 0 ends at its second new token, row 1 never
        out = torch.zeros(rows, tok.vocab_size)
        out[:, tok.encode("cat")[0]] = 1.0
        if call == 2:
            out[0, tok.eos_id] = 5.0
        return out

    tok = _scripted_cli(monkeypatch, logits_at)
    assert main(["generate", "--checkpoint", "x", "--prompt", "the", "--max-new-tokens", "8",
                 "--greedy", "--num-samples", "2"]) == 0
    first, second = capsys.readouterr().out.split("\n---\n")
    assert first == "thecat" + tok.decode([tok.eos_id])
    assert second.strip() == "the" + "cat" * 8


@pytest.mark.parametrize("samples", ["1", "2"])
def test_cli_holds_back_a_last_incomplete_character(monkeypatch, capsys, samples):
    """The streaming printer waits for the rest of a multi-byte character; when generation
    stops inside one, its bytes are held back (said on stderr), never printed as U+FFFD; the
    same for --num-samples' rows. Complete, the character prints."""
    from continuumlm.cli import main

    def logits_at(call, rows, tok):  # the euro sign's three byte-level tokens, in order
        out = torch.zeros(rows, tok.vocab_size)
        out[:, tok.encode("€")[min(call - 1, 2)]] = 1.0
        return out

    tok = _scripted_cli(monkeypatch, logits_at)
    euro = tok.encode("€")
    assert len(euro) == 3  # stop after two
    assert main(["generate", "--checkpoint", "x", "--prompt", "the", "--max-new-tokens", "2",
                 "--greedy", "--num-samples", samples]) == 0
    out, err = capsys.readouterr()
    assert "\ufffd" not in out and out.split("\n---\n")[0].rstrip("\n") == "the"
    assert "the last 2 tokens stopped inside a multi-byte character" in err
    import continuumlm.runs as runs

    runs.load_model_and_tokenizer()[0].lm_head.calls = 0  # the script from its start
    assert main(["generate", "--checkpoint", "x", "--prompt", "the", "--max-new-tokens", "3",
                 "--greedy", "--num-samples", samples]) == 0
    out, err = capsys.readouterr()
    assert out.split("\n---\n")[0].rstrip("\n") == "the€" and "stopped inside" not in err
