import pytest
import torch
import torch.nn.functional as F

from continuumlm.mixers import delta_rule_chunkwise, delta_rule_recurrent


def _inputs(B=2, H=3, T=37, Dk=8, Dv=6, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    init = torch.randn(B, H, Dv, Dk, generator=g, dtype=dtype) * 0.3
    if grad:
        for x in (q, k, v, beta, init):
            x.requires_grad_(True)
    return q, k, v, beta, init


def test_one_token_step_is_the_recurrent_rule_at_one_token():
    """The decoding step (batched products) against the reference token loop, on sizes where
    Dk != Dv and nothing is a power of two; gradients too (it also serves T = 1 in training)."""
    from continuumlm.mixers.deltanet import delta_rule_step

    q, k, v, beta, init = _inputs(B=3, H=2, T=1, Dk=5, Dv=7, dtype=torch.float64, grad=True)
    o_ref, S_ref = delta_rule_recurrent(q, k, v, beta, init)
    o, S = delta_rule_step(q, k, v, beta, init)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S, S_ref, rtol=1e-12, atol=1e-12)
    ref = torch.autograd.grad((o_ref.sum() + S_ref.square().sum()), (q, k, v, beta, init))
    got = torch.autograd.grad((o.sum() + S.square().sum()), (q, k, v, beta, init))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_decoded_tokens_take_one_stacked_projection_and_equal_the_separate_ones():
    """Decoding (autograd off) computes q, k, v, the gate and beta in one product; the layer's
    output equals the one with each projection called as itself, one token at a time, with and
    without the short convolution and with biases; with autograd on, each projection gets its
    gradient."""
    from continuumlm import ModelConfig
    from continuumlm.mixers import DeltaNetAttention
    from continuumlm.mixers.deltanet import DeltaNetCache

    for own, bias in (({"short_conv": 0}, False), ({"short_conv": 3, "beta_bias": True}, True)):
        torch.manual_seed(0)
        cfg = ModelConfig.from_dict(dict(vocab_size=10, hidden_size=24, num_heads=3,
                                         num_layers=1, mixer="deltanet", bias=bias,
                                         deltanet=own))
        att = DeltaNetAttention(cfg).double().eval()
        x = torch.randn(2, 9, 24, dtype=torch.float64)
        calls: list[int] = []
        with torch.no_grad():
            cache = DeltaNetCache()
            stacked = torch.cat([att(x[:, :3], cache)]
                                + [att(x[:, t:t + 1], cache) for t in range(3, 9)], 1)
            assert att in cache.shared
            # a hook makes each projection run as itself
            handle = att.g_proj.register_forward_hook(lambda *a, seen=calls: seen.append(1))
            cache = DeltaNetCache()
            separate = torch.cat([att(x[:, :3], cache)]
                                 + [att(x[:, t:t + 1], cache) for t in range(3, 9)], 1)
            handle.remove()
        assert len(calls) == 7
        torch.testing.assert_close(stacked, separate, rtol=1e-12, atol=1e-12)
        att(x[:, :1], DeltaNetCache()).sum().backward()
        assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0
                   for m in (att.q_proj, att.k_proj, att.v_proj, att.g_proj, att.beta_proj))


def test_recurrent_is_the_matrix_delta_rule():
    """Against the textbook form with an explicit identity matrix, one token at a time."""
    q, k, v, beta, init = _inputs(T=5, dtype=torch.float64)
    o, S_final = delta_rule_recurrent(q, k, v, beta, init)
    S = init.clone()
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    for t in range(5):
        kt, vt, bt = k[:, :, t, :, None], v[:, :, t, :, None], beta[:, :, t, None, None]
        S = S @ (eye - bt * kt @ kt.transpose(-1, -2)) + bt * vt @ kt.transpose(-1, -2)
        torch.testing.assert_close(o[:, :, t], (S @ q[:, :, t, :, None])[..., 0])
    torch.testing.assert_close(S_final, S)


def test_delta_rule_overwrites_an_association():
    """Writing (k, v2) with beta = 1 after (k, v1) replaces v1: perfect recall of the last value,
    which an elementwise or additive update cannot do."""
    k = torch.zeros(1, 1, 2, 4)
    k[..., 0] = 1.0
    v = torch.tensor([[[[1.0, 2.0], [5.0, -1.0]]]])
    q = k.clone()
    o, _ = delta_rule_recurrent(q, k, v, torch.ones(1, 1, 2))
    torch.testing.assert_close(o[0, 0, 1], torch.tensor([5.0, -1.0]))


@pytest.mark.parametrize("T", [1, 15, 16, 17, 33, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunkwise_equals_recurrent(T, with_state):
    q, k, v, beta, init = _inputs(T=T)
    init = init if with_state else None
    o_r, S_r = delta_rule_recurrent(q, k, v, beta, init)
    o_c, S_c = delta_rule_chunkwise(q, k, v, beta, chunk_size=16, initial_state=init)
    torch.testing.assert_close(o_c, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_c, S_r, rtol=1e-5, atol=1e-5)


def test_chunkwise_float64_exact():
    q, k, v, beta, init = _inputs(T=45, dtype=torch.float64)
    o_r, S_r = delta_rule_recurrent(q, k, v, beta, init)
    o_c, S_c = delta_rule_chunkwise(q, k, v, beta, chunk_size=8, initial_state=init)
    torch.testing.assert_close(o_c, o_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(S_c, S_r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T", [13, 32])
def test_chunkwise_gradients_equal_recurrent(T):
    grads = []
    for kernel in ("r", "c"):
        q, k, v, beta, init = _inputs(T=T, grad=True)
        if kernel == "r":
            o, S = delta_rule_recurrent(q, k, v, beta, init)
        else:
            o, S = delta_rule_chunkwise(q, k, v, beta, chunk_size=8, initial_state=init)
        w = torch.linspace(-1, 1, o.numel()).view_as(o)
        ((o * w).sum() + (S ** 2).sum()).backward()
        grads.append([x.grad for x in (q, k, v, beta, init)])
    for g_r, g_c in zip(*grads):
        torch.testing.assert_close(g_c, g_r, rtol=1e-5, atol=1e-5)


def test_split_sequence_carries_state():
    """Running two halves with the state carried equals one pass (what decoding relies on)."""
    q, k, v, beta, _ = _inputs(T=40)
    o_full, S_full = delta_rule_chunkwise(q, k, v, beta, chunk_size=16)
    o1, S1 = delta_rule_chunkwise(q[:, :, :23], k[:, :, :23], v[:, :, :23], beta[:, :, :23], 16)
    o2, S2 = delta_rule_recurrent(q[:, :, 23:], k[:, :, 23:], v[:, :, 23:], beta[:, :, 23:], S1)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S2, S_full, rtol=1e-5, atol=1e-5)


def _cuda_case():
    g = torch.Generator().manual_seed(0)
    # heads and head size of bench/gpu_bench.py's kernel rows (8 x 64): fla's Triton kernels,
    # autotuned there at that head size, are not tuned afresh inside the test's time limit
    B, H, T, D = 1, 8, 100, 64
    q, k = (F.normalize(torch.randn(B, H, T, D, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, D, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    S0 = torch.randn(B, H, D, D, generator=g) * 0.1
    ref_o, ref_S = delta_rule_chunkwise(q, k, v, beta, initial_state=S0)
    return [x.cuda() for x in (q, k, v, beta, S0)], ref_o, ref_S


@pytest.mark.cuda
def test_chunkwise_on_cuda_matches_cpu():
    cuda, ref_o, ref_S = _cuda_case()
    o, S = delta_rule_chunkwise(*cuda[:4], initial_state=cuda[4], backend="torch")
    torch.testing.assert_close(o.cpu(), ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(S.cpu(), ref_S, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.fla  # fla's first call autotunes for over a minute: run apart, after the rest
def test_fla_kernel_on_cuda_matches_cpu():
    from continuumlm.mixers.deltanet import fla_available, fla_status

    if not fla_available():
        pytest.skip(f"fla is not usable here: {fla_status()[1]}")
    cuda, ref_o, ref_S = _cuda_case()
    half = [x.bfloat16() for x in cuda[:4]]  # fla's kernel is half precision only
    o, S = delta_rule_chunkwise(*half, initial_state=cuda[4], backend="fla")
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    torch.testing.assert_close(o.float().cpu(), ref_o, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(S.float().cpu(), ref_S, rtol=5e-2, atol=5e-2)
    o, _ = delta_rule_chunkwise(*half, initial_state=cuda[4])  # auto picks fla for bf16
    torch.testing.assert_close(o.float().cpu(), ref_o, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("use", ["output", "state", "both"])
def test_chunkwise_backward_passes_gradcheck(use):
    """The hand-written backward against finite differences (float64), on a length that is not
    a multiple of the chunk, with an initial state, and with either output alone."""
    q, k, v, beta, init = _inputs(B=1, H=2, T=11, Dk=4, Dv=3, dtype=torch.float64, grad=True)

    def f(q, k, v, beta, init):
        o, S = delta_rule_chunkwise(q, k, v, beta, chunk_size=4, initial_state=init)
        return {"output": (o,), "state": (S,), "both": (o, S)}[use]

    assert torch.autograd.gradcheck(f, (q, k, v, beta, init))


def test_chunkwise_half_precision_accumulates_in_float32():
    q, k, v, beta, init = _inputs(T=40)
    o32, S32 = delta_rule_chunkwise(q, k, v, beta, chunk_size=16, initial_state=init)
    lo = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v, beta, init)]
    o, S = delta_rule_chunkwise(*lo[:4], chunk_size=16, initial_state=lo[4])
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32  # the state: an accumulator
    torch.testing.assert_close(o.float(), o32, rtol=0.05, atol=0.05)
    torch.testing.assert_close(S.float(), S32, rtol=0.05, atol=0.05)
    (o.float().sum() + S.float().sum()).backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in lo)


def _fake_fla(monkeypatch, version="0.6.0"):
    """A stand-in ``fla`` package whose ``fla.ops.delta_rule.chunk_delta_rule`` has the signature
    and the guards of fla 0.5/0.6's (fla/ops/delta_rule/chunk.py): (B, T, H, D) tensors of one
    dtype, float32 refused by an assert, beta (B, T, H), ``head_first`` refused by raising
    DeprecationWarning, chunk_size 16/32/64, q scaled by ``scale`` (default Dk^-1/2), state
    (B, H, Dk, Dv) with o_t = scale * h_t^T q_t, float32. The kernel is a token loop, so the
    adapter's layouts, transposes and dtypes are checked on CPU."""
    import sys
    import types

    from continuumlm.mixers import delta_rule

    calls = []

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None,
                         output_final_state=False, use_qk_l2norm_in_kernel=False,
                         cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        assert q.dtype == k.dtype == v.dtype
        assert q.dtype != torch.float32, "ChunkDeltaRuleFunction does not support float32."
        assert len(beta.shape) == 3, "beta must be of shape (batch size, num of head, seq len)."
        if "head_first" in kwargs:
            raise DeprecationWarning("head_first has been removed. Inputs must be in "
                                     "`[B, T, H, ...]` format.")
        if kwargs.pop("chunk_size", 64) not in (16, 32, 64):
            raise ValueError("`chunk_size` must be 16, 32, or 64.")
        assert beta.shape == q.shape[:3] and cu_seqlens is None and not use_qk_l2norm_in_kernel
        calls.append(q.dtype)
        B, T, H, K = q.shape
        scale = K ** -0.5 if scale is None else scale
        h = torch.zeros(B, H, K, v.shape[-1])
        if initial_state is not None:
            h = h + initial_state.float()
        o = []
        for t in range(T):
            kt, qt = k[:, t].float(), q[:, t].float()
            u = beta[:, t].float()[..., None] * (v[:, t].float()
                                                 - torch.einsum("bhkv,bhk->bhv", h, kt))
            h = h + kt[..., :, None] * u[..., None, :]
            o.append(scale * torch.einsum("bhkv,bhk->bhv", h, qt))
        return torch.stack(o, 1).to(q.dtype), (h if output_final_state else None)

    root = types.ModuleType("fla")
    root.__version__ = version
    mod = types.ModuleType("fla.ops.delta_rule")
    mod.chunk_delta_rule = chunk_delta_rule
    for name, m in (("fla", root), ("fla.ops", types.ModuleType("fla.ops")),
                    ("fla.ops.delta_rule", mod)):
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.setattr(delta_rule, "_FLA_PROBE", None)  # probe the fake, and again after the test
    return calls


def test_fla_adapter_layouts_against_the_token_loop(monkeypatch):
    calls = _fake_fla(monkeypatch)
    q, k, v, beta, init = _inputs(T=21, Dk=5, Dv=3)
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    ref_o, ref_S = delta_rule_recurrent(*(x.float() for x in (q, k, v, beta)), init)
    o, S = delta_rule_chunkwise(q, k, v, beta, initial_state=init, backend="fla")
    assert calls == [torch.bfloat16]
    assert o.shape == ref_o.shape and S.shape == ref_S.shape
    assert o.dtype == q.dtype and S.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(S.float(), ref_S, rtol=2e-2, atol=2e-2)
    # mixed precision: q and k in float32 after their norm, v in bf16: all go to bf16
    o2, _ = delta_rule_chunkwise(q.float(), k.float(), v, beta, initial_state=init,
                                 backend="fla")
    torch.testing.assert_close(o2, o)


def test_fla_through_a_bf16_model_forward_and_backward(monkeypatch):
    """What training in train.dtype = "auto" (bf16 on CUDA) runs: a DeltaNet layer under bf16
    autocast with the kernel choice forced to fla (auto picks it only for CUDA tensors)."""
    from continuumlm import ModelConfig
    from continuumlm.mixers import DeltaNetAttention, deltanet

    calls = _fake_fla(monkeypatch)
    real = deltanet.delta_rule_chunkwise
    monkeypatch.setattr(deltanet, "delta_rule_chunkwise",
                        lambda *a, **kw: real(*a, **{**kw, "backend": "fla"}))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, hidden_size=32, num_heads=2, num_layers=1, mixer="deltanet")
    att = DeltaNetAttention(cfg)
    x = torch.randn(2, 9, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = att(x)
    y.float().sum().backward()
    assert calls and all(c == torch.bfloat16 for c in calls)
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("version, why", [("0.1.2", "too old"), (None, "does not say")])
def test_fla_releases_with_another_layout_are_refused(monkeypatch, version, why):
    from continuumlm.mixers.deltanet import fla_available

    calls = _fake_fla(monkeypatch, version=version or "0.6.0")
    if version is None:
        import sys
        del sys.modules["fla"].__version__
    q, k, v, beta, _ = _inputs(T=9)
    assert not fla_available()
    with pytest.raises(ValueError, match=why):
        delta_rule_chunkwise(*(x.bfloat16() for x in (q, k, v, beta)), backend="fla")
    assert calls == []


def test_fla_is_probed_once(monkeypatch):
    import builtins

    from continuumlm.mixers.deltanet import fla_available

    _fake_fla(monkeypatch)
    imports = []
    real_import = builtins.__import__

    def counting(name, *a, **kw):
        if name.startswith("fla"):
            imports.append(name)
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", counting)
    assert all(fla_available() for _ in range(5))
    assert len(imports) == 2  # fla and fla.ops.delta_rule, once


def test_fla_backend_choice_and_refusals(monkeypatch):
    import sys

    from continuumlm.mixers import delta_rule

    calls = _fake_fla(monkeypatch)
    q, k, v, beta, init = _inputs(T=9)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        delta_rule_chunkwise(q, k, v, beta, backend="fla")  # float32: never silently rounded
    with pytest.raises(ValueError, match="'auto', 'torch' or 'fla'"):
        delta_rule_chunkwise(q, k, v, beta, backend="cuda")
    delta_rule_chunkwise(*(x.bfloat16() for x in (q, k, v, beta)))  # auto on CPU: torch path
    assert calls == []
    monkeypatch.setitem(sys.modules, "fla", None)  # not installed
    monkeypatch.setattr(delta_rule, "_FLA_PROBE", None)
    with pytest.raises(ValueError, match="not importable"):
        delta_rule_chunkwise(*(x.bfloat16() for x in (q, k, v, beta)), backend="fla")


def test_bf16_decoding_state_accumulates_in_float32():
    """A bf16 model's DeltaNet decoding state is carried from token to token: kept in bf16 it
    lost precision at every step (cached outputs 0.012 from float64 against 0.007 for the full
    forward). It stays float32, and cached steps are as accurate as the full forward."""
    from continuumlm import ModelConfig
    from continuumlm.mixers import DeltaNetAttention
    from continuumlm.mixers.deltanet import DeltaNetCache

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, hidden_size=32, num_heads=2, num_layers=1, mixer="deltanet")
    att = DeltaNetAttention(cfg).eval()
    x = torch.randn(1, 300, 32)
    with torch.no_grad():
        ref = att.double()(x.double())
        att.to(torch.bfloat16)
        xb = x.bfloat16()
        full = att(xb).double()
        cache = DeltaNetCache()
        steps = [att(xb[:, :4], cache)] + [att(xb[:, t:t + 1], cache) for t in range(4, 300)]
        cached = torch.cat(steps, 1).double()
    assert cache.state.dtype == torch.float32
    tail = slice(200, 300)
    err = lambda y: ((y[:, tail] - ref[:, tail]).abs().mean() / ref[:, tail].abs().mean()).item()  # noqa: E731
    assert err(cached) <= 1.15 * err(full), (err(cached), err(full))


def test_autocast_decoding_state_matches_the_full_forward():
    """Under bf16 autocast the one-token path must accumulate the state in float32 like the
    chunkwise prefill does; its einsums ran in bf16 (state 1.4e-3 relative off after 300
    tokens, outputs 4.5e-3)."""
    from continuumlm import ModelConfig
    from continuumlm.mixers import DeltaNetAttention
    from continuumlm.mixers.deltanet import DeltaNetCache

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=10, hidden_size=64, num_heads=4, num_layers=1, mixer="deltanet")
    att = DeltaNetAttention(cfg).eval()
    x = torch.randn(1, 300, 64)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full_cache, step_cache = DeltaNetCache(), DeltaNetCache()
        full = att(x, cache=full_cache)
        steps = torch.cat([att(x[:, t:t + 1], cache=step_cache) for t in range(300)], 1)
    assert rel(step_cache.state, full_cache.state) < 1e-5
    # the outputs are bf16 (the output projection runs under autocast): with AMX bf16 matmuls a
    # one-row product and a 300-row one round differently (1.8e-4 seen on one CPU), well below
    # the 4.5e-3 a bf16 state gave
    assert rel(steps, full) < 1e-3


def test_short_conv_in_pieces_equals_one_pass():
    """Decoding feeds the convolution a piece at a time with the history it handed on: the
    same outputs as one pass over the whole sequence (split at lengths 1, 2 and 6)."""
    from continuumlm.mixers.deltanet import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(7, 4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(3, 9, 7)
    whole, _ = conv(x)
    parts, hist = [], None
    for a, b in ((0, 1), (1, 3), (3, 9)):
        y, hist = conv(x[:, a:b], hist)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), whole)


@pytest.mark.parametrize("T", [1, 2, 5, 64])
def test_short_conv_equals_causal_conv1d(T):
    """The multiply-add convolution against torch's own depthwise conv1d on the input padded
    with K-1 zeros on the left (the causal convolution), outputs and gradients, including
    inputs shorter than the kernel; the returned history is the last K-1 inputs."""
    from continuumlm.mixers.deltanet import ShortConv

    torch.manual_seed(T)
    conv = ShortConv(6, 4)
    torch.nn.init.normal_(conv.weight)
    x = torch.randn(2, T, 6, dtype=torch.float64, requires_grad=True)
    conv.double()
    y, hist = conv(x)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, groups=6).transpose(1, 2)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, conv.weight), g)
    want = torch.autograd.grad(ref, (x, conv.weight), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(hist, F.pad(x, (0, 0, 3, 0))[:, -3:])


def test_short_conv_keeps_the_input_dtype_under_autocast():
    """Under bf16 autocast the projections hand the convolution bf16 inputs while its weight
    stays float32; like conv1d under autocast, it returns bf16."""
    from continuumlm.mixers.deltanet import ShortConv

    conv = ShortConv(8, 4)
    x = torch.randn(2, 5, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, hist = conv(x)
    assert y.dtype == hist.dtype == torch.bfloat16
    torch.testing.assert_close(y, x)  # the identity at initialization


def test_chunkwise_kernel_compiles_as_one_graph():
    """torch.compile traces the chunk loop without graph breaks (an out= write into a strided
    slice broke the graph once per call)."""
    q, k, v, beta, init = _inputs(T=70)
    ex = torch._dynamo.explain(lambda q, k, v, b, s: delta_rule_chunkwise(
        q, k, v, b, chunk_size=32, initial_state=s))(q, k, v, beta, init)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons


def _deltanet_reference(layer, x, silu: bool):
    """The layer's forward spelled out with the token-loop kernel: (SiLU) -> L2 norm -> delta
    rule -> per-head norm -> SiLU gate -> output projection."""
    B, T, C = x.shape
    H = layer.num_heads
    D = C // H

    def heads(t):
        return t.view(B, T, H, D).transpose(1, 2)

    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if silu:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    q, k = F.normalize(heads(q), dim=-1), F.normalize(heads(k), dim=-1)
    beta = torch.sigmoid(layer.beta_proj(x)).transpose(1, 2)
    o, _ = delta_rule_recurrent(q, k, heads(v), beta)
    o = layer.norm(o).transpose(1, 2).reshape(B, T, C)
    return layer.o_proj(o * F.silu(layer.g_proj(x)))


@pytest.mark.parametrize("settings, silu, norm, bias", [
    ({}, True, torch.nn.RMSNorm, False),  # (Float32RMSNorm) flash-linear-attention's layer
    ({"activation": "none", "beta_bias": True, "head_norm": "model"}, False,
     torch.nn.LayerNorm, True),  # the map of earlier versions
])
def test_deltanet_feature_maps_against_the_spelled_out_layer(settings, silu, norm, bias):
    from conftest import small_config
    from continuumlm.mixers.deltanet import DeltaNetAttention

    torch.manual_seed(0)
    cfg = small_config(mixer="deltanet", components={"deltanet": settings})
    layer = DeltaNetAttention(cfg).double()
    assert isinstance(layer.norm, norm) and (layer.beta_proj.bias is not None) == bias
    x = torch.randn(2, 37, 32, dtype=torch.float64)  # not a multiple of the chunk
    torch.testing.assert_close(layer(x), _deltanet_reference(layer, x, silu), rtol=1e-10,
                               atol=1e-10)


@pytest.mark.parametrize("activation", ["silu", "none"])
def test_both_deltanet_maps_are_causal_and_decode_exactly(activation):
    from continuumlm.testing import check_component

    check_component("mixer", "deltanet",
                    components={"deltanet": {"activation": activation, "short_conv": 0}})


def test_a_config_saved_before_the_fla_defaults_reads_as_the_model_it_trained():
    """Saved configs (checkpoints, run.json, HF config.json) that lack the new keys build
    earlier versions' layer; a new config gets flash-linear-attention's map; a table of a
    mixer that is not selected, with nothing but old defaults, compares equal to none."""
    from continuumlm import ModelConfig

    old = {"vocab_size": 37, "hidden_size": 32, "num_heads": 4, "mixer": "deltanet",
           "deltanet": {"short_conv": 4}}
    saved = ModelConfig.from_dict(old, saved=True).component("deltanet")
    assert (saved.activation, saved.beta_bias, saved.head_norm) == ("none", True, "model")
    assert saved.short_conv == 4
    new = ModelConfig.from_dict(old).component("deltanet")
    assert (new.activation, new.beta_bias, new.head_norm) == ("silu", False, "rms")
    flat = {k: v for k, v in old.items() if k != "deltanet"} | {"deltanet_short_conv": 0}
    assert ModelConfig.from_dict(flat, saved=True).component("deltanet").activation == "none"
    other = {**flat, "mixer": "softmax"}  # 0.1 wrote every flat key whatever the mixer
    assert ModelConfig.from_dict(other, saved=True) == ModelConfig.from_dict(
        {k: v for k, v in other.items() if k != "deltanet_short_conv"}, saved=True)
    # what is saved now holds every key, so it reads back as itself
    cfg = ModelConfig.from_dict(old)
    assert ModelConfig.from_dict(cfg.to_dict(), saved=True) == cfg


def test_a_fresh_hugging_face_config_gets_todays_deltanet():
    """ContinuumLMConfig reads its settings like a saved config; with no [deltanet] table at
    all it is a fresh config and gets fla's map, while a config.json written before the keys
    existed (a table without them) keeps the map it was trained with."""
    pytest.importorskip("transformers")
    from continuumlm.hf import ContinuumLMConfig

    fresh = ContinuumLMConfig(mixer="deltanet").to_model_config().component("deltanet")
    assert (fresh.activation, fresh.beta_bias, fresh.head_norm) == ("silu", False, "rms")
    old = ContinuumLMConfig(mixer="deltanet", deltanet={"short_conv": 0})
    old = old.to_model_config().component("deltanet")
    assert (old.activation, old.beta_bias, old.head_norm) == ("none", True, "model")
