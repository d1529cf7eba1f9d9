"""The lean step of a discrete stack (decoding/lean_stack.py) against the decoding pass it
stands in for: the same logits for every layout it covers, over a prompt, single tokens, cut
backs and blocks; its first-layer drafts and the verifying pass resumed from them against the
decoding pass's; plain and self-speculative decoding through it keeping the decoding pass's
tokens and draws; and what it refuses, by name."""

from __future__ import annotations

import pytest
import torch

from continuumlm import Draft
from continuumlm.decoding import Decoder
from continuumlm.decoding.lean_stack import LeanStack, stack_refusal
from continuumlm.decoding.speculative import FirstLayers
from continuumlm.testing import small_model

CASES = {
    "rope": dict(),
    "learned positions": dict(position="learned"),
    "no positions, bias": dict(position="none", bias=True),
    "rmsnorm, odd width": dict(norm_type="rmsnorm", hidden_size=36, num_heads=3),
    "dyt norms (called as modules)": dict(norm_type="dyt"),
}


def _model(opts: dict, layers: int = 3):
    """Float64, every weight moved by noise: greedy text that does not repeat one token, and
    first layers that disagree with the stack often."""
    model = small_model(num_layers=layers, **opts).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_every_row_equals_the_decoding_pass(case):
    """A 6-token prompt, 5 tokens one at a time, a cut back by 3, 2 tokens at once and 12
    more one at a time (past the caches' first capacity, 16): every row's logits."""
    model = _model(dict(CASES[case]))
    assert stack_refusal(model) is None
    lean, state = LeanStack(model), model.init_state(1)
    g = torch.Generator().manual_seed(3)
    for n in [6, 1, 1, 1, 1, 1, "cut", 2] + [1] * 12:
        if n == "cut":
            lean.crop(lean.pos - 3)
            state.crop(state.pos - 3)
            continue
        tokens = torch.randint(0, 37, (n,), generator=g).tolist()
        got = lean.logits(tokens, every=True)
        want = model.lm_head(model.hidden_states(torch.tensor([tokens]), state))[0]
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-10, case
        assert lean.pos == state.pos


@pytest.mark.parametrize("case", list(CASES)[:3])
@pytest.mark.parametrize("layers", [1, 2])
@torch.inference_mode()
def test_drafts_and_the_resumed_verification_equal_the_decoding_pass(case, layers):
    """Drafts through the first layers (through the final norm and head) equal the decoding
    pass's first layers; the verifying pass resumed from their states equals the whole stack
    over the pending tokens and the last draft; a cut back after it drops what was not kept.
    The last round drafts past the caches' first capacity (16) with drafts pending."""
    model = _model(dict(CASES[case]))
    first = FirstLayers(model, layers)
    lean = LeanStack(model)
    state, side = model.init_state(1), model.init_state(1)
    prompt = [3, 1, 4, 1, 5]
    lean.logits(prompt)
    model.step(torch.tensor([prompt]), state)
    with first.drafting():
        model.step(torch.tensor([prompt]), side)
    g = torch.Generator().manual_seed(1)
    for k, kept in ((3, 1), (4, 4), (1, 0), (9, 5)):
        tokens = torch.randint(0, 37, (k + 1,), generator=g).tolist()
        before = lean.pos
        for t in tokens[:-1]:
            got = lean.draft(t, layers)
            with first.drafting():
                want = model.step(torch.tensor([[t]]), side)[0][0]
            assert got.shape == want.shape and (got - want).abs().max() < 1e-10
        got = lean.resume(tokens[-1], layers)
        want = model.lm_head(model.hidden_states(torch.tensor([tokens]), state))[0]
        assert got.shape == (k + 1, 37) and (got - want).abs().max() < 1e-10
        assert lean.pos == before + k + 1 and not lean.pending
        lean.crop(before + 1 + kept)
        state.crop(before + 1 + kept)
        if side.pos > before + 1 + kept:
            side.crop(before + 1 + kept)
        elif side.pos < before + 1 + kept:  # the last draft, kept, went through no draft pass
            with first.drafting():
                model.step(torch.tensor([tokens[side.pos - before:kept + 1]]), side)
    with pytest.raises(RuntimeError, match="drafts pending"):
        lean.draft(2, layers)
        lean.logits([1])


@pytest.mark.parametrize("case", list(CASES)[:3])
@pytest.mark.parametrize("layers", [1, 2])
@torch.inference_mode()
def test_early_read_out_equals_the_decoding_pass_first_layers(case, layers):
    """LeanStack.early (a pipelined drafter's step, its own caches): a prompt, single tokens,
    a cut back and a block, past the caches' first capacity, against the decoding pass's
    first layers through the final norm and head."""
    model = _model(dict(CASES[case]))
    first = FirstLayers(model, layers)
    lean, side = LeanStack(model), model.init_state(1)
    g = torch.Generator().manual_seed(4)
    for n in [5, 1, 1, "cut", 3] + [1] * 12:
        if n == "cut":
            lean.crop(lean.pos - 2)
            side.crop(side.pos - 2)
            continue
        tokens = torch.randint(0, 37, (n,), generator=g).tolist()
        got = lean.early(tokens, layers)
        with first.drafting():
            want = model.step(torch.tensor([tokens]), side)[0][-1]
        assert got.shape == want.shape and (got - want).abs().max() < 1e-10
        assert lean.pos == side.pos


@pytest.mark.parametrize("case", list(CASES)[:3])
def test_plain_and_speculative_decoding_keep_the_decoding_pass_tokens(case):
    """Greedy tokens and sampled draws (one seed) of plain decoding, and of self-speculative
    decoding drafting with the first layers, are the decoding pass's; each says how it ran."""
    model = _model(dict(CASES[case]))
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(2))
    lean, old = Decoder(model), Decoder(model, lean=False)
    for kw in (dict(greedy=True), dict(temperature=0.9, top_k=20)):
        a = lean.generate(prompt, 24, generator=torch.Generator().manual_seed(1), **kw)
        b = old.generate(prompt, 24, generator=torch.Generator().manual_seed(1), **kw)
        assert a.tolist() == b.tolist(), kw
        for layers, k in ((1, 3), (2, "auto")):
            runs = []
            for dec in (lean, old):
                stream = dec.stream(prompt, 24, generator=torch.Generator().manual_seed(1),
                                    draft=Draft(layers=layers, tokens=k), **kw)
                runs.append(([int(t) for t in stream], stream.stats))
            assert runs[0][0] == runs[1][0], (kw, layers, k)
            assert 0 < runs[0][1].accepted < runs[0][1].drafted  # drafts kept and refused
            assert (runs[0][1].drafted_by, runs[0][1].verified_by) == (
                "first layers, lean step", "lean step")
            assert runs[1][1].drafted_by == "first layers"
            if kw.get("greedy"):
                assert runs[0][0] == a[0, 5:].tolist()
    assert lean.decoded_by == "lean step"


def test_speculative_decoding_up_to_the_learned_positions_and_lean_false():
    """Learned positions: drafting rounds shrink so the verifying pass fits the table, up to
    its last position (greedy, plain decoding's tokens). Draft(lean=False): the drafts, and
    the verifying pass whose caches they share, through the decoding pass."""
    model = _model(dict(position="learned", max_seq_len=24))
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(8))
    plain = Decoder(model, lean=False).generate(prompt, 20, greedy=True)
    for lean in (True, False):
        stream = Decoder(model).stream(prompt, 20, greedy=True,
                                       draft=Draft(layers=1, tokens=6, lean=lean))
        assert [int(t) for t in stream] == plain[0, 5:].tolist()
        assert stream.stats.drafted_by == ("first layers, lean step" if lean else
                                           "first layers")
        assert stream.stats.verified_by == (
            "lean step" if lean else
            "decoding pass (Draft(lean=False): the drafts share its caches)")
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(prompt, 21, greedy=True, draft=Draft(layers=1))


def test_drafts_that_do_not_reuse_the_caches_go_through_the_decoding_pass():
    """Draft(reuse=False): the drafts through the decoding pass's first layers, the verifying
    pass through the lean step: plain decoding's tokens."""
    model = _model(dict())
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(4))
    plain = Decoder(model, lean=False).generate(prompt, 20, greedy=True)
    stream = Decoder(model).stream(prompt, 20, greedy=True,
                                   draft=Draft(layers=1, tokens=2, reuse=False))
    assert [int(t) for t in stream] == plain[0, 5:].tolist()
    assert (stream.stats.drafted_by, stream.stats.verified_by) == ("first layers", "lean step")


def test_refusals_name_the_reason():
    """What the lean step does not run goes through the decoding pass, saying why."""
    prompt = torch.randint(0, 37, (1, 4), generator=torch.Generator().manual_seed(2))

    def why(model) -> str:
        dec = Decoder(model)
        dec.generate(prompt, 3, greedy=True)
        return dec.decoded_by

    assert why(_model(dict(mixer="deltanet"))) == (
        "decoding pass (the mixer 'deltanet' is not causal softmax attention)")
    model = _model(dict())
    handle = model.depth.layers[1].register_forward_hook(lambda *a: None)
    assert why(model).startswith("decoding pass (TransformerBlock has hooks")
    handle.remove()
    mixer = model.depth.layers[0].mixer
    mixer.extend = lambda *a, __f=mixer.extend, **k: __f(*a, **k)  # a replaced method
    assert why(model).startswith("decoding pass (SoftmaxAttention has hooks or a replaced")
    del mixer.extend
    mixer._attend = lambda *a, __f=mixer._attend, **k: __f(*a, **k)
    assert why(model).startswith("decoding pass (SoftmaxAttention has hooks or a replaced")
    del mixer._attend
    handle = mixer.resid_dropout.register_forward_hook(lambda *a: None)
    assert why(model).startswith("decoding pass (SharedDropout has hooks")
    handle.remove()
    model.depth.record = []
    assert why(model) == "decoding pass (the stack records its layers' outputs)"
    model.depth.record = None
    assert why(model) == "lean step"
    model.train()
    with torch.no_grad():
        assert stack_refusal(model) == "it runs in inference alone (eval mode, no gradient)"
