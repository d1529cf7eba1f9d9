from pathlib import Path

import pytest
import torch

from conftest import assert_cached_decoding_exact, small_config, small_model
from continuumlm import CheckpointError, LanguageModel
from continuumlm.decoding import Compiled, Decoder, frozen_decoder
from continuumlm.mixers.cache import FrozenSeqCache
from continuumlm.model.cache import KVCache

VARIANTS = [
    dict(position="rope"),
    dict(position="learned"),
    dict(position="none"),
    dict(norm_type="rmsnorm", bias=True),
    dict(use_bitnet=True),
    dict(tie_embeddings=False),
]


@pytest.mark.parametrize("kw", VARIANTS)
def test_shapes_and_loss(kw):
    m = small_model(**kw)
    idx = torch.randint(0, 37, (3, 17))
    logits, loss = m(idx)
    assert logits.shape == (3, 17, 37) and loss is None
    _, loss = m(idx, idx)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("kw", VARIANTS)
def test_decoder_is_causal(kw):
    """Changing tokens after position i leaves the logits at positions <= i unchanged."""
    m = small_model(**kw)
    idx = torch.randint(0, 37, (2, 24))
    ref, _ = m(idx)
    for i in (0, 7, 22):
        alt = idx.clone()
        alt[:, i + 1:] = torch.randint(0, 37, alt[:, i + 1:].shape)
        out, _ = m(alt)
        torch.testing.assert_close(out[:, : i + 1], ref[:, : i + 1], rtol=0, atol=1e-5)
        if i + 1 < idx.shape[1]:
            assert not torch.allclose(out[:, i + 1:], ref[:, i + 1:])


def test_encoder_sees_the_future():
    m = small_model(mode="encoder")
    idx = torch.randint(0, 37, (1, 12))
    alt = idx.clone()
    alt[:, -1] = (alt[:, -1] + 1) % 37
    assert not torch.allclose(m(idx)[0][:, 0], m(alt)[0][:, 0])
    with pytest.raises(ValueError, match="decoder"):
        m.generate(idx, 2)


@pytest.mark.parametrize("kw", [dict(position="rope"), dict(position="learned"), dict(position="none")])
@pytest.mark.parametrize("prompt_len", [1, 5, 13])
def test_kv_cache_equals_recompute(kw, prompt_len):
    m = small_model(**kw)
    prompt = torch.randint(0, 37, (2, prompt_len))
    n_new = 64 - prompt_len + 1 if kw["position"] == "learned" else 64
    assert_cached_decoding_exact(m, prompt, n_new, atol=1e-5)


def test_chunked_prefill_after_cache():
    """A multi-token chunk after cached tokens attends causally within the chunk."""
    m = small_model()
    idx = torch.randint(0, 37, (2, 20))
    state = m.init_state(2)
    m.step(idx[:, :7], state)
    h = m.hidden_states(idx[:, 7:], state)
    torch.testing.assert_close(h, m.hidden_states(idx)[:, 7:], rtol=0, atol=1e-5)


def test_cache_rows_are_independent():
    m = small_model()
    p = torch.randint(0, 37, (2, 6))
    both = m.generate(p, 20, greedy=True)
    for r in range(2):
        assert torch.equal(both[r:r + 1], m.generate(p[r:r + 1], 20, greedy=True))


def test_kv_cache_growth():
    c = KVCache()
    ks = [torch.randn(1, 2, n, 4) for n in (3, 1, 20, 1)]
    for k in ks:
        k_all, v_all = c.append(k, -k)
    torch.testing.assert_close(k_all, torch.cat(ks, dim=2))
    assert c.length == 25


def test_static_cache_write_and_advance():
    from continuumlm.model.cache import DecodeState

    state = DecodeState(1)
    c = state.cache("a", KVCache)
    k = torch.randn(1, 2, 3, 4)
    c.append(k, -k)
    state.pos = 3
    state.freeze(8, torch.device("cpu"))
    frozen = state.cache("a", KVCache)  # the frozen layout replaced the eager cache
    assert isinstance(frozen, FrozenSeqCache) and frozen is not c
    assert frozen.buffers[0].shape[-2] == 8
    assert state.static.mask.tolist() == [[True] * 4 + [False] * 4]
    new = torch.randn(1, 2, 1, 4)
    k_all, v_all = frozen.write(new, -new)
    state.advance()
    torch.testing.assert_close(k_all[..., :4, :], torch.cat([k, new], 2))
    assert frozen.length == 4 and state.pos == 4 and int(state.static.pos) == 4
    assert state.static.mask.sum() == 5 and not k_all[..., 4:, :].any()  # tail zeros, not garbage
    assert not hasattr(frozen, "append")  # one token at a time, written in place
    with pytest.raises(ValueError, match="back to 5"):
        frozen.crop(5)
    state.crop(2)  # in place: the tokens after 2 are masked and written over
    assert frozen.length == 2 and int(state.static.pos) == 2 and state.static.mask.sum() == 3
    state.static.set_width(2)  # the next step takes two tokens
    frozen.write(torch.cat([k[..., 2:3, :], new], 2), -torch.cat([k[..., 2:3, :], new], 2))
    assert state.static.pos.tolist() == [2, 3]
    assert state.static.mask.sum(1).tolist() == [3, 4]
    state.advance()
    assert frozen.length == 4 and state.pos == 4 and state.static.pos.tolist() == [4, 5]
    state.freeze(16, torch.device("cpu"))  # refrozen larger: the same tokens
    bigger = state.cache("a", KVCache)
    assert bigger.buffers[0].shape[-2] == 16
    torch.testing.assert_close(bigger.buffers[0][..., :4, :], torch.cat([k, new], 2))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_compiled_decoding_equals_eager(mixer):
    """generate(compile=True): one torch.compile graph of one solver step serves every step of
    every block at every position, the buffers doubling when full (the capacity is symbolic
    from the first graph on); logits equal a full forward's, and later generations compile
    nothing."""
    m = small_model(mixer=mixer, depth="ode", ode_solver="midpoint", ode_steps=2, num_layers=2,
                    position="rope",
                    components={"deltanet": {"short_conv": 4}} if mixer == "deltanet" else {})
    prompt = torch.randint(0, 37, (2, 5))
    a = m.generate(prompt, 30, greedy=True)
    state = m.init_state(2)
    # as in generate: states built, frozen and stepped in inference mode (grad mode and
    # inference tensors are part of what a graph is valid for)
    with torch.inference_mode():
        steps = [m.step(a[:, :5], state)[0]]
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        ev = Compiled()
        fn = frozen_decoder(m, state, ev, min_capacity=16)
        capacities = set()
        for t in range(5, a.shape[1] - 1):
            steps.append(fn(a[:, t:t + 1], state))
            capacities.add(state.static.capacity)
            state.advance()
    assert capacities == {16, 32, 64}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert ev.refused is None
    full, _ = m(a[:, :-1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], rtol=0, atol=1e-4)
    # two states at different capacities, stepped in turn, through the same graph
    states, outs = [m.init_state(2), m.init_state(2)], [[], []]
    with torch.inference_mode():
        for st, n in zip(states, (5, 20)):
            m.step(a[:, :n], st)
        fns = [frozen_decoder(m, st, Compiled(), min_capacity=16) for st in states]
        for t in range(8):
            for i, n in enumerate((5, 20)):
                outs[i].append(fns[i](a[:, n + t:n + t + 1], states[i]))
                states[i].advance()
    assert [st.static.capacity for st in states] == [16, 32]
    for i, n in enumerate((5, 20)):
        torch.testing.assert_close(torch.stack(outs[i], 1), full[:, n:n + 8], rtol=0, atol=1e-4)
    torch._dynamo.utils.counters.clear()
    b = m.generate(prompt, 20, greedy=True, compile=True)
    assert torch.equal(b, a[:, :25])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["discrete", "time_embedding", "exit", "rk2_gated",
                                  "reversible"])
def test_compiled_decoding_of_other_depths(case):
    """The compiled unit is a discrete stack's layer, an ODE solver step (a time-dependent
    field reads t as a tensor: one graph for every step), or, with per-token exit or a
    reversible solver, one field evaluation; each decodes the tokens of eager decoding,
    compiled throughout (no fallback)."""
    kw = {"discrete": dict(depth="discrete", num_layers=2),
          "time_embedding": dict(depth="ode", ode_solver="rk4", ode_steps=2,
                                 ode_time_embedding="sinusoidal"),
          "exit": dict(depth="ode", ode_solver="heun", ode_steps=3),
          "rk2_gated": dict(depth="ode", ode_solver="rk2_gated", ode_steps=2),
          "reversible": dict(depth="ode", ode_solver="reversible_heun", ode_steps=2)}[case]
    m = small_model(position="rope", **kw)
    if case == "time_embedding":  # make t matter
        for b in m.depth.blocks:
            torch.nn.init.normal_(b.field.time.proj.weight, std=0.5)
    if case == "exit":
        m.set_exit(0.05)
    prompt = torch.randint(0, 37, (1, 5))
    ref = m.generate(prompt, 40, greedy=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counted = m.depth.exit_totals[1] if case == "exit" else 0
    decoder = Decoder(m, compile=True)
    out = decoder.generate(prompt, 40, greedy=True)
    assert torch.equal(out, ref)
    assert decoder.compile_refused is None
    if case == "exit":  # the compiled steps' tokens are counted too: prompt + 39 steps
        assert m.depth.exit_totals[1] - counted == 5 + 39
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def test_compile_where_there_is_no_cached_step_is_refused_or_said(caplog):
    """compile=True compiles the cached one-token step: with use_cache=False it contradicts
    the call (refused); an adaptive solver decodes by recomputing, with nothing compiled
    (warned, decoded eagerly, nothing traced)."""
    m = small_model()
    prompt = torch.randint(0, 37, (1, 4))
    with pytest.raises(ValueError, match="drop one of them"):
        m.generate(prompt, 3, compile=True, use_cache=False)
    m = small_model(depth="ode", ode_solver="dopri5")
    torch._dynamo.utils.counters.clear()
    with caplog.at_level("WARNING", logger="continuumlm"):
        out = m.generate(prompt, 4, greedy=True, compile=True)
    assert "recomputing the whole context for every token, eagerly" in caplog.text
    assert torch.equal(out, m.generate(prompt, 4, greedy=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_compile_failure_decodes_eagerly(monkeypatch, caplog):
    """A compiler failure is recorded on the decoder that met it, warned of once, and that
    decoder decodes eagerly from then on; a new decoder (each model.generate call) tries
    again. Nothing is recorded on the model or in the process."""
    import copy

    m = small_model()
    prompt = torch.randint(0, 37, (1, 4))
    ref = m.generate(prompt, 12, greedy=True)

    def broken(*a, **k):
        raise torch._dynamo.exc.TorchDynamoException("no compiler here")

    monkeypatch.setattr(torch, "compile", lambda *a, **k: broken)
    decoder = Decoder(m, compile=True)
    with caplog.at_level("WARNING", logger="continuumlm"):
        out = decoder.generate(prompt, 12, greedy=True)
        again = decoder.generate(prompt, 12, greedy=True)
    assert torch.equal(out, ref) and torch.equal(again, ref)
    assert len(caplog.records) == 1 and "no compiler here" in caplog.records[0].message
    assert "no compiler here" in decoder.compile_refused
    with caplog.at_level("WARNING", logger="continuumlm"):
        assert torch.equal(m.generate(prompt, 12, greedy=True, compile=True), ref)
    assert len(caplog.records) == 2  # a new decoder: tried, and said, again
    copy.deepcopy(m)  # nothing compiled is stored on the model


@pytest.mark.slow
def test_running_out_of_graphs_decodes_eagerly(monkeypatch, caplog):
    """Dynamo refuses to compile past its graph limit (under fullgraph, by raising): that model
    warns once and decodes eagerly, with the same tokens. A second batch size needs a graph
    of its own, the second under a limit of one."""
    from continuumlm.decoding import frozen

    m = small_model()
    one, two = torch.randint(0, 37, (1, 4)), torch.randint(0, 37, (2, 4))
    refs = [m.generate(p, 20, greedy=True) for p in (one, two)]
    monkeypatch.setattr(frozen, "RECOMPILE_LIMIT", 0)
    decoder = Decoder(m, compile=True)
    torch._dynamo.reset()  # no graphs of earlier tests count against the limit
    try:  # (not monkeypatch: undoing it on torch's config module hides the setting)
        with torch._dynamo.config.patch(recompile_limit=1), \
                caplog.at_level("WARNING", logger="continuumlm"):
            outs = [decoder.generate(one, 20, greedy=True)]
            assert decoder.compile_refused is None  # the first batch size compiled
            outs.append(decoder.generate(two, 20, greedy=True))
    finally:
        torch._dynamo.reset()  # later tests start from no graphs whatever happened here
    assert torch.equal(outs[0], refs[0]) and torch.equal(outs[1], refs[1])
    ours = [r for r in caplog.records if r.name == "continuumlm"]
    assert len(ours) == 1 and "RecompileLimit" in ours[0].getMessage()
    assert "RecompileLimit" in decoder.compile_refused


def test_interleaved_streams_keep_eval_mode_until_the_last_ends():
    m = small_model(dropout=0.5)
    m.train()
    prompt = torch.randint(0, 37, (1, 4))
    ref = m.eval().generate(prompt, 6, greedy=True)
    m.train()
    a, b = m.generate_stream(prompt, 3, greedy=True), m.generate_stream(prompt, 6, greedy=True)
    got_a, got_b = [next(a)], [next(b)]
    got_a += list(a)            # a ends while b is still going: b must not see dropout
    got_b += list(b)
    assert torch.equal(torch.cat([prompt] + [t[:, None] for t in got_b], 1), ref)
    assert torch.equal(torch.cat([prompt] + [t[:, None] for t in got_a], 1), ref[:, :7])
    assert m.training


def test_streamed_tokens_are_ordinary_tensors_and_inference_mode_ends_between_them():
    """A stream decodes in inference mode, yet what it yields is an ordinary tensor (a caller
    may change it in place or feed it to autograd), and between tokens the caller's own code
    runs outside inference mode."""
    m = small_model()
    stream = m.generate_stream(torch.randint(0, 37, (2, 4)), 3, greedy=True)
    for tok in stream:
        assert not tok.is_inference() and not torch.is_inference_mode_enabled()
        tok += 1  # refused for an inference tensor outside inference mode


def test_generate_stream_refuses_bad_arguments_when_made():
    """The CLI prints the prompt before the first token: a bad argument must raise before
    anything is printed, i.e. when the stream is created, not at its first next()."""
    m = small_model()
    prompt = torch.randint(0, 37, (1, 4))
    for bad in (dict(temperature=0.0), dict(top_k=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            m.generate_stream(prompt, 3, **bad)
    with pytest.raises(ValueError, match="at least one token"):
        m.generate_stream(prompt[:, :0], 3)
    assert m.__dict__.get("_stream_hold", [0])[0] == 0  # no stream holds the model


def test_frozen_state_refuses_step():
    m = small_model()
    state = m.init_state(1)
    m.step(torch.zeros(1, 3, dtype=torch.long), state)
    frozen_decoder(m, state)
    with pytest.raises(ValueError, match="frozen"):
        m.step(torch.zeros(1, 1, dtype=torch.long), state)


def test_sampling_reproducible_with_seed():
    m = small_model()
    p = torch.randint(0, 37, (1, 4))
    runs = [m.generate(p, 30, temperature=0.9, top_k=10, top_p=0.9,
                       generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(*runs)


def test_learned_positions_context_limit():
    m = small_model(position="learned", max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len = 16"):
        m.generate(torch.zeros(1, 10, dtype=torch.long), 8)
    assert m.generate(torch.zeros(1, 10, dtype=torch.long), 7).shape == (1, 17)
    with pytest.raises(ValueError, match="shorten it to at most 16 tokens"):
        m.generate(torch.zeros(1, 40, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_rope_runs_past_max_seq_len():
    m = small_model(position="rope", max_seq_len=8)
    assert m(torch.zeros(1, 40, dtype=torch.long))[0].shape == (1, 40, 37)


def test_save_load_round_trip(tmp_path):
    m = small_model(tie_embeddings=True)
    m.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    m2 = LanguageModel.from_pretrained(tmp_path).eval()
    assert m2.lm_head.weight.data_ptr() == m2.tok_emb.weight.data_ptr()  # still tied
    idx = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(m2(idx)[0], m(idx)[0], rtol=0, atol=0)


def test_from_pretrained_puts_the_model_on_map_location(tmp_path):
    """eval and generate load with map_location = --device: every parameter and buffer must end
    up there (the meta device stands in for CUDA on a CPU machine), weights still tied."""
    small_model(tie_embeddings=True).save_pretrained(tmp_path)
    m = LanguageModel.from_pretrained(tmp_path, map_location="meta")
    assert {t.device.type for t in [*m.parameters(), *m.buffers()]} == {"meta"}
    assert m.lm_head.weight is m.tok_emb.weight


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        LanguageModel.from_pretrained(tmp_path)
    small_model().save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        LanguageModel.from_pretrained(tmp_path)


def test_init_scale_and_param_count():
    cfg = small_config(num_layers=3, position="learned")
    m = LanguageModel(cfg)
    proj = m.depth.layers[0].mixer.out_proj.weight
    assert abs(proj.std().item() - 0.02 / (2 * 3) ** 0.5) < 0.004
    C, V, L, F = 32, 37, 3, 128
    per_layer = 2 * C + 3 * C * C + C * C + C * F + F * C
    assert m.num_parameters() == V * C + 64 * C + L * per_layer + C


def test_bitlinear_weights_are_ternary():
    from continuumlm.nn import BitLinear

    lin = BitLinear(16, 8, bias=False)
    w = lin.quantized_weight()
    scale = lin.weight.abs().mean()
    assert set((w / scale).round().unique().tolist()) <= {-1.0, 0.0, 1.0}
    x = torch.randn(4, 16, requires_grad=True)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and x.grad is not None  # straight-through gradients


def test_overfits_tiny_corpus():
    torch.manual_seed(0)
    m = LanguageModel(small_config(vocab_size=11, num_layers=2))
    data = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4)
    x, y = data[:-1][None], data[1:][None]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    assert m.generate(torch.tensor([[3]]), 8, greedy=True).tolist() == [[3, 4, 5, 6, 7, 8, 9, 10, 1]]


def test_weights_of_another_size_are_one_short_error(tmp_path):
    """A config.json edited after saving: one line naming the first mismatched tensor and how
    many more there are, not torch's list of every tensor."""
    import json

    from continuumlm import CheckpointError

    m = small_model()
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] //= 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"size mismatch for .* \(and \d+ more\)") as e:
        LanguageModel.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(), dict(mixer="deltanet", components={"deltanet": {"short_conv": 4}}),
    dict(mixer="continuous"),
    dict(depth="ode"), dict(depth="ode", field="parallel", ode_time_embedding="sinusoidal"),
    dict(position="learned", use_bitnet=True, tie_embeddings=False),
])
def test_memory_check_counts_the_model_it_would_build(kw, monkeypatch):
    """check_memory extrapolates from 1- and 2-layer meta models: the count must equal the
    real model's, and a model over the free memory is refused before anything is built."""
    import continuumlm.model.lm as lm
    from continuumlm import ConfigError
    from continuumlm.model import memory

    cfg = small_config(num_layers=3, **kw)
    real = LanguageModel(cfg)
    assert lm.check_memory(cfg) == real.num_parameters()
    need = 4 * (4 * real.num_parameters() + sum(b.numel() for b in real.buffers()))
    monkeypatch.setattr(memory, "available_memory", lambda device: need)
    lm.check_memory(cfg)  # exactly enough
    monkeypatch.setattr(memory, "available_memory", lambda device: need - 1)
    with pytest.raises(ConfigError, match=f"{real.num_parameters():,} parameters.*GiB available"):
        lm.check_memory(cfg)
    lm.check_memory(cfg, training=False)  # weights alone fit
    monkeypatch.setattr(memory, "available_memory", lambda device: None)
    lm.check_memory(cfg)  # unknown: no refusal


def test_memory_refusal_names_the_buffers_when_they_dominate(monkeypatch):
    """A rotary model with an absurd max_seq_len: the tables, not the weights, are too big,
    and the message must say so (it spoke of weights only)."""
    from continuumlm import ConfigError, ModelConfig
    from continuumlm.model import memory
    from continuumlm.model.lm import check_memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 16 * 2**30)  # any machine

    with pytest.raises(ConfigError, match=r"795,904 parameters and [\d,]+ buffer values .*"
                                          r"max_seq_len\); its weights and buffers"):
        check_memory(ModelConfig(vocab_size=65, max_seq_len=2_000_000_000), training=False)


def test_model_too_large_for_the_machine_is_refused_before_writing(tiny_corpus, tmp_path):
    """A width no machine here holds: exit 2 with the sizes named, no traceback, no folder."""
    import subprocess
    import sys

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "continuumlm", "train", "--out", str(out),
                        "--config", str(Path(__file__).resolve().parents[1] / "configs" /
                                        "shakespeare_char" / "demo.toml"),
                        "--set", f"data.path={tiny_corpus}", "--set", "data.dataset=text",
                        "--set", "model.hidden_size=262144", "--set", "model.num_layers=64"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "hidden_size 262144" in r.stderr and "GiB available" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


@pytest.mark.parametrize("n,context", [(23, 5), (21, 5), (6, 5), (40, 39), (12, 3)])
def test_evaluation_scores_every_target_once(n, context):
    """`eval` scores tokens 1..n-1 each exactly once: non-overlapping windows, then one window
    ending at the last token for the remainder. Reference: one forward per target, from the
    start of the window that scores it."""
    import math

    from continuumlm.eval.perplexity import evaluate_contexts
    from continuumlm.train.trainer import evaluate_loss

    m = small_model(num_layers=1)
    data = torch.randint(0, 37, (n,), generator=torch.Generator().manual_seed(n))
    complete = (n - 1) // context  # windows that fit whole from the start
    nll = []
    for t in range(1, n):
        w = context * ((t - 1) // context)
        if (t - 1) // context >= complete:  # past the last complete window: the tail window
            w = n - 1 - context
        logits, _ = m(data[w:t][None])
        nll.append(-torch.log_softmax(logits[0, -1].double(), -1)[data[t]].item())
    want = sum(nll) / len(nll)
    for batch_tokens in (context, 10 * context):  # one window per batch, or several
        row = evaluate_contexts(m, data, [context], False, torch.device("cpu"), batch_tokens)[0]
        assert row["tokens"] == n - 1
        assert math.isclose(row["loss"], want, rel_tol=1e-5)
    got = evaluate_loss(m, data, context, 2, None, torch.device("cpu"))
    assert math.isclose(got, want, rel_tol=1e-5)


def test_max_windows_is_an_upper_bound():
    """`eval --max-windows N` scores at most N windows: N at or above the non-overlapping
    count took one more (the tail) before."""
    from continuumlm.data import eval_window_starts

    assert eval_window_starts(22, 5).tolist() == [0, 5, 10, 15, 16]  # 4 whole + the tail
    for n in range(1, 7):
        starts = eval_window_starts(22, 5, n).tolist()
        assert len(starts) == min(n, 5) and starts == sorted(set(starts)), (n, starts)


@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_bitnet_cached_decoding_is_exact_up_to_its_activation_rounding(mixer):
    """BitNet rounds every activation to 8 bits per token, so a round-off difference between
    the cached and the full forward can move a value across a rounding boundary: in float32
    the logits then differ by a few 1e-3 (not 1e-4). In float64 the two paths agree to
    round-off, which shows the cache itself is exact."""
    torch.manual_seed(0)
    cfg = dict(use_bitnet=True, mixer=mixer, depth="ode", field="sequential", ode_solver="rk4",
               ode_steps=2)
    prompt = torch.randint(0, 37, (2, 5))
    assert_cached_decoding_exact(small_model(**cfg).double(), prompt, 40, atol=1e-10)
    torch.manual_seed(0)
    assert_cached_decoding_exact(small_model(**cfg), prompt, 40, atol=2e-2)


def test_dynamic_tanh_norm():
    """norm_type = "dyt": gamma * tanh(alpha x) + beta per token, alpha 0.5 at first; a model
    built with it is causal, decodes exactly and trains every DyT parameter."""
    from continuumlm import ModelConfig
    from continuumlm.nn.norm import DynamicTanh
    from continuumlm.testing import check_cached_decoding, check_causal, check_trains

    norm = DynamicTanh(6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(6.0))
        norm.bias.copy_(torch.full((6,), 0.25))
    x = torch.randn(3, 6)
    torch.testing.assert_close(norm(x), torch.tanh(0.5 * x) * torch.arange(6.0) + 0.25)
    for depth in ("discrete", "ode"):
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=37, hidden_size=32, num_heads=4, num_layers=2,
                                      max_seq_len=64, norm_type="dyt", bias=True,
                                      depth=depth)).eval()
        assert any(isinstance(mod, DynamicTanh) for mod in m.modules())
        check_causal(m)
        check_cached_decoding(m, torch.randint(0, 37, (2, 5)), 10)
        check_trains(m)
        alphas = [mod.alpha for mod in m.modules() if isinstance(mod, DynamicTanh)]
        assert all(a.grad is not None and a.item() == 0.5 for a in alphas)


def test_decoding_refuses_what_would_go_wrong_silently():
    """A state built under one solver is refused after set_solver (its per-stage caches would
    be read at other times: logits 0.06 off); top_k that is not a whole number, a negative
    max_new_tokens and an empty step are refused when made, not at the first token."""
    m = small_model(depth="ode", ode_solver="euler", ode_steps=2, num_layers=1)
    prompt = torch.randint(0, 37, (1, 7))
    state = m.init_state(1)
    m.step(prompt, state)
    m.set_solver(ode_steps=4, ode_grad="direct")
    with pytest.raises(ValueError, match="start a new state"):
        m.step(prompt[:, :1], state)
    fresh = m.init_state(1)
    m.step(prompt, fresh)  # a new state under the new solver decodes
    with pytest.raises(ValueError, match="at least one token"):
        m.step(prompt[:, :0], fresh)
    for kw, needle in ((dict(top_k=2.5), "top_k"), (dict(top_k=True), "top_k"),
                       (dict(max_new_tokens=-1), "max_new_tokens")):
        with pytest.raises(ValueError, match=needle):
            m.generate(prompt, **{"max_new_tokens": 3, **kw})


def test_a_compiled_generation_refuses_a_solver_changed_between_tokens():
    """The one-token static steps check the state's solver on the host too (they returned
    logits 3e-3 off after set_solver between yields)."""
    m = small_model(depth="ode", ode_solver="euler", ode_steps=4, num_layers=1)
    state = m.init_state(1)
    m.step(torch.randint(0, 37, (1, 5)), state)
    token = frozen_decoder(m, state)  # the compiled step's host side, eagerly
    token(torch.randint(0, 37, (1, 1)), state)
    m.set_solver(ode_steps=2, ode_grad="direct")
    with pytest.raises(ValueError, match="start a new state"):
        token(torch.randint(0, 37, (1, 1)), state)
