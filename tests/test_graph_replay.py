"""Graph replay of the frozen one-token step (``generate(cuda_graph=...)``).

On the CPU the recording is emulated (continuumlm.replay: the record of aten operations
that a CUDA graph would hold, Python values baked in at capture, host reads refused), which
shows that the step a CUDA graph records is the step of every later token; the CUDA-marked
test records real CUDA graphs (bench/gpu_check.sh runs it)."""

from __future__ import annotations

import contextlib
import copy
import itertools
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import small_model
from continuumlm.decoding import Decoder, frozen_decoder
from continuumlm.decoding import decoder as decoder_module
from continuumlm.decoding import replay as replay_module
from continuumlm.mixers.softmax import SoftmaxAttention
from continuumlm.registry import FIELDS, MIXERS, SOLVERS
from continuumlm.replay import CaptureError, EmulatedGraph, EmulatedGraphRecorder
from continuumlm.testing import _frozen_logits, check_cached_decoding

# --------------------------------------------------------------- the emulation can fail


def test_the_emulated_replay_runs_device_work_and_refuses_host_reads():
    W = torch.randn(3, 3, dtype=torch.float64)
    state, x = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)

    def step():
        y = W @ (state + x)
        state.copy_(y.tanh())
        return (y * 2).to(torch.float32)  # a conversion: new memory, refreshed by a replay

    rec = EmulatedGraphRecorder()
    replay, out = rec.record(step)
    assert torch.equal(state, torch.zeros(3, dtype=torch.float64)), "capture ran a write"
    ref = torch.zeros(3, dtype=torch.float64)
    for i in range(3):
        x.fill_(i)  # an input refreshed in place, as the token buffer is
        replay()
        y = W @ (ref + i)
        ref = y.tanh()
        assert torch.equal(out, (y * 2).float()) and torch.equal(state, ref)

    with pytest.raises(CaptureError, match="read on the host"):
        rec.record(lambda: state * 2 if bool(state.sum() > 0) else state)
    with pytest.raises(CaptureError, match="aten.equal"):
        rec.record(lambda: state * 2 if torch.equal(state, x) else state)


def test_the_emulated_replay_bakes_python_values_in_as_a_cuda_graph_does():
    """A step that reads a Python counter (as a position kept as an int would be) is recorded
    with the counter's value at capture: its replays differ from running it, which is what
    the decoding tests below would catch."""
    buf = torch.zeros(4)
    counter = itertools.count()

    def step():
        i = next(counter)
        buf[i] = 1.0  # a Python index: baked in
        return buf.clone()

    replay, out = EmulatedGraphRecorder().record(step)
    replay()
    replay()
    assert torch.equal(out, torch.tensor([1.0, 0, 0, 0])), "the emulation did not bake i = 0"


# --------------------------------------------------------------- the frozen step replayed


def _decode(model, prompt, n, graphs, changes=None, min_capacity=1, replays=None):
    """Greedy tokens and logits through the frozen one-token step (eager units, capacities
    from ``min_capacity`` up). ``changes[i](model)`` runs after frozen step ``i``, outside
    inference mode, as a caller's code between tokens would; the recorder's replay count
    after each step is appended to ``replays``."""
    with torch.inference_mode():
        state = model.init_state(prompt.shape[0])
        logits = model.step(prompt, state)[0]
        fn = frozen_decoder(model, state, None, min_capacity=min_capacity, recorder=graphs)
    tokens, all_logits = [logits.argmax(-1)], [logits]
    for i in range(n - 1):
        with torch.inference_mode():
            logits = fn(tokens[-1][:, None], state)
            state.advance()
        tokens.append(logits.argmax(-1))
        all_logits.append(logits)
        if replays is not None:
            replays.append(graphs.replays)
        if changes and i in changes:
            changes[i](model)
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@pytest.mark.parametrize("mixer", sorted(MIXERS))
@pytest.mark.parametrize("depth", ["ode", "discrete"])
def test_replayed_token_steps_equal_the_frozen_step_exactly(mixer, depth):
    """Every registered mixer, ODE (RK4, per-stage caches) and discrete: the replayed graph
    gives the frozen step's logits bit for bit, across refreezes to larger buffers (capacity
    8 -> 16 -> 32 -> 64 from a 5-token prompt: one recording per capacity), with a batch of 2
    and greedy tokens equal to eager cached generation; fed a new token at every step too
    (greedy tokens of a small model repeat, which would hide a replay of a stale input)."""
    model = small_model(mixer=mixer, depth=depth, ode_solver="rk4", ode_steps=2)
    prompt = torch.randint(0, 37, (2, 5))
    n = 40
    tokens, logits = _decode(model, prompt, n, EmulatedGraphRecorder())
    ref_tokens, ref_logits = _decode(model, prompt, n, None)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(torch.cat([prompt, tokens], 1), model.generate(prompt, n, greedy=True))
    forced = torch.randint(0, 37, (2, n))
    assert torch.equal(_frozen_logits(model, prompt, forced, EmulatedGraphRecorder())[0],
                       _frozen_logits(model, prompt, forced)[0])


# the solvers decoded with caches (an adaptive solve is recomputed: nothing to record)
FIXED_GRID = [n for n in sorted(SOLVERS)
              if small_model(depth="ode", ode_solver=n).depth.exact_cache]


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("solver", FIXED_GRID)
def test_every_field_and_fixed_grid_solver_replays_exactly(field, solver):
    """Solver steps of every kind (explicit tableaus, the gated step, the reversible solver's
    own loop) and every field replay to the frozen step's logits bit for bit."""
    model = small_model(mixer="softmax", depth="ode", field=field, ode_solver=solver,
                        ode_steps=2)
    prompt, tokens = torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 14))
    logits, _ = _frozen_logits(model, prompt, tokens, EmulatedGraphRecorder())
    assert torch.equal(logits, _frozen_logits(model, prompt, tokens)[0])


def test_one_recording_per_capacity_and_a_warm_up_before_each():
    model = small_model(mixer="softmax", depth="ode", ode_solver="euler", ode_steps=2)
    rec = EmulatedGraphRecorder()
    _decode(model, torch.randint(0, 37, (1, 5)), 40, rec)
    # 39 frozen steps at positions 5..43: capacities 8 (3 tokens), 16, 32, 64 (12 tokens)
    assert (rec.warmups, rec.records) == (4, 4)
    assert rec.replays == 39 - rec.warmups


@pytest.fixture
def emulated(monkeypatch):
    """generate()'s recorder replaced by the emulation, whatever the device."""
    rec = EmulatedGraphRecorder()
    monkeypatch.setattr(Decoder, "_recorder",
                        lambda self, device: rec if self.cuda_graph else None)
    return rec


def test_generate_with_graph_replay_equals_eager_generation(emulated):
    model = small_model(mixer="deltanet", depth="ode", ode_solver="rk4", ode_steps=2)
    prompt = torch.randint(0, 37, (2, 7))
    out = model.generate(prompt, 30, greedy=True, cuda_graph=True)
    assert torch.equal(out, model.generate(prompt, 30, greedy=True))
    assert emulated.records == 1 and emulated.replays == 28  # capacity 64; 29 frozen steps


def _decode_changing(graphs, changes: dict, replays=None):
    """Logits of 20 frozen steps of a small model at one capacity, ``changes`` applied
    between them (see _decode)."""
    model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2)
    prompt = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(0))
    return _decode(model, prompt, 21, graphs, changes, min_capacity=64, replays=replays)[1]


def test_a_weight_changed_between_tokens_is_recorded_again():
    """A stream yields between tokens, so a caller may change the weights there: the next
    token sees the new weights (recorded again), as it does without graphs."""
    noise = torch.randn(37, 32, generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def in_place(model):  # same address, new version
        model.lm_head.weight.add_(noise)

    def replaced(model):  # a new parameter in the old one's place
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() - 2 * noise)

    @torch.no_grad()
    def new_module(model):  # a submodule replaced: other weights at other addresses
        norm = copy.deepcopy(model.norm_f)
        norm.weight.copy_(noise[0])
        model.norm_f = norm

    changes = {4: in_place, 8: replaced, 12: new_module}
    ref = _decode_changing(None, changes)
    rec = EmulatedGraphRecorder()
    assert torch.equal(_decode_changing(rec, changes), ref)
    assert rec.records == 4


def test_the_recording_key_reads_every_parameter_and_buffer():
    """The walk behind the recording's key sees what parameters() and buffers() see, once per
    module (one registered twice, or in a cycle, is walked once), and training mode in any
    submodule."""
    model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2)
    model.depth.alias = model.depth.blocks[0]  # registered twice
    model.depth.blocks[0].back = model.depth  # a cycle
    tensors, training = replay_module._walk(model)
    assert {id(t) for t in tensors} == {id(t) for t in [*model.parameters(), *model.buffers()]}
    tied = model.lm_head.weight is model.tok_emb.weight  # a tensor of two modules, twice
    assert len(tensors) == len([*model.parameters(), *model.buffers()]) + tied
    assert training is False
    model.depth.blocks[0].field.mixer.train()
    assert replay_module._walk(model)[1] is True


def test_a_stream_switched_to_per_token_exit_or_training_runs_its_steps_directly():
    """Per-token exit (decided on the host) or training mode (dropout draws masks; here one
    submodule's) set between tokens is not what the graph recorded: those tokens run the step
    itself, as they do without graphs, and replay resumes when the switch is undone."""
    def train(model):
        model.set_exit(None)
        model.depth.blocks[0].field.train()
    changes = {6: lambda model: model.set_exit(1e9),  # every token stops after one step
               10: train, 14: lambda model: model.eval()}
    ref = _decode_changing(None, changes)
    replays = []
    assert torch.equal(_decode_changing(EmulatedGraphRecorder(), changes, replays), ref)
    steps = [b - a for a, b in zip(replays, replays[1:])]  # replays per later token
    assert steps[1:6] == [1] * 5 and steps[6:14] == [0] * 8 and steps[14:] == [1] * 5


class _FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, stream):
        pass

    def __repr__(self):
        return self.name


class _FakeCudaGraphs:
    """torch.cuda's stream and graph calls as GraphRecorder uses them, with their signatures
    and order of effects, capturing through the CPU emulation: torch.cuda.graph sets its
    capture stream current on entry and, on exit, ends the capture before it restores the
    stream; ending a capture that an error invalidated fails with an error of its own. What
    the calls were given is kept."""

    def __init__(self):
        self.current, self.replays = _FakeStream("default"), 0
        self.devices, self.graphs, self.streams = [], [], []
        fake = self

        class CUDAGraph:
            def __init__(self):
                self.emulated = EmulatedGraph()

            def replay(self):
                fake.replays += 1
                self.emulated.replay()

        class graph:
            def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                         enable_annotations=False, check_input_liveness=False):
                self.cuda_graph = cuda_graph
                self.stream = stream if stream is not None else _FakeStream("torch's")
                fake.graphs.append({"stream": stream, "mode": capture_error_mode})

            def __enter__(self):
                self.before, fake.current = fake.current, self.stream
                self.capturing = self.cuda_graph.emulated.capture()
                self.capturing.__enter__()

            def __exit__(self, *exc):
                self.capturing.__exit__(*exc)
                if exc[0] is not None:  # the capture was invalidated: ending it fails
                    raise torch.AcceleratorError("operation failed due to a previous error "
                                                 "during capture")
                fake.current = self.before

        def device(device):
            fake.devices.append(device)
            return contextlib.nullcontext()

        def set_stream(stream):
            if stream is not None:
                fake.current = stream

        def stream(stream):
            return contextlib.nullcontext()

        self.CUDAGraph, self.graph, self.device, self.set_stream, self.stream = (
            CUDAGraph, graph, device, set_stream, stream)

    def install(self, monkeypatch):
        for name in ("graph", "CUDAGraph", "device", "set_stream", "stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        def stream(device=None, priority=0, **kw):
            self.streams.append(_FakeStream("ours"))
            return self.streams[-1]
        monkeypatch.setattr(torch.cuda, "Stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)


def test_graph_recorder_decodes_exactly_through_emulated_cuda_graphs(monkeypatch):
    """GraphRecorder itself (warm-up on a side stream, capture on its own stream, replay),
    with torch.cuda's calls capturing through the CPU emulation: the replayed logits equal the
    frozen step's bit for bit across refreezes, one recording per capacity."""
    fake = _FakeCudaGraphs()
    fake.install(monkeypatch)
    model = small_model(mixer="deltanet", depth="ode", ode_solver="rk4", ode_steps=2)
    prompt, tokens = torch.randint(0, 37, (2, 5)), torch.randint(0, 37, (2, 40))
    rec = replay_module.GraphRecorder(torch.device("cuda", 0))
    logits, _ = _frozen_logits(model, prompt, tokens, rec)  # a new token at every step
    assert torch.equal(logits, _frozen_logits(model, prompt, tokens)[0])
    # 39 frozen steps from position 5: capacities 8 (3 steps), 16 (8), 32 (16), 64 (12); at
    # each, 3 warm-ups on the capture stream, then one recording whose token is replayed, then
    # replays: capacity 8 ends before its recording
    assert (rec.warmups, rec.records, rec.replays, fake.replays) == (12, 3, 27, 27)
    assert len(fake.streams) == 1  # warm-ups and captures on the one capture stream
    assert repr(fake.current) == "default"


def test_a_refused_recording_restores_the_stream_and_turns_graphs_off(monkeypatch, caplog):
    fake = _FakeCudaGraphs()
    fake.install(monkeypatch)
    x = torch.ones(3)
    cuda0 = torch.device("cuda", 0)
    rec = replay_module.GraphRecorder(cuda0)
    replay, out = rec.record(lambda: x * 2)
    replay()
    assert (rec.records, rec.replays, fake.replays) == (1, 1, 1) and torch.equal(out, x * 2)
    # on the recorder's device and capture stream, whatever is current; thread-local capture
    assert fake.devices == [cuda0] and len(fake.graphs) == 1
    assert repr(fake.graphs[0]["stream"]) == "ours" and fake.graphs[0]["mode"] == "thread_local"

    with caplog.at_level("WARNING", logger="continuumlm"):  # a host read while capturing
        assert rec.record(lambda: x * 2 if bool(x.sum() > 0) else x) is None
    assert repr(fake.current) == "default", "the capture stream was left current"
    # the cause named, not the failure to end the capture that it brought about
    assert "not permitted when stream is capturing" in caplog.text
    assert "previous error" not in caplog.text
    assert "this decoder records no more graphs" in caplog.text
    assert rec.refused.startswith("CaptureError")
    # nothing is tried again by this recorder, nor by the decoder that holds it
    assert rec.record(lambda: x * 2) is None and len(fake.graphs) == 2
    model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2)
    decoder = Decoder(model, cuda_graph=True)
    decoder.recorders[cuda0] = rec
    caplog.clear()
    with caplog.at_level("WARNING", logger="continuumlm"):
        assert decoder._recorder(cuda0) is None
    assert "refused an earlier recording" in caplog.text
    assert decoder.capture_refused == rec.refused


def test_cuda_graph_is_refused_where_it_cannot_run():
    model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2)
    prompt = torch.randint(0, 37, (1, 4))
    with pytest.raises(ValueError, match="CUDA graphs record CUDA work.*on cpu"):
        model.generate(prompt, 3, cuda_graph=True)
    with pytest.raises(ValueError, match="needs the cache"):
        model.generate(prompt, 3, cuda_graph=True, use_cache=False)
    # off unless asked for or compiling on CUDA: the CPU decodes as before
    assert torch.equal(model.generate(prompt, 5, greedy=True, cuda_graph=None),
                       model.generate(prompt, 5, greedy=True, cuda_graph=False))


@pytest.mark.parametrize("case", ["exit", "adaptive", "inference"])
def test_cuda_graph_names_what_a_recording_cannot_hold(case):
    """What the recorder refuses, named, on a CUDA device's checks (the device is given
    as CUDA; nothing is run on it)."""
    solver = "dopri5" if case == "adaptive" else "rk4"
    model = small_model(mixer="softmax", depth="ode", ode_solver=solver, ode_steps=2)
    if case == "exit":
        model.set_exit(0.1)
    if case == "inference":
        with torch.inference_mode():
            model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2)
    why = {"exit": "per-token exit", "adaptive": "adaptive solver",
           "inference": "inference tensors"}[case]
    with pytest.raises(ValueError, match=why):
        Decoder(model, cuda_graph=True)._recorder(torch.device("cuda"))
    # asked for implicitly (compile on CUDA): decoded without graphs instead
    assert Decoder(model, compile=True)._recorder(torch.device("cuda")) is None


@pytest.mark.cuda
@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graph_replay_on_a_cuda_device_equals_eager_decoding(mixer, compile, monkeypatch,
                                                                   caplog):
    """Real CUDA graphs, eager and compiled units: every frozen step after the warm-up is a
    replay (no refusal, no compiler failure), with the same greedy tokens as eager cached
    decoding, and logits through refreezes equal to the frozen step's unreplayed ones (to
    round-off)."""
    torch.manual_seed(0)
    model = small_model(mixer=mixer, depth="ode", ode_solver="rk4", ode_steps=2).cuda()
    prompt = torch.randint(0, 37, (2, 5), device="cuda")
    ref = model.generate(prompt, 40, greedy=True)
    made = []

    class Counted(replay_module.GraphRecorder):
        def __init__(self, device):
            super().__init__(device)
            made.append(self)
    monkeypatch.setattr(decoder_module, "GraphRecorder", Counted)
    decoder = Decoder(model, compile=compile, cuda_graph=True)
    with caplog.at_level("WARNING", logger="continuumlm"):
        out = decoder.generate(prompt, 40, greedy=True)
    ours = [r.getMessage() for r in caplog.records if r.name.startswith("continuumlm")]
    assert not ours and decoder.compile_refused is None, ours
    assert torch.equal(out, ref)
    (rec,) = made  # 39 frozen steps at capacity 64: 3 warm-ups, one recording, replays
    assert (rec.warmups, rec.records, rec.replays) == (3, 1, 36)
    if not compile:
        rec = replay_module.GraphRecorder(torch.device("cuda"))
        _, logits = _decode(model, prompt, 40, rec)
        _, ref_logits = _decode(model, prompt, 40, None)
        # capacities 8 (3 steps: warm-ups only), 16, 32, 64: 3 warm-ups each, then records
        assert rec.records == 3 and rec.replays == 39 - 12
        # the same operations; a library may pick another kernel inside a capture (cuBLAS
        # keeps a workspace per stream), so round-off is allowed, nothing more
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)


class _CountingAttention(SoftmaxAttention):
    """A frozen step that reads the cache's Python length: correct when run, wrong when
    replayed (the count stays at its recorded value)."""

    def extend_frozen(self, x, cache):
        return super().extend_frozen(x, cache) + 1e-3 * cache.length


class _PeekingAttention(SoftmaxAttention):
    """A frozen step that reads a device value on the host."""

    def extend_frozen(self, x, cache):
        y = super().extend_frozen(x, cache)
        return y if bool(cache.static.pos.item() >= 0) else -y


@pytest.mark.parametrize("mixer, why", [(_CountingAttention, "reads a Python value"),
                                        (_PeekingAttention, "cannot be recorded")])
def test_the_plugin_check_refuses_a_step_a_graph_cannot_replay(monkeypatch, mixer, why):
    """continuumlm.testing's decoding check (what check_component runs on a plugin) holds a
    mixer's frozen step to graph replay, naming what breaks it."""
    monkeypatch.setitem(MIXERS._entries, "odd", mixer)
    model = small_model(mixer="odd", depth="ode", ode_solver="rk4", ode_steps=2)
    with pytest.raises(AssertionError, match=why):
        check_cached_decoding(model, torch.randint(0, 37, (1, 5)), 12)


class _RefusingRecorder(EmulatedGraphRecorder):
    """A recorder that cannot record (GraphRecorder's contract when CUDA refuses: it has
    warned and returns None)."""

    def record(self, fn):
        self.records += 1
        return None


def test_a_recorder_that_refuses_leaves_the_step_to_run_directly():
    model = small_model(mixer="deltanet", depth="ode", ode_solver="rk4", ode_steps=2)
    prompt = torch.randint(0, 37, (2, 5))
    rec = _RefusingRecorder()
    _, logits = _decode(model, prompt, 30, rec)
    _, ref = _decode(model, prompt, 30, None)
    assert torch.equal(logits, ref)
    assert (rec.warmups, rec.records, rec.replays) == (1, 1, 0)  # asked once, not again


_REFUSAL = textwrap.dedent("""
    import logging, torch
    from continuumlm.decoding import GraphRecorder
    logging.basicConfig()
    x = torch.ones(4, device="cuda")
    rec = GraphRecorder(torch.device("cuda", 0))
    before = torch.cuda.current_stream()
    rec.warmup(lambda: x * 2)
    assert rec.record(lambda: x * 2 if bool(x.sum() > 0) else x) is None
    assert torch.cuda.current_stream() == before, "the capture stream was left current"
    assert rec.record(lambda: x * 2) is None  # this recorder records no more
    assert float((x * 3).sum()) == 12.0
    torch.cuda.synchronize()
    print("usable")
""")


@pytest.mark.cuda
def test_cuda_refusing_a_recording_warns_and_the_device_stays_usable():
    """A step that reads a device value on the host cannot be captured: GraphRecorder warns,
    returns None, restores the stream and records no more, and CUDA keeps working (what
    TokenGraphs' fallback relies on). In a process of its own: a failed capture can leave
    CUDA's allocator state behind (see decoding.replay_module.GraphRecorder) for later tests."""
    r = subprocess.run([sys.executable, "-c", _REFUSAL], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "usable", r.stderr[-3000:]
    assert "could not record" in r.stderr and "records no more graphs" in r.stderr


def test_a_prompt_longer_than_the_rope_tables_replays(emulated):
    """A prompt past max_seq_len grows the RoPE tables inside the stream's inference mode:
    buffers without a version counter, which the recording's key reads by address."""
    model = small_model(mixer="softmax", depth="ode", ode_solver="rk4", ode_steps=2,
                        max_seq_len=16)
    prompt = torch.randint(0, 37, (1, 40))
    out = model.generate(prompt, 12, greedy=True, cuda_graph=True)
    assert torch.equal(out, model.generate(prompt, 12, greedy=True))
    assert any(b.is_inference() for b in model.buffers())
    assert emulated.replays == 12 - 2  # warm-up, record, then replays only
