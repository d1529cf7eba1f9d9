"""Next-token selection: the logits processing of sampling (temperature, top-k, nucleus) and
the draw."""

from __future__ import annotations

import math
import operator

import torch


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None,
                        greedy: bool = False) -> None:
    """Refuse settings that mean nothing. Greedy decoding ignores the temperature (0 is a
    common way to ask for it), but out-of-range top-k/top-p are refused there too rather than
    passed over without a word."""
    if not greedy and not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a positive finite number, got {temperature}; use "
                         f"greedy=True (--greedy) for deterministic argmax decoding.")
    if top_k is not None and (isinstance(top_k, bool) or not _whole(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a whole number of tokens, at least 1, got {top_k!r}.")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}.")


def _whole(x) -> bool:
    """An integer of any kind (int, numpy integer, 0-d integer tensor), not a float."""
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


def filter_logits(logits: torch.Tensor, top_k: int | None = None,
                  top_p: float | None = None, inplace: bool = False) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the nucleus of mass top_p.

    The nucleus is the smallest set of most probable tokens whose probability reaches top_p
    (a token is kept when the mass of the tokens ranked above it is below top_p).
    ``inplace``: the top-k cut writes into ``logits`` (a tensor the caller owns).
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        drop = logits < kth
        logits = logits.masked_fill_(drop, float("-inf")) if inplace else logits.masked_fill(
            drop, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """The distribution sampling draws from, (..., V) float32: the logits over the
    temperature, filtered (:func:`filter_logits`), through a softmax."""
    # Shift the row maximum to 0 before dividing: a tiny temperature then sends the rest to
    # -inf (sampling becomes argmax) instead of overflowing every logit to inf (NaN probabilities).
    logits = logits.float()
    # in place where the tensor is our own (the shifted copy): the same values, fewer
    # allocations on a path that runs once per token (and per draft)
    logits = (logits - logits.amax(-1, keepdim=True)).div_(temperature)
    return torch.softmax(filter_logits(logits, top_k, top_p, inplace=True), dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of the distribution ``probs`` (..., V) -> (...): the token
    ``torch.multinomial(probs, 1, generator=generator)`` draws, draw for draw, for the
    probabilities sampling makes (a softmax, or a clamped residual: no negative entries).

    On CPU ``torch.multinomial`` draws one sample as the argmax of ``probs / E`` with E
    exponential(1) from the generator, after passes that check every entry (finite, not
    negative, a positive sum); those passes cost about as much as the draw on a short row,
    once per token and per draft. This makes the same draw from the same generator, and
    checks only the ratio it picked: finite and positive unless a row holds NaN or inf or
    has no mass, in which case ``torch.multinomial`` is called to raise its own error
    (tests/test_sampling.py holds the draws equal to ``torch.multinomial``'s). A negative
    entry beside positive ones is not looked for: no distribution made here has one. Other
    devices call ``torch.multinomial``, whose draw there is its own."""
    if probs.device.type != "cpu" or probs.dim() not in (1, 2):
        # another device's draw is its own; other shapes get multinomial's own refusal
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    ratio = torch.empty_like(probs).exponential_(1, generator=generator)
    torch.div(probs, ratio, out=ratio)
    token = ratio.argmax(-1)
    picked = ratio.gather(-1, token.unsqueeze(-1))
    if not bool(((picked > 0) & (picked < math.inf)).all()):
        # rare: a row with NaN or inf, or no mass, which multinomial refuses with its own
        # error (checked as it checks, so that a valid row never reaches it); else the rows
        # were valid and an exponential draw was 0 (about 2**-53 per entry), whose infinite
        # ratio multinomial picks too
        if not bool((probs.amax() < math.inf) & (probs.amin() >= 0)
                     & (probs.sum(-1) > 0).all()):
            torch.multinomial(probs, 1)  # raises
    return token


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, greedy: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,)."""
    if greedy:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, temperature, top_k, top_p), generator)
