"""The lean draft step (decoding/lean_draft.py) against the decoding pass it stands in for:
the same logits for every block layout it covers, over a prompt, single tokens and a cut back;
what it refuses (and the speculative stream then says so); and speculative decoding through it
keeping plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch

from continuumlm import Draft
from continuumlm.decoding.lean_draft import LeanDraft, refusal
from continuumlm.decoding.speculative import _Solves
from continuumlm.testing import small_model

CASES = {
    # name: (model options, draft solve)
    "sequential, evaluation memory, rope, euler x 1": (dict(), ("euler", 1)),
    "sequential, block memory, learned": (dict(ode_kv="block", position="learned"),
                                          ("euler", 1)),
    "parallel, step memory, rk4 x 2": (dict(field="parallel", ode_kv="step"), ("rk4", 2)),
    "midpoint x 3, no positions, bias": (dict(position="none", bias=True), ("midpoint", 3)),
    "time and step-size embeddings, block memory": (
        dict(ode_time_embedding="sinusoidal", ode_dt_embedding=True, ode_kv="block"),
        ("euler", 2)),
    "step size per evaluation, heun, one block of odd width": (
        dict(ode_dt_embedding=True, ode_dt_embedding_reads="evaluation", num_layers=1,
             hidden_size=36, num_heads=3, position="learned"), ("heun", 1)),
}


def _model(opts: dict):
    model = small_model(depth="ode", field=opts.pop("field", "sequential"), ode_solver="rk4",
                        ode_steps=4, **opts).double()
    # the time and step-size embeddings start at zero (they add nothing until trained): made
    # to matter, so that a wrong time or step size shows
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".time." in name or ".step_size." in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _library(model, solves, state, tokens: list[int]) -> torch.Tensor:
    with solves.drafting():
        h = model.hidden_states(torch.tensor([tokens]), state)
    return model.lm_head(h[:, -1])[0]


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_lean_step_equals_the_decoding_pass(case):
    """Float64: a 6-token prompt, 5 tokens one at a time, a cut back by 3, then 2 tokens at
    once and 10 more one at a time (past the caches' first capacity, 16); the draft solve's
    logits by the lean step and by the decoding pass."""
    opts, (solver, steps) = CASES[case]
    model = _model(dict(opts))
    solves = _Solves(model, solver, steps)
    assert refusal(model, solves.draft[1]) is None
    lean, state = LeanDraft(model, solves.draft[1]), model.init_state(1, rewind=8)
    assert lean.nfe == model.config.num_layers * steps * solves.draft[1][0][0].evals_per_step
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 37, (23,), generator=g).tolist()
    chunks = [ids[:6]] + [[t] for t in ids[6:11]]
    for chunk in chunks:
        torch.testing.assert_close(lean.logits(chunk), _library(model, solves, state, chunk),
                                   atol=1e-10, rtol=0)
    lean.crop(8)
    state.crop(8)
    assert lean.pos == state.pos == 8
    # the time and step-size embeddings, where there are, move the logits (not vacuous)
    if opts.get("ode_time_embedding") or opts.get("ode_dt_embedding"):
        assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if ".time." in n
                   or ".step_size." in n)
    for chunk in [ids[11:13]] + [[t] for t in ids[13:23]]:
        torch.testing.assert_close(lean.logits(chunk), _library(model, solves, state, chunk),
                                   atol=1e-10, rtol=0)
    # the solve the model decodes with is back after drafting (the lean step moves no weights)
    assert model.config.ode_solver == "rk4" and model.config.ode_steps == 4


@torch.inference_mode()
def test_learned_positions_past_the_table_are_refused():
    model = _model(dict(position="learned", max_seq_len=8))
    lean = LeanDraft(model, _Solves(model, "euler", 1).draft[1])
    lean.logits(list(range(8)))
    with pytest.raises(ValueError, match="longer than max_seq_len = 8"):
        lean.logits([1])


def test_refusals_name_the_reason():
    cases = {
        "deltanet": (small_model(depth="ode", mixer="deltanet",
                                 components={"deltanet": {"short_conv": 3}}), "mixer"),
        "attention field": (small_model(depth="ode", field="attention"), "field"),
    }
    for name, (model, word) in cases.items():
        with torch.inference_mode():
            why = refusal(model, _Solves(model, "euler", 1).draft[1])
        assert why is not None and word in why, (name, why)
    model = small_model(depth="ode")
    blocks = _Solves(model, "euler", 1).draft[1]
    assert "inference" in refusal(model, blocks)  # gradients on
    with torch.inference_mode():
        model.train()
        assert "inference" in refusal(model, blocks)
        model.eval()
        field = model.depth.blocks[0].field
        for module in (field, field.mixer, field.mixer.qkv):  # hooks the step would skip
            hook = module.register_forward_hook(lambda *a: None)
            assert "hooks" in refusal(model, blocks)
            hook.remove()
        hook = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        assert "global module hook" in refusal(model, blocks)
        hook.remove()
        for module in (model.depth.blocks[1], model.tok_emb):  # modules the step never calls
            hook = module.register_forward_pre_hook(lambda *a: None)
            assert "hooks" in refusal(model, blocks)
            hook.remove()
        field.forward = field.forward  # an instance's replaced forward (e.g. an offload hook)
        assert "replaced forward" in refusal(model, blocks)
        del field.forward
        field.mixer.extend = field.mixer.extend  # the attention's own method, replaced
        assert "replaced forward (or attention method)" in refusal(model, blocks)
        del field.mixer.extend
        assert refusal(model, blocks) is None

        class OwnStep(type(blocks[0][0])):
            def step(self, f, t, h, dt):
                return h

        odd = [(OwnStep(model.config, blocks[0][0].tableau), cfg) for _, cfg in blocks]
        assert "not a fixed-grid tableau" in refusal(model, odd)


@pytest.mark.parametrize("lean", [True, False])
def test_speculative_decoding_through_it_keeps_the_tokens(lean):
    """Greedy and sampled (one seed: the drafts may round differently from the decoding
    pass's, so only greedy tokens are compared across the two ways), and the stream says how
    its drafts were made."""
    model = small_model(depth="ode", ode_solver="rk4", ode_steps=4, ode_kv="block").double()
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = model.generate(prompt, 40, greedy=True)
    stream = model.generate_stream(prompt, 40, greedy=True,
                                   draft=Draft("euler", 1, tokens=5, lean=lean))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    # the same drafts either way (float64): the rounds keep what the decoding pass's keep
    other = model.generate_stream(prompt, 40, greedy=True,
                                  draft=Draft("euler", 1, tokens=5, lean=not lean))
    list(other)
    assert stream.stats.kept_per_round == other.stats.kept_per_round
    assert stream.stats.drafted_by == ("lean step" if lean else
                                       "decoding pass (Draft(lean=False))")
    assert stream.stats.drafted_by in stream.stats.report()
    sampled = model.generate_stream(prompt, 20, temperature=0.9,
                                    generator=torch.Generator().manual_seed(0),
                                    draft=Draft("euler", 2, tokens=3, lean=lean))
    assert len(list(sampled)) == 20


def test_a_mixer_it_does_not_cover_drafts_through_the_decoding_pass():
    model = small_model(depth="ode", mixer="deltanet", components={"deltanet": {"short_conv": 3}})
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(4))
    stream = model.generate_stream(prompt, 12, greedy=True, draft=Draft("euler", 1, tokens=3))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == model.generate(prompt, 12, greedy=True).tolist()
    assert stream.stats.drafted_by.startswith("decoding pass (the mixer 'deltanet'")


def test_draft_lean_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Draft\(lean='yes'\)"):
        Draft(lean="yes")


# ----------------------------------------------------- the model's own solve through it

@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_every_row_of_the_own_solve_equals_the_decoding_pass(case):
    """Float64: the model's own solve (RK4 x 4) by the lean step, every row's logits
    (``every=True``, what a verification reads), against the decoding pass's, over a prompt,
    a cut back and a block of 5."""
    from continuumlm.decoding.lean_draft import own_solve

    model = _model(dict(CASES[case][0]))
    assert refusal(model, own_solve(model)) is None
    lean, state = LeanDraft(model, own_solve(model)), model.init_state(1, rewind=8)
    ids = torch.randint(0, 37, (16,), generator=torch.Generator().manual_seed(4)).tolist()
    for chunk, cut in ((ids[:7], 5), (ids[5:10], None)):
        want = model.lm_head(model.hidden_states(torch.tensor([chunk]), state))[0]
        torch.testing.assert_close(lean.logits(chunk, every=True), want, atol=1e-10, rtol=0)
        if cut is not None:
            lean.crop(cut)
            state.crop(cut)


@pytest.mark.parametrize("case", list(CASES)[:4])
def test_plain_decoding_through_it_equals_the_decoding_pass(case):
    """Float64: greedy tokens and sampled draws (one seed) are the decoding pass's; the
    decoder says which way it decoded."""
    from continuumlm.decoding import Decoder

    model = _model(dict(CASES[case][0]))
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(2))
    lean, old = Decoder(model), Decoder(model, lean=False)
    for kw in (dict(greedy=True), dict(temperature=0.9, top_k=20)):
        a = lean.generate(prompt, 20, generator=torch.Generator().manual_seed(1), **kw)
        b = old.generate(prompt, 20, generator=torch.Generator().manual_seed(1), **kw)
        assert a.tolist() == b.tolist(), kw
    assert lean.decoded_by == "lean step"
    assert old.decoded_by == "decoding pass (Decoder(lean=False))"


def test_plain_decoding_says_why_it_did_not_use_it():
    from continuumlm.decoding import Decoder

    model = _model(dict())
    dec = Decoder(model)
    prompt = torch.randint(0, 37, (2, 4), generator=torch.Generator().manual_seed(2))
    dec.generate(prompt, 3, greedy=True)
    assert dec.decoded_by == "decoding pass (batch > 1)"
    dec.generate(prompt[:1], 3, greedy=True, use_cache=False)
    assert dec.decoded_by == "decoding pass (no cache)"
    model.set_exit(1e9)  # per-token exit: the lean step does not exit
    try:
        dec.generate(prompt[:1], 3, greedy=True)
        assert dec.decoded_by.startswith("decoding pass (the model exits per token")
    finally:
        model.set_exit(None)
    d = Decoder(small_model(num_layers=2, mixer="deltanet"))  # a discrete stack of DeltaNet
    d.generate(prompt[:1], 3, greedy=True)
    assert d.decoded_by == "decoding pass (the mixer 'deltanet' is not causal softmax attention)"
    with pytest.raises(ValueError, match="lean"):
        Decoder(model, lean="yes")


@pytest.mark.parametrize("lean", [True, False])
def test_speculative_verification_through_it_keeps_the_tokens(lean):
    """The prompt and every verification through the own solve's lean step (or not):
    greedy, plain decoding's tokens; the stream says how it verified."""
    from continuumlm.decoding import Decoder

    model = _model(dict(ode_kv="block", position="learned"))
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(6))
    plain = Decoder(model, lean=False).generate(prompt, 30, greedy=True)
    dec = Decoder(model, lean=lean)
    stream = dec.stream(prompt, 30, greedy=True, draft=Draft("euler", 1, tokens=4))
    got = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
    assert got.tolist() == plain.tolist()
    assert stream.stats.verified_by == ("lean step" if lean else
                                        "decoding pass (Decoder(lean=False))")
    assert "verified by" in stream.stats.report()


def test_a_solve_changed_mid_stream_is_refused_and_renorming_embeddings_are_not_run():
    """The lean plain stream refuses set_solver between its tokens (its caches were built for
    the solve it started with, as a decoding state refuses), and a model whose embedding
    renormalizes its rows (max_norm) decodes through the decoding pass."""
    from continuumlm.decoding import Decoder

    model = _model(dict())
    prompt = torch.randint(0, 37, (1, 4), generator=torch.Generator().manual_seed(2))
    dec = Decoder(model)
    stream = dec.stream(prompt, 5, greedy=True)
    next(stream)
    assert dec.decoded_by == "lean step"
    model.set_solver("euler", 2)
    try:
        with pytest.raises(ValueError, match="start a new generation after set_solver"):
            next(stream)
    finally:
        model.set_solver("rk4", 4)
    model.tok_emb.max_norm = 1.0
    dec.generate(prompt, 3, greedy=True)
    assert dec.decoded_by == "decoding pass (an embedding renormalizes its rows (max_norm))"


def test_no_new_tokens_with_a_draft_decodes_none():
    model = _model(dict())
    prompt = torch.randint(0, 37, (1, 4), generator=torch.Generator().manual_seed(2))
    out = model.generate(prompt, 0, greedy=True, draft=Draft("euler", 1, tokens=3))
    assert out.tolist() == prompt.tolist()
