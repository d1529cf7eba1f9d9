import math

import pytest
import torch

from continuumlm.decoding import filter_logits, sample_next

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
