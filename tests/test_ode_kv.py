"""model.ode_kv: the mixers' memory from each evaluation, each solver step's start, or the block's
input. Held to slow references written out by hand, to the relations between the options that
must hold exactly, and to the decoding invariants of continuumlm.testing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from continuumlm.config import ModelConfig
from continuumlm.errors import ConfigError
from continuumlm.mixers.cache import StaticStep, Written
from continuumlm.mixers.delta_rule import delta_rule_recurrent
from continuumlm.mixers.padding import Padding, mix, remember
from continuumlm.registry import MIXERS
from continuumlm.testing import check_cached_decoding, check_causal, small_model

MIXER_CASES = [
    ("softmax", {"position": "rope"}, {}),
    ("softmax", {"position": "learned"}, {}),
    ("deltanet", {}, {}),
    ("deltanet", {}, {"deltanet": {"short_conv": 4}}),
    ("deltanet", {}, {"deltanet": {"activation": "none"}}),
    ("continuous", {}, {}),
    ("continuous", {}, {"continuous": {"quadrature": "composite", "panel": 4}}),
    ("continuous", {}, {"continuous": {"quadrature": "exact"}}),
    ("continuous", {}, {"continuous": {"mode": "bias"}}),
    ("continuous", {}, {"continuous": {"mode": "bias", "kernel": "relative"}}),
]


def _mixer(name, kw, comps, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=11, hidden_size=16, num_heads=2, num_layers=1, max_seq_len=64,
                      mixer=name, **kw, components=comps)
    return MIXERS[name](cfg).double().eval()


def _read(mx, x, m, cache, padding=None):
    remember(mx, m, cache, padding)
    return mix(mx, x, Written(cache), padding)


@pytest.mark.parametrize("name,kw,comps", MIXER_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(MIXER_CASES)])
def test_write_then_read_of_one_input_is_the_mixer(name, kw, comps):
    """With the memory written from the input the queries read (ode_kv = "evaluation"'s
    function), write + read equals the mixer's own forward, eager extension (a prompt, then
    token by token), frozen one-token step and padded batch, to float64 rounding."""
    mx = _mixer(name, kw, comps)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    tol = dict(rtol=0, atol=1e-13)
    torch.testing.assert_close(_read(mx, x, x, mx.cache_factory()), mx(x), **tol)
    eager, mem = mx.cache_factory(), mx.cache_factory()
    a = [mix(mx, x[:, :5], eager, None)]
    b = [_read(mx, x[:, :5], x[:, :5], mem)]
    for t in range(5, 9):
        a.append(mix(mx, x[:, t:t + 1], eager, None))
        b.append(_read(mx, x[:, t:t + 1], x[:, t:t + 1], mem))
    torch.testing.assert_close(torch.cat(b, 1), torch.cat(a, 1), **tol)
    step = StaticStep(16, 9, x.device)
    fa, fb = eager.freeze(step) or eager, mem.freeze(step) or mem
    y = torch.randn(2, 1, 16, dtype=torch.float64)
    torch.testing.assert_close(_read(mx, y, y, fb), mix(mx, y, fa, None), **tol)
    keys = torch.ones(2, 9, dtype=torch.bool)
    keys[0, :3] = False  # row 0 left-padded
    pad = Padding.from_mask(keys, 9)
    got = _read(mx, x, x, mx.cache_factory(), pad)
    torch.testing.assert_close(got[keys], mix(mx, x, None, pad)[keys], **tol)


def _heads(t, H):
    B, T, C = t.shape
    return t.view(B, T, H, C // H).transpose(1, 2)


def test_softmax_memory_reference():
    """Queries from x, keys and values from m, causal softmax: written out by hand."""
    mx = _mixer("softmax", {"position": "learned"}, {})
    x, m = torch.randn(2, 2, 7, 16, dtype=torch.float64).unbind(0)
    W, b = mx.qkv.weight, mx.qkv.bias
    proj = [F.linear(t, W[i * 16:(i + 1) * 16], None if b is None else b[i * 16:(i + 1) * 16])
            for i, t in enumerate((x, m, m))]
    q, k, v = (_heads(p, 2) for p in proj)
    s = (q @ k.mT) / 8 ** 0.5
    s = s.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    y = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 16)
    want = mx.out_proj(y)
    torch.testing.assert_close(_read(mx, x, m, mx.cache_factory()), want, rtol=0, atol=1e-13)


@pytest.mark.parametrize("conv", [0, 3])
def test_deltanet_memory_reference(conv):
    """DeltaNet with queries and gate from x, keys, values and write strengths from m: the
    reference recurrence; with the short convolution, q's taps on earlier tokens read m's q
    projections and its tap on the token itself x's."""
    mx = _mixer("deltanet", {}, {"deltanet": {"short_conv": conv}})
    x, m = torch.randn(2, 2, 7, 16, dtype=torch.float64).unbind(0)
    qx, qm, k, v = mx.q_proj(x), mx.q_proj(m), mx.k_proj(m), mx.v_proj(m)
    if conv:
        def causal_conv(inp, w):  # (B, T, C), (C, K): y[t] = sum_j w[:, j] inp[t - K + 1 + j]
            padded = F.pad(inp, (0, 0, conv - 1, 0))
            return sum(padded[:, j:j + 7] * w[:, j] for j in range(conv))
        wq = mx.convs["q"].weight[:, 0]
        q = causal_conv(qm, wq) - qm * wq[:, -1] + qx * wq[:, -1]
        k = causal_conv(k, mx.convs["k"].weight[:, 0])
        v = causal_conv(v, mx.convs["v"].weight[:, 0])
    else:
        q = qx
    q, k, v = F.silu(q), F.silu(k), F.silu(v)
    q, k, v = F.normalize(_heads(q, 2), dim=-1), F.normalize(_heads(k, 2), dim=-1), _heads(v, 2)
    beta = torch.sigmoid(mx.beta_proj(m)).transpose(1, 2)
    o, _ = delta_rule_recurrent(q, k, v, beta)
    o = mx.norm(o).transpose(1, 2).reshape(2, 7, 16) * F.silu(mx.g_proj(x))
    torch.testing.assert_close(_read(mx, x, m, mx.cache_factory()), mx.o_proj(o),
                               rtol=0, atol=1e-12)


def test_continuous_kernel_reads_only_memory():
    """CAT's kernel mode has positional queries: its output is a mix of the memory's values
    alone, whatever x is (the mixer run on m)."""
    mx = _mixer("continuous", {}, {})
    x, m = torch.randn(2, 2, 9, 16, dtype=torch.float64).unbind(0)
    torch.testing.assert_close(_read(mx, x, m, mx.cache_factory()), mx(m), rtol=0, atol=1e-13)


@pytest.mark.parametrize("kernel", ["absolute", "relative"])
def test_continuous_bias_write_and_read_project_their_half_alone(kernel, monkeypatch):
    """CAT's bias mode projects content queries and keys with one fused projection: a write
    computes the keys' rows of it alone, a read the queries' rows alone (never the whole
    projection), and the result is the write + read of the whole projection's halves."""
    from continuumlm.mixers import continuous

    mx = _mixer("continuous", {}, {"continuous": {"mode": "bias", "kernel": kernel}})
    x, m = torch.randn(2, 2, 9, 16, dtype=torch.float64).unbind(0)
    want = _read(mx, x, m, mx.cache_factory())
    rows, real = [], continuous.linear_rows
    monkeypatch.setattr(continuous, "linear_rows",
                        lambda lin, t, a, b: rows.append((a, b)) or real(lin, t, a, b))
    monkeypatch.setattr(mx.qk, "forward",
                        lambda t: pytest.fail("the whole q/k projection was computed"))
    cache = mx.cache_factory()
    remember(mx, m, cache, None)
    assert rows == [(16, 32)]  # the keys' rows
    got = mix(mx, x, Written(cache), None)
    assert rows == [(16, 32), (0, 16)]  # then the queries'
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def _block(kv, solver="rk4", steps=2, mixer="softmax", seed=0, **kw):
    model = small_model(seed, depth="ode", field="sequential", num_layers=1, mixer=mixer,
                        ode_solver=solver, ode_steps=steps, ode_kv=kv, position="learned", **kw)
    return model.double().depth.blocks[0]


def _reference_block(block, x, kv):
    """RK4 by hand, the sequential field with softmax attention written out: queries from every
    stage's state, keys and values from the step's (or the block's) starting state."""
    field, mx = block.field, block.field.mixer
    W, C = mx.qkv.weight, x.shape[-1]
    T = x.shape[1]

    def attn(xq, xm):
        q, k, v = (_heads(F.linear(t, W[i * C:(i + 1) * C]), 4)
                   for i, t in enumerate((xq, xm, xm)))
        s = (q @ k.mT) / (C // 4) ** 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return mx.out_proj((s.softmax(-1) @ v).transpose(1, 2).reshape(x.shape))

    def f(h, mem):
        a = attn(field.norm1(h), mem)
        return a + field.mlp(field.norm2(h + a))

    h, steps = x, block.cfg.ode_steps
    dt = 1.0 / steps
    block_memory = field.norm1(x)
    for _ in range(steps):
        mem = field.norm1(h) if kv == "step" else block_memory
        k1 = f(h, mem)
        k2 = f(h + dt / 2 * k1, mem)
        k3 = f(h + dt / 2 * k2, mem)
        k4 = f(h + dt * k3, mem)
        h = h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return h


@pytest.mark.parametrize("kv", ["step", "block"])
def test_ode_block_against_rk4_by_hand(kv):
    block = _block(kv, steps=3)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(block(x), _reference_block(block, x, kv), rtol=0, atol=1e-12)


def test_relations_between_the_options():
    """Euler evaluates once per step, at its start: "step" is "evaluation" exactly. One step:
    "block" is "step". RK4's later stages read an older memory: the options differ."""
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        out = {(kv, s, n): _block(kv, s, n)(x) for kv in ("evaluation", "step", "block")
               for s, n in (("euler", 3), ("rk4", 1), ("rk4", 2))}
    torch.testing.assert_close(out["step", "euler", 3], out["evaluation", "euler", 3],
                               rtol=0, atol=1e-13)
    torch.testing.assert_close(out["block", "rk4", 1], out["step", "rk4", 1], rtol=0, atol=1e-13)
    for a, b in ((("evaluation", "rk4", 2), ("step", "rk4", 2)),
                 (("step", "rk4", 2), ("block", "rk4", 2))):
        assert (out[a] - out[b]).abs().max() > 1e-7, f"{a} and {b} give the same output"


@pytest.mark.parametrize("tokens", [6, 1])
@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
@pytest.mark.parametrize("grad", ["checkpoint", "binomial"])
@pytest.mark.parametrize("kv", ["step", "block"])
def test_recomputing_gradient_modes_equal_direct(kv, grad, mixer, tokens):
    """A step recomputed in the backward pass writes its memory again from the same state, or
    reads the block's the same way its forward did (one token too, where DeltaNet reads the
    state after it): the gradients of checkpoint and binomial equal direct backpropagation's."""
    if kv == "block" and grad == "binomial":
        with pytest.raises(ConfigError, match="binomial"):
            _block(kv, ode_grad=grad)
        return
    comps = {"components": {"deltanet": {"short_conv": 3}}} if mixer == "deltanet" else {}
    grads = {}
    for mode in ("direct", grad):
        block = _block(kv, steps=3, ode_grad=mode, mixer=mixer, **comps).train()
        x = torch.randn(2, tokens, 32, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(1), requires_grad=True)
        block(x).pow(2).sum().backward()
        grads[mode] = [x.grad] + [p.grad for p in block.parameters()]
    for a, b in zip(grads["direct"], grads[grad]):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "deltanet-conv", "continuous"])
@pytest.mark.parametrize("kv", ["step", "block"])
def test_cached_decoding_is_recompute_in_float64(mixer, kv):
    comps = {"components": {"deltanet": {"short_conv": 4}}} if mixer == "deltanet-conv" else {}
    model = small_model(depth="ode", mixer=mixer.split("-")[0], ode_solver="rk4", ode_steps=3,
                        ode_kv=kv, **comps)
    model = model.double()
    check_causal(model, atol=1e-12)
    check_cached_decoding(model, torch.randint(0, 37, (2, 5)), 8, atol=1e-10)


def test_cache_memory_does_not_grow_with_the_solve():
    """4 blocks of RK4 x 4: 64 caches per evaluation, 16 per step, 4 per block; "block" holds
    what the discrete 4-layer model holds."""
    seen = {}
    for kv in ("evaluation", "step", "block"):
        model = small_model(depth="ode", num_layers=4, ode_solver="rk4", ode_steps=4, ode_kv=kv)
        seen[kv] = model.cache_memory()
    discrete = small_model(depth="discrete", num_layers=4).cache_memory()
    assert [seen[k].caches for k in ("evaluation", "step", "block")] == [64, 16, 4]
    per_eval = 2 * 32 * 4  # keys and values, 32 wide, float32
    assert seen["evaluation"].per_token == 64 * per_eval
    assert seen["step"].per_token == 16 * per_eval
    assert seen["block"].per_token == discrete.per_token == 4 * per_eval
    dn = {kv: small_model(depth="ode", mixer="deltanet", num_layers=2, ode_solver="rk4",
                          ode_steps=2, ode_kv=kv).cache_memory() for kv in ("evaluation", "block")}
    assert dn["evaluation"].per_token == dn["block"].per_token == 0
    assert dn["evaluation"].fixed == 8 * dn["block"].fixed > 0


@pytest.mark.parametrize("conv", [0, 4])
@pytest.mark.parametrize("kv", ["step", "block"])
def test_deltanet_memory_lets_go_of_the_prompt(kv, conv):
    """A DeltaNet memory cache holds its state (and convolution history) alone once a solve
    has read it: after a 20-token prompt no cache keeps the prompt's keys, values and write
    strengths, and the tokens decoded next are the full forward's."""
    from continuumlm.mixers.deltanet_cache import DeltaNetCache

    model = small_model(depth="ode", mixer="deltanet", num_layers=2, ode_solver="rk4",
                        ode_steps=2, ode_kv=kv,
                        components={"deltanet": {"short_conv": conv}}).double().eval()
    idx = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)[0]
        state = model.init_state(2)
        model.step(idx[:, :20], state)
        caches = [c for c in state._caches.values() if isinstance(c, DeltaNetCache)]
        assert len(caches) == 2 * (2 if kv == "step" else 1)
        assert all(c.memory is None and c.state is not None for c in caches)
        cached = torch.stack([model.step(idx[:, t:t + 1], state)[0] for t in range(20, 24)], 1)
        assert all(c.memory is None for c in caches)
    torch.testing.assert_close(cached, full[:, 20:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("kw,match", [
    (dict(ode_grad="adjoint"), "adjoint"),
    (dict(ode_solver="reversible_heun", ode_grad="reversible"), "reversible"),
    (dict(ode_solver="tsit5", ode_kv="step"), "adaptive"),
    (dict(ode_solver="tsit5", ode_grad="checkpoint"), "direct"),
    (dict(depth="discrete"), "depth"),
    (dict(mode="encoder", mixer="deltanet"), "decoder"),
    (dict(ode_kv="stage"), "one of evaluation, step, block"),
])
def test_refused_by_name(kw, match):
    kw = {"depth": "ode", "ode_kv": "block", **kw}
    with pytest.raises(ConfigError, match=match):
        small_model(**kw)


def test_adaptive_block_memory_trains_and_runs():
    """An adaptive solve with the block's memory: a function other than the per-evaluation one
    with the same weights, which trains (finite gradients on every parameter)."""
    from continuumlm.testing import check_trains

    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(0))
    losses = {}
    for kv in ("evaluation", "block"):
        model = small_model(depth="ode", ode_solver="tsit5", ode_kv=kv).double()
        with torch.no_grad():
            losses[kv] = model(idx, idx)[1].item()
    assert abs(losses["evaluation"] - losses["block"]) > 1e-9
    check_trains(small_model(depth="ode", ode_solver="tsit5", ode_kv="block"))


@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
@pytest.mark.parametrize("kv", ["step", "block"])
def test_per_token_exit_with_memory(kv, mixer):
    """Per-token exit with the memory of a step or block: a frozen token's later steps write
    their memory from its frozen state and nothing else; causal, and cached decoding equal to
    recompute at the same threshold (float64, some tokens stopping early, others not)."""
    from test_exit import V, ode_model, partial_threshold

    m = ode_model(mixer=mixer, ode_kv=kv)
    partial_threshold(m, "state", torch.randint(0, V, (2, 24)))
    check_causal(m, atol=1e-10)
    check_cached_decoding(m, torch.randint(0, V, (2, 5)), 12, atol=1e-9)
    m.set_exit(float("inf"))  # every token stops after its first step
    prompt = torch.randint(0, V, (1, 6))
    ref = m.generate(prompt, 5, greedy=True, use_cache=False)
    assert torch.equal(m.generate(prompt, 5, greedy=True), ref)


def test_a_mixer_without_write_and_read_is_refused():
    """A plugin mixer that only extends its cache cannot take its memory from elsewhere: the
    refusal names it and the two methods."""
    from continuumlm.mixers.padding import takes_memory
    from continuumlm.model.ode_kv import kv_refusal

    class Plain(torch.nn.Module):
        def forward(self, x, cache=None):
            return x

    assert not takes_memory(Plain) and takes_memory(MIXERS.component_class("softmax"))
    why = kv_refusal("step", "plain", "rk4", "direct", False, False, takes_memory(Plain))
    assert "'plain'" in why and "write(m, cache)" in why and "ode_kv = 'evaluation'" in why
    assert kv_refusal("evaluation", "plain", "rk4", "direct", False, False, False) is None
    with pytest.raises(ValueError, match="write.*read"):
        mix(Plain(), torch.zeros(1, 1, 4), Written(object()), None)


def test_train_eval_and_generate_with_block_memory(tiny_corpus, tmp_path):
    """A user's path: train with model.ode_kv = "block", then eval and generate report the
    decoding cache (one cache per block: a discrete layer's)."""
    import json

    from conftest import run_cli
    from continuumlm.config import load_config
    from continuumlm.train import Trainer

    cfg = load_config(None, ["data.dataset=text", f'data.path="{tiny_corpus}"',
                             "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
                             "model.depth=ode", "model.ode_steps=2", "model.ode_kv=block",
                             "train.batch_size=2", "train.seq_len=16", "train.max_steps=2",
                             "train.eval_interval=2", "train.eval_iters=1", "train.device=cpu"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    r = run_cli("eval", "--checkpoint", tmp_path / "run", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ode_kv"] == "block" and out["cache"]["caches"] == 1
    assert out["cache"]["bytes_per_token"] == 2 * 32 * 4
    r = run_cli("generate", "--checkpoint", tmp_path / "run", "--prompt", "the cat",
                "--max-new-tokens", "5", "--greedy")
    assert r.returncode == 0, r.stderr
    assert "decoding cache: 256 bytes per token (256 per token per block) in 1 cache" in r.stderr
    r = run_cli("train", "--config", tmp_path / "run" / "config.toml", "--out", tmp_path / "x",
                "--set", "model.ode_kv=blocks")
    assert r.returncode == 2 and "model.ode_kv must be one of" in r.stderr


def test_cache_memory_text():
    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2, ode_kv="block")
    memory = model.cache_memory()
    assert "512 bytes per token (256 per token per block) in 2 caches" in memory.describe(2)
    assert memory.at(1024) == 512 * 1024


def test_hugging_face_round_trip_and_assistant(tmp_path):
    """The adapter saves and loads ode_kv; cached generate equals uncached, and the coarse
    solve as an assistant gives plain greedy's tokens."""
    import dataclasses

    pytest.importorskip("transformers")
    from continuumlm.hf import ContinuumLMConfig, ContinuumLMForCausalLM

    m = small_model(depth="ode", mixer="deltanet", ode_solver="rk4", ode_steps=2, ode_kv="block")
    cfg = ContinuumLMConfig(**{f.name: getattr(m.config, f.name)
                               for f in dataclasses.fields(m.config) if f.name != "plugins"})
    ContinuumLMForCausalLM(cfg, model=m).save_pretrained(tmp_path)
    hf = ContinuumLMForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.ode_kv == "block"
    ids = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    plain = hf.generate(ids, use_cache=True, **kw)
    assert torch.equal(plain, hf.generate(ids, use_cache=False, **kw))
    assert torch.equal(plain, hf.generate(ids, assistant_model=hf.as_draft("euler", 1), **kw))


@pytest.mark.slow  # compiles four models: about 40 s
@pytest.mark.parametrize("kv", ["step", "block"])
@pytest.mark.parametrize("mixer", ["softmax", "deltanet"])
def test_compiled_decoding_with_memory(mixer, kv):
    """generate(compile=True): each solver step a compiled unit that writes the step's memory
    and runs its stages; the tokens equal eager decoding's and nothing was refused."""
    from continuumlm import Decoder

    model = small_model(depth="ode", mixer=mixer, ode_solver="rk4", ode_steps=2, ode_kv=kv)
    prompt = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(0))
    eager = model.generate(prompt, 12, greedy=True)
    decoder = Decoder(model, compile=True)
    assert torch.equal(decoder.generate(prompt, 12, greedy=True), eager)
    assert decoder.compile_refused is None


@pytest.mark.parametrize("kv", ["step", "block"])
def test_self_speculative_greedy_is_plain_greedy(kv):
    """A coarse solve drafts (its own step or block memory), the model's solve verifies k
    tokens in one pass and the caches are cut back: the tokens are plain greedy decoding's."""
    from continuumlm import Draft

    for mixer in ("softmax", "deltanet", "continuous"):
        m = small_model(depth="ode", mixer=mixer, ode_solver="rk4", ode_steps=2, ode_kv=kv)
        p = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(1))
        plain = m.generate(p, 16, greedy=True)
        draft = Draft(solver="euler", steps=1, tokens=4)
        assert torch.equal(m.generate(p, 16, greedy=True, draft=draft), plain), mixer


@pytest.mark.parametrize("kv", ["step", "block"])
def test_deltanet_state_stays_float32_under_bf16_autocast(kv):
    """Under bf16 autocast a decoded token's state update and read run in float32 (autocast
    off, as the kernels' token path): cached decoding gives the full forward's logits (here
    exactly, as with per-evaluation memory; with the products in bf16 they moved by 2e-3 to
    4e-3 on this small model, by 0.25 on a larger one)."""
    model = small_model(depth="ode", mixer="deltanet", num_layers=1, ode_solver="rk4",
                        ode_steps=2, ode_kv=kv)
    idx = torch.randint(0, 37, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(idx)[0].float()
        state = model.init_state(1)
        model.step(idx[:, :4], state)
        cached = torch.stack([model.step(idx[:, t:t + 1], state)[0].float()
                              for t in range(4, 12)], 1)
    assert (cached - full[:, 4:]).abs().max() < 1e-3
