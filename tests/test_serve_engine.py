"""The serving engine (continuumlm.serve.engine): rows that join and leave a running batch
decode exactly as each request alone, whatever the mixer, depth and order of arrival; and the
decoding state's row operations it rests on (regroup, put_rows, retire)."""

import copy

import pytest
import torch

from conftest import small_model
from continuumlm.decoding import Draft
from continuumlm.model.cache import DecodeState
from continuumlm.serve.engine import Closed, Depth, Engine, QueueFull, Request, Sampling
from continuumlm.serve.text import TextOut

KINDS = {
    "softmax-discrete": dict(position="learned"),
    "softmax-ode-rk4": dict(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1),
    "deltanet": dict(mixer="deltanet"),
    "continuous-ode": dict(mixer="continuous", depth="ode", num_layers=1),
    "rope-parallel-ode": dict(position="rope", depth="ode", field="parallel", num_layers=1),
}


def lively(**kw):
    """A small float64 model whose greedy tokens vary (an untied head, scaled: a fresh tied
    model repeats its last token, which would make greedy comparisons hollow)."""
    model = small_model(tie_embeddings=False, **kw).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


class Ids:
    """A tokenizer of token ids as characters (decoding is what TextOut reads)."""

    def decode(self, ids):
        return "".join(chr(65 + i) for i in ids)


class Sink:
    def __init__(self):
        self.events = []

    def __call__(self, e):
        self.events.append(e)

    def tokens(self, index=0):
        return [e.token for e in self.events if e.kind == "token" and e.index == index
                and e.token is not None]

    def done(self, index=0):
        return next((e for e in self.events if e.kind == "done" and e.index == index), None)


def alone(model, prompt, n, sampling=None, depth=None, draft=None):
    sampling = sampling or Sampling()
    m = copy.deepcopy(model)
    if depth is not None and depth.solver is not None:
        m.set_solver(depth.solver, depth.steps)
    if depth is not None and depth.exit is not None:
        m.set_exit(depth.exit[1], depth.exit[0])
    g = sampling.generator(0, "cpu")
    out = m.generate(torch.tensor([prompt]), n, sampling.temperature, sampling.top_k,
                     sampling.top_p, sampling.greedy, generator=g, draft=draft)
    return out[0, len(prompt):].tolist()


def run(engine, arrivals, limit=500):
    """Submit each request at its turn (``arrivals``: [(turn, request)]) and turn until all
    are done."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    for turn in range(limit):
        while arrivals and arrivals[0][0] <= turn:
            engine.submit(arrivals.pop(0)[1])
        if not (arrivals or engine.busy):
            return
        engine.turn()
        for g in engine.groups.values():  # pads in every row never half the state
            assert g.state.leading_pads() < max(16, g.state.pos // 2)
            assert g.state.batch_size == len(g.rows)
    raise AssertionError("the requests did not finish")


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_that_join_and_leave_decode_as_each_alone(kind):
    model = lively(**KINDS[kind])
    g = torch.Generator().manual_seed(3)
    engine = Engine(model, Ids(), max_batch=3)
    cases = []
    for i, (turn, plen, new) in enumerate([(0, 5, 12), (2, 9, 4), (3, 1, 9), (3, 14, 7),
                                           (7, 3, 6), (8, 6, 1)]):
        prompt = torch.randint(0, 37, (plen,), generator=g).tolist()
        sampling = Sampling() if i % 2 == 0 else Sampling(False, 0.9, top_k=20, seed=100 + i)
        sink = Sink()
        cases.append((turn, Request([prompt], new, sink, depth=engine.default,
                                    sampling=sampling), prompt, new, sampling, sink))
    run(engine, [(c[0], c[1]) for c in cases])
    for _, _, prompt, new, sampling, sink in cases:
        assert sink.tokens() == alone(model, prompt, new, sampling)
        assert sink.done().finish_reason == "length" and sink.done().count == new
    assert not engine.groups and not engine.running  # every state let go


def test_each_depth_decodes_as_alone_and_groups_take_turns():
    model = lively(depth="ode", ode_solver="rk4", ode_steps=4, num_layers=1)
    engine = Engine(model, Ids(), max_batch=8)
    g = torch.Generator().manual_seed(5)
    depths = [Depth("rk4", 4), Depth("euler", 1), Depth("euler", 4), Depth("rk4", 1),
              Depth("rk4", 4, ("state", 0.05)), Depth("euler", 1)]
    cases = []
    for i, d in enumerate(depths):
        prompt = torch.randint(0, 37, (3 + i,), generator=g).tolist()
        cases.append((i % 3, Request([prompt], 8, Sink(), depth=d), prompt, d))
    run(engine, [(c[0], c[1]) for c in cases])
    for _, req, prompt, d in cases:
        assert req.sink.tokens() == alone(model, prompt, 8, depth=d), d
        nfe = req.sink.done().nfe
        per = {"rk4": 4, "euler": 1}[d.solver] * d.steps
        assert nfe <= 8 * per and (nfe == 8 * per or d.exit is not None)


def test_n_choices_draw_as_seeds_seed_plus_i_alone_and_share_one_prompt_pass():
    model = lively(depth="ode", ode_steps=2, num_layers=1)
    engine = Engine(model, Ids())
    prompt = [1, 2, 3, 4]
    req = Request([prompt, [5, 6]], 6, Sink(), depth=engine.default,
                  sampling=Sampling(False, 1.0, seed=11), n=3)
    run(engine, [(0, req)])
    for p, pr in enumerate([prompt, [5, 6]]):
        for j in range(3):
            want = alone(model, pr, 6, Sampling(False, 1.0, seed=11 + j))
            assert req.sink.tokens(p * 3 + j) == want


def test_a_drafted_request_gives_the_greedy_tokens_beside_a_batch():
    model = lively(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    engine = Engine(model, Ids())
    drafted = Request([[3, 1, 4, 1, 5]], 10, Sink(), depth=engine.default,
                      draft=Draft("euler", 1, 3))
    other = Request([[2, 7]], 10, Sink(), depth=Depth("euler", 2))
    run(engine, [(0, drafted), (1, other)])
    assert drafted.sink.tokens() == alone(model, [3, 1, 4, 1, 5], 10)
    assert other.sink.tokens() == alone(model, [2, 7], 10, depth=Depth("euler", 2))
    assert drafted.sink.done().nfe > 0


def test_a_cancelled_request_leaves_the_batch_at_the_next_token():
    model = lively()
    engine = Engine(model, Ids())
    a, b = Request([[1, 2, 3]], 50, Sink()), Request([[4]], 5, Sink())
    engine.submit(a)
    engine.submit(b)
    engine.turn()
    engine.turn()
    a.cancel()
    engine.turn()
    assert engine.running == 1 and a.sink.done() is None
    [group] = engine.groups.values()
    assert group.state.batch_size == 1  # its row and caches let go
    n = len(a.sink.tokens())
    run(engine, [])
    assert len(a.sink.tokens()) == n and b.sink.tokens() == alone(model, [4], 5)
    assert not engine.groups


def test_stop_eos_and_zero_tokens_finish_rows():
    model = lively()
    engine = Engine(model, Ids())
    want = alone(model, [1, 2], 10)
    k = next(i for i in range(1, 10) if want[i] not in want[:i])  # a token new at k
    eos = Request([[1, 2]], 10, Sink(), eos_id=want[k])
    stop_text = "".join(chr(65 + t) for t in want[k - 1:k + 1])
    stop = Request([[1, 2]], 10, Sink(), stop=[stop_text])
    none = Request([[1, 2]], 0, Sink(), echo=True, logprobs=2)
    run(engine, [(0, eos), (0, stop), (0, none)])
    assert eos.sink.tokens() == want[:k] and eos.sink.done().finish_reason == "stop"
    assert eos.sink.done().count == k + 1  # the end-of-text token counts, and is not sent
    text = "".join(e.text for e in stop.sink.events if e.kind == "token")
    assert text == Ids().decode(want)[:Ids().decode(want).find(stop_text)]
    assert stop.sink.done().finish_reason == "stop"
    prompt = next(e for e in none.sink.events if e.kind == "prompt")
    assert prompt.logprobs[0] == (None, None) and len(prompt.logprobs) == 2
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2]]))[0][0, 0]
    assert prompt.logprobs[1][0] == pytest.approx(float(torch.log_softmax(logits, -1)[2]))
    assert none.sink.done().finish_reason == "length" and none.sink.done().count == 0


@pytest.mark.parametrize("kind", ["softmax-ode-rk4", "softmax-discrete", "rope-parallel-ode"])
def test_a_lone_request_decodes_through_the_lean_step_then_moves_into_the_batch(kind):
    """A request that comes to an idle engine decodes alone through the lean step; a request
    that joins its depth makes it move into the batch (its tokens read again there); each
    gets the tokens and draws it gets alone, and every field evaluation is counted once."""
    model = lively(**KINDS[kind])
    for sampling in (Sampling(), Sampling(False, 0.9, top_k=20, seed=7)):
        engine = Engine(model, Ids())
        first = Request([[3, 1, 4]], 14, Sink(), depth=engine.default, sampling=sampling)
        engine.submit(first)
        for _ in range(5):
            engine.turn()
            assert len(engine.lones) == 1 and not engine.groups
        assert engine.stats()["lone"] == 1 and engine.running == 1
        second = Request([[2, 7, 1, 8, 2, 8]], 6, Sink(), depth=engine.default,
                         sampling=sampling)
        engine.submit(second)
        engine.turn()
        assert not engine.lones
        [group] = engine.groups.values()
        assert sorted(r.request is first for r in group.rows) == [False, True]
        run(engine, [])
        assert first.sink.tokens() == alone(model, [3, 1, 4], 14, sampling)
        assert second.sink.tokens() == alone(model, [2, 7, 1, 8, 2, 8], 6, sampling)
        per = model.config.ode_steps * 4 if model.config.depth == "ode" else \
            model.config.num_layers
        assert first.sink.done().nfe == 14 * per and first.sink.done().count == 14


def test_a_lone_row_stays_lone_beside_other_depths_and_drafts_and_frees_when_cancelled():
    model = lively(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    engine = Engine(model, Ids())
    lone = Request([[5, 3]], 40, Sink(), depth=engine.default)
    other = Request([[2, 7]], 8, Sink(), depth=Depth("euler", 2))
    drafted = Request([[3, 1, 4]], 8, Sink(), depth=engine.default, draft=Draft("euler", 1, 2))
    engine.submit(lone)
    engine.turn()
    engine.submit(other)
    engine.submit(drafted)
    engine.turn()
    assert len(engine.lones) == 1 and len(engine.solos) == 1
    assert list(engine.groups) == [Depth("euler", 2)]
    for _ in range(10):  # the others end; the lone row goes on alone
        engine.turn()
    assert len(engine.lones) == 1 and not engine.groups and not engine.solos
    assert other.sink.tokens() == alone(model, [2, 7], 8, depth=Depth("euler", 2))
    assert drafted.sink.tokens() == alone(model, [3, 1, 4], 8)
    n = len(lone.sink.tokens())
    assert lone.sink.tokens() == alone(model, [5, 3], 40)[:n]
    lone.cancel()
    engine.turn()
    assert not engine.lones and not engine.running and lone.sink.done() is None


def test_after_concurrent_rows_a_request_decodes_lone_only_once_the_engine_was_quiet():
    """A wave of rows that end together empties the engine for a moment: the next request is
    batched, not made lone to move into the batch a turn later; after QUIET_TURNS turns of
    one row at most, requests decode lone again."""
    from continuumlm.serve.lone import QUIET_TURNS

    model = lively(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    engine = Engine(model, Ids())
    run(engine, [(0, Request([[1, 2]], 5, Sink())), (0, Request([[3, 4]], 5, Sink()))])
    after = Request([[5, 6]], QUIET_TURNS + 2, Sink())
    engine.submit(after)
    engine.turn()
    assert not engine.lones and len(engine.groups) == 1
    run(engine, [])
    later = Request([[7, 8]], 6, Sink())
    engine.submit(later)
    engine.turn()
    assert len(engine.lones) == 1
    run(engine, [])
    assert after.sink.tokens() == alone(model, [5, 6], QUIET_TURNS + 2)
    assert later.sink.tokens() == alone(model, [7, 8], 6)


def test_what_the_lean_step_does_not_cover_and_lean_false_are_batched():
    model = lively(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    cases = [(Engine(model, Ids()), Request([[1, 2]], 5, Sink(),
                                             depth=Depth("rk4", 2, ("state", 0.05)))),
             (Engine(model, Ids()), Request([[1, 2]], 5, Sink(), depth=Depth("rk4", 2), n=2)),
             (Engine(model, Ids(), lean=False), Request([[1, 2]], 5, Sink(),
                                                         depth=Depth("rk4", 2))),
             (Engine(lively(mixer="deltanet"), Ids()), Request([[1, 2]], 5, Sink()))]
    for engine, req in cases:
        engine.submit(req)
        engine.turn()
        assert not engine.lones and len(engine.groups) == 1, req
        run(engine, [])
        assert req.sink.done().count == 5


def test_a_lone_requests_echo_and_logprobs_are_the_batched_ones():
    model = lively(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    got = {}
    for lean in (True, False):
        engine = Engine(model, Ids(), lean=lean)
        req = Request([[4, 2, 9]], 6, Sink(), depth=engine.default, echo=True, logprobs=3)
        run(engine, [(0, req)])
        got[lean] = req.sink.events
    for a, b in zip(got[True], got[False], strict=True):
        assert (a.kind, a.token, a.text, a.tokens) == (b.kind, b.token, b.text, b.tokens)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-9)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert x[0] == pytest.approx(y[0], abs=1e-9)
        assert (a.top or {}).keys() == (b.top or {}).keys()


def test_a_full_queue_and_a_closed_engine_refuse():
    engine = Engine(lively(), Ids(), max_queue=4)
    engine.submit(Request([[1]], 3, Sink(), n=3))
    with pytest.raises(QueueFull, match="max-queue 4"):
        engine.submit(Request([[1]], 3, Sink(), n=2))
    engine.close()
    with pytest.raises(Closed):
        engine.submit(Request([[1]], 3, Sink()))


def test_the_engine_thread_serves_and_drains_on_close():
    model = lively()
    engine = Engine(model, Ids()).start()
    reqs = [Request([[i + 1, 2]], 6, Sink()) for i in range(5)]
    for r in reqs:
        engine.submit(r)
    engine.close(timeout=60)
    assert not engine.thread.is_alive() and engine.error is None
    for i, r in enumerate(reqs):
        assert r.sink.tokens() == alone(model, [i + 1, 2], 6)


@pytest.mark.parametrize("lone", [False, True], ids=["batched", "lone"])
def test_a_model_error_fails_its_requests_and_the_engine_goes_on(monkeypatch, lone):
    model = lively()
    engine = Engine(model, Ids(), lean=lone)
    bad = Request([[1, 2]], 5, Sink())
    engine.submit(bad)
    engine.turn()
    assert len(engine.lones) == lone  # a lone request decodes through the lean step
    real = model.hidden_states

    def broken(*a, **k):
        raise RuntimeError("boom")
    if lone:
        monkeypatch.setattr(engine.lones[0].step, "logits", broken)
    else:
        monkeypatch.setattr(model, "hidden_states", broken)
    engine.turn()
    assert any(e.kind == "error" and "boom" in e.message for e in bad.sink.events)
    assert not engine.lones and not engine.running
    monkeypatch.setattr(model, "hidden_states", real)
    good = Request([[3]], 4, Sink())
    run(engine, [(0, good)])
    assert good.sink.tokens() == alone(model, [3], 4)


# ---------------------------------------------------------------- the state's rows

def test_regrouped_states_need_the_same_solve_and_caches_that_can_regroup():
    model = small_model(depth="ode", ode_steps=2, num_layers=1)
    a = model.init_state(1)
    model.step(torch.tensor([[1, 2]]), a)
    model.set_solver(ode_steps=3)
    b = model.init_state(1)
    model.step(torch.tensor([[1]]), b)
    with pytest.raises(ValueError, match="different solves"):
        DecodeState.regroup([(a, None), (b, None)])

    class Plain:  # a plugin's cache without the row operation
        length = 0
    c = model.init_state(1)
    c._caches["x"] = Plain()
    with pytest.raises(NotImplementedError, match="regroup"):
        DecodeState.regroup([(c, None), (c, None)])


@pytest.mark.parametrize("kind", ["softmax-discrete", "deltanet", "continuous-ode"])
def test_regroup_moves_rows_and_frees_the_pads_in_one_copy(kind):
    model = lively(**KINDS[kind])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 37, (n,), generator=g) for n in (6, 2, 4)]
    alone = []
    for p in prompts:
        st = model.init_state(1)
        model.step(p[None], st)
        alone.append(st)
    a = DecodeState.regroup([(alone[0], None), (alone[1], None)])
    assert a.pos == 6 and a.keys.tolist()[1] == [False] * 4 + [True] * 2
    # the longest row leaves, a row joins twice: the shared pads go (6 -> 4 positions)
    b = DecodeState.regroup([(a, torch.tensor([1])), (alone[2], torch.tensor([0, 0]))])
    assert b.pos == 4 and b.batch_size == 3 and b.keys[1:].all()
    if kind != "deltanet":
        cache = next(iter(b._caches.values()))
        assert cache.buffers[0].shape[0] == 3 and cache.length == 4
    fresh = [model.init_state(1) for _ in range(3)]
    for st, p in zip(fresh, [prompts[1], prompts[2], prompts[2]]):
        model.step(p[None], st)
    nxt = torch.tensor([[5], [9], [9]])
    got = model.step(nxt, b)[0]
    for i, st in enumerate(fresh):
        torch.testing.assert_close(got[i], model.step(nxt[i:i + 1], st)[0][0], rtol=0,
                                   atol=1e-10)


# ---------------------------------------------------------------- text as it comes

class Bytes:
    """Byte-level ids, decoded as a byte-level BPE decodes (an incomplete character: U+FFFD)."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(out, data: bytes):
    pieces, stopped = [], False
    for b in data:
        text, stopped = out.add(b)
        pieces.append(text)
        if stopped:
            break
    return pieces, stopped


def test_text_never_splits_a_character_and_holds_back_a_stop_strings_start():
    pieces, _ = feed(TextOut(Bytes()), "né→x".encode())
    assert "".join(pieces) == "né→x" and all("\ufffd" not in p for p in pieces)
    out = TextOut(Bytes(), ["END"])
    pieces, stopped = feed(out, b"abEN")
    assert "".join(pieces) == "ab" and not stopped  # "EN" may begin "END"
    pieces, stopped = feed(out, b"Dzz")
    assert stopped and "".join(pieces) == "" and out.full == "ab" and out.flush() == ""
    out = TextOut(Bytes(), ["END"])
    feed(out, b"abENx")
    assert out.flush() == "" and out.full == "abENx"  # "EN" sent once "x" ruled it out
    out = TextOut(Bytes(), ["\n\n", "o w"])
    pieces, stopped = feed(out, b"hello world")
    assert stopped and "".join(pieces) == "hell"
    out = TextOut(Bytes(), ["zz"])
    pieces, _ = feed(out, b"abz")
    assert "".join(pieces) + out.flush() == "abz"  # the held "z" comes at the end


def test_arrivals_read_together_within_the_turns_prompt_budget():
    model = lively(depth="ode", ode_steps=2, num_layers=1)
    engine = Engine(model, Ids(), max_prefill_tokens=20)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 37, (n,), generator=g).tolist() for n in (3, 11, 6, 25, 2, 8)]
    reqs = [Request([p], 5, Sink(), depth=engine.default,
                    sampling=Sampling(False, 1.0, seed=i) if i % 2 else Sampling())
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    engine.turn()
    assert engine.running == 3  # 3 + 11 + 6 tokens; the 25-token prompt waits its turn
    engine.turn()
    assert engine.running == 4  # over the budget alone: taken alone
    run(engine, [])
    for i, (r, p) in enumerate(zip(reqs, prompts)):
        assert r.sink.tokens() == alone(model, p, 5, r.sampling), i


@pytest.mark.parametrize("kind", ["softmax-discrete", "deltanet", "continuous-ode"])
def test_a_row_joins_in_the_slot_a_finished_row_left(kind):
    model = lively(**KINDS[kind])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 37, (n,), generator=g) for n in (7, 5, 3)]
    states = []
    for p in prompts:
        st = model.init_state(1)
        model.step(p[None], st)
        states.append(st)
    batch = DecodeState.regroup([(states[0], None), (states[1], None)])
    batch.retire(0)  # the first row finishes; the third prompt takes its slot
    fresh = model.init_state(1)
    model.step(prompts[2][None], fresh)
    batch.put_rows([0], fresh, [0])
    assert batch.batch_size == 2 and batch.pos == 7
    assert batch.keys[0].tolist() == [False] * 4 + [True] * 3
    again = model.init_state(1)
    model.step(prompts[2][None], again)
    nxt = torch.tensor([[11], [12]])
    got = model.step(nxt, batch)[0]
    torch.testing.assert_close(got[0], model.step(nxt[:1], again)[0][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], model.step(nxt[1:], states[1])[0][0], rtol=0,
                               atol=1e-10)
    longer = model.init_state(1)
    model.step(torch.randint(0, 37, (1, 12), generator=g), longer)
    with pytest.raises(ValueError, match="regroup"):
        batch.put_rows([0], longer, [0])


def test_learned_positions_are_checked_per_row_not_by_the_batchs_columns():
    model = lively(max_seq_len=8, position="learned")
    long_, short = model.init_state(1), model.init_state(1)
    model.step(torch.randint(0, 37, (1, 7)), long_)
    model.step(torch.tensor([[3, 4]]), short)
    batch = DecodeState.regroup([(long_, None), (short, None)])
    batch.retire(0)
    for t in range(6):  # the short row reaches 8 positions; the columns, 13
        model.step(torch.tensor([[1], [5 + t]]), batch)
    assert batch.pos == 13
    with pytest.raises(ValueError, match="max_seq_len = 8"):
        model.step(torch.tensor([[1], [2]]), batch)
    with pytest.raises(ValueError, match="max_seq_len = 8"):  # unpadded: the columns count
        model.step(torch.tensor([[1]]), long_) and model.step(torch.tensor([[1, 2]]), long_)


def test_a_batch_that_cannot_be_rebuilt_fails_its_requests_not_the_engine(monkeypatch):
    model = lively()
    engine = Engine(model, Ids(), lean=False)  # the first request batched, not lone
    first = Request([[1, 2, 3]], 30, Sink())
    engine.submit(first)
    engine.turn()

    def broken(*a, **k):
        raise RuntimeError("no room")
    monkeypatch.setattr(DecodeState, "regroup", broken)
    joining = Request([[4, 5, 6, 7, 8, 9]], 5, Sink())  # longer: the batch is rebuilt
    engine.submit(joining)
    engine.turn()
    for r in (first, joining):
        assert [e.kind for e in r.sink.events][-1] == "error", r.sink.events[-1]
    assert engine.error is None and not engine.groups
    monkeypatch.undo()
    again = Request([[3]], 4, Sink())
    run(engine, [(0, again)])
    assert again.sink.tokens() == alone(model, [3], 4)


def test_free_slots_add_no_positions_while_others_come_and_go():
    """A burst fills four slots, then three requests stay in flight: the slot left free adds
    no positions (its tokens are pads), so the state stays within its rows' lengths and a
    learned-position model never runs past its table."""
    model = lively(max_seq_len=32, position="learned")
    engine = Engine(model, Ids(), max_batch=4)
    g = torch.Generator().manual_seed(6)
    made = []

    def new(n):
        prompt = torch.randint(0, 37, (3,), generator=g).tolist()
        made.append((Request([prompt], n, Sink()), prompt, n))
        engine.submit(made[-1][0])
    for n in (12, 12, 12, 3):  # the fourth leaves its slot free after two steps
        new(n)
    for _ in range(150):
        while engine.running + len(engine.waiting) < 3:
            new(12)
        engine.turn()
        for grp in engine.groups.values():
            assert grp.state.pos <= 2 * 15 + 16
    assert all(e.kind != "error" for r, _, _ in made for e in r.sink.events)
    for r, prompt, n in made[::7]:
        if r.sink.done() is not None:
            assert r.sink.tokens() == alone(model, prompt, n)
