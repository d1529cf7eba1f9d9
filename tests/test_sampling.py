import math

import pytest
import torch

from continuumlm.eval.sampling import filter_logits, sample_next

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
