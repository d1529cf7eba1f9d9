"""Every mixer in both depths and both modes: shapes, gradients, causality, encoder reach,
and cached decoding equal to recompute."""

import types

import pytest
import torch

from conftest import assert_cached_decoding_exact
from continuumlm import LanguageModel, ModelConfig
from continuumlm.mixers import MIXERS, DeltaNetAttention
from continuumlm.nn import BitLinear

MIXER_NAMES = sorted(MIXERS)
DEPTHS = [dict(depth="discrete"), dict(depth="ode", ode_solver="euler", ode_steps=2)]


def model(mixer, **kw):
    torch.manual_seed(0)
    base = dict(vocab_size=31, hidden_size=32, num_heads=4, num_layers=2, max_seq_len=64,
                mixer=mixer,
                components={"deltanet": {"short_conv": 3}} if mixer == "deltanet" else {})
    base.update(kw)
    m = LanguageModel(ModelConfig(**base))
    if mixer == "deltanet":  # small chunks so test lengths cross chunk boundaries
        for mod in m.modules():
            if isinstance(mod, DeltaNetAttention):
                mod.chunk_size = 8
    return m.eval()


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
@pytest.mark.parametrize("mode", ["decoder", "encoder"])
@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_shapes_and_gradients(mixer, mode, depth):
    m = model(mixer, mode=mode, **depth).train()
    idx = torch.randint(0, 31, (2, 19))
    logits, loss = m(idx, idx)
    assert logits.shape == (2, 19, 31)
    (loss + m.penalty()).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_decoder_causal_change_and_removal(mixer, depth):
    m = model(mixer, **depth)
    idx = torch.randint(0, 31, (2, 21))
    ref, _ = m(idx)
    i = 12
    alt = idx.clone()
    alt[:, i + 1:] = (alt[:, i + 1:] + 7) % 31
    torch.testing.assert_close(m(alt)[0][:, : i + 1], ref[:, : i + 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(m(idx[:, : i + 1])[0], ref[:, : i + 1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_encoder_reads_the_whole_window(mixer, depth):
    m = model(mixer, mode="encoder", **depth)
    idx = torch.randint(0, 31, (1, 17))
    alt = idx.clone()
    alt[:, -1] = (alt[:, -1] + 5) % 31
    assert not torch.allclose(m(alt)[0][:, 0], m(idx)[0][:, 0])


@pytest.mark.parametrize("depth", DEPTHS + [dict(depth="ode", ode_solver="rk4", ode_steps=2)],
                         ids=["discrete", "ode-euler", "ode-rk4"])
@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_cached_generation_equals_recompute(mixer, depth):
    m = model(mixer, **depth)
    prompt = torch.randint(0, 31, (2, 11))
    a = assert_cached_decoding_exact(m, prompt, 40)
    rows = [m.generate(prompt[r:r + 1], 40, greedy=True) for r in range(2)]
    assert torch.equal(torch.cat(rows), a)  # no state shared between batch rows


def test_deltanet_layer_rejects_indivisible_width():
    cfg = types.SimpleNamespace(hidden_size=30, num_heads=4, head_dim=7, mode="decoder",
                                use_bitnet=False, bias=False,
                                norm_type="rmsnorm", dropout=0.0)
    with pytest.raises(ValueError, match=r"30.*4"):
        DeltaNetAttention(cfg)


def test_deltanet_state_does_not_grow():
    m = model("deltanet")
    state = m.init_state(1)
    m.step(torch.randint(0, 31, (1, 30)), state)
    sizes = {k: c.state.numel() for k, c in state._caches.items()}
    m.step(torch.randint(0, 31, (1, 1)), state)
    assert sizes == {k: c.state.numel() for k, c in state._caches.items()}
    # the short convolution's history is its own K-1 inputs, not a view of the prompt's
    # activations (which it would keep alive)
    hists = [h for c in state._caches.values() for h in c.conv.values()]
    assert hists and all(h.untyped_storage().nbytes() == h.numel() * h.element_size()
                         for h in hists)


def test_sobolev_penalty():
    m = model("continuous", num_layers=1)
    att = m.depth.layers[0].mixer
    with torch.no_grad():
        att.coef.zero_()
        assert att.penalty().item() == 0.0
        att.coef[:, 1, 0] = 1.0
        low = att.penalty().item()
        att.coef.zero_()
        att.coef[:, 5, 0] = 1.0
        assert att.penalty().item() > low > 0


@pytest.mark.parametrize("basis", ["fourier", "cheb"])
def test_continuous_attention_rows_are_convex_and_long_contexts_run(basis):
    m = model("continuous", components={"continuous": {"basis": basis}}, num_layers=1)
    att = m.depth.layers[0].mixer
    M = att.mixing(torch.arange(0, 40), 40)
    torch.testing.assert_close(M.sum(-1), torch.ones(4, 40))
    assert (M >= 0).all() and M.triu(1).abs().max() == 0  # causal
    assert m(torch.randint(0, 31, (1, 1)))[0].shape == (1, 1, 31)  # a single token works
    assert m(torch.randint(0, 31, (1, 5000)))[0].shape == (1, 5000, 31)  # CAT's longest context


def test_continuous_fourier_kernel_aliases_past_its_length():
    """The Fourier kernel cos(pi f s) is even about s = 1 and periodic with period 2: in the
    exact kernel mode, swapping the tokens at positions length + k and length - k, or at j and
    j - 2 * length, changes no later output, while swapping other pairs does. That is why a
    model trained with the default length (max_seq_len) cannot hold at contexts past it; a
    one-time warning says so when it reads past position length."""
    import warnings

    m = model("continuous", num_layers=1, max_seq_len=8, position="none",
              components={"continuous": {"quadrature": "exact", "length": 8}}).double()
    att = m.depth.layers[0].mixer
    assert att.unique_range() == 9
    x = torch.randn(1, 40, 32, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = att(x)
        att(x)
    assert len([w for w in seen if "reflect and repeat past token 8" in str(w.message)]) == 1
    for a, b, same in ((30, 14, True), (10, 6, True), (12, 4, True), (30, 15, False),
                       (10, 7, False)):
        swapped = x.clone()
        swapped[:, [a, b]] = x[:, [b, a]]
        later = max(a, b) + 1
        close = torch.allclose(att(swapped)[:, later:], y[:, later:], rtol=1e-9, atol=1e-12)
        assert close == same, (a, b)
    with warnings.catch_warnings(record=True) as seen:  # positions 0..8 are told apart
        warnings.simplefilter("always")
        fresh = model("continuous", num_layers=1, max_seq_len=8, position="none",
                      components={"continuous": {"quadrature": "exact", "length": 8}})
        fresh.depth.layers[0].mixer(torch.randn(1, 9, 32))
    assert not [w for w in seen if "kernel positions" in str(w.message)]


def test_bitlinear_normalizes_features_only_and_stays_causal():
    lin = BitLinear(8, 4, bias=False)
    x = torch.randn(1, 6, 8)
    y = lin(x)
    x2 = x.clone()
    x2[:, 3:] *= 100  # scaling later tokens must not change earlier outputs
    torch.testing.assert_close(lin(x2)[:, :3], y[:, :3])
    m = model("softmax", use_bitnet=True)
    idx = torch.randint(0, 31, (1, 12))
    alt = idx.clone()
    alt[:, 6:] = 0
    torch.testing.assert_close(m(alt)[0][:, :6], m(idx)[0][:, :6], rtol=0, atol=1e-5)


def test_bitnet_model_trains_and_exports_ternary_weights():
    from continuumlm.nn import ternary_weights

    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=11, hidden_size=32, num_heads=4, num_layers=2,
                                  use_bitnet=True, max_seq_len=64))
    data = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 4)
    x, y = data[:-1][None], data[1:][None]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    first = None
    for _ in range(120):
        _, loss = m(x, y)
        first = first or loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first
    exported = ternary_weights(m)
    qkv = exported["depth.layers.0.mixer.qkv.weight"]
    assert qkv.dtype == torch.int8 and set(qkv.unique().tolist()) <= {-1, 0, 1}
    assert exported["depth.layers.0.mixer.qkv.weight_scale"].item() > 0


def test_continuous_gather_path_equals_dense_path():
    m = model("continuous", num_layers=1, max_seq_len=64)
    att = m.depth.layers[0].mixer
    x = torch.randn(2, 70, 32)
    dense = att(x)
    att.dense_limit = 8  # force the gather path
    att.query_chunk = 16
    torch.testing.assert_close(att(x), dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mixer", MIXER_NAMES)
def test_model_cast_to_another_dtype(mixer, dtype):
    """`.to(dtype)` works for every mixer, on both paths of the continuous mixer (gather for
    T <= 4, dense beyond), and gives the float32 model's logits to that dtype's precision."""
    m = model(mixer)
    for T in (3, 12):
        idx = torch.randint(0, 31, (2, T))
        ref = m(idx)[0]
        out = m.to(dtype)(idx)[0]
        m.float()
        assert out.dtype == dtype
        tol = 1e-5 if dtype == torch.float64 else 0.15
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_continuous_kernel_ignores_autocast():
    """Under bf16 autocast the quadrature (positions, nodes, kernel) stays float32: bf16 holds
    integers exactly only up to 256, so positions in a long context would collide."""
    att = model("continuous", num_layers=1, max_seq_len=8192).depth.layers[0].mixer
    q_pos = torch.arange(4000, 4100)
    ref = att.quadrature(q_pos, 4100)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = att.quadrature(q_pos, 4100)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quadrature_nodes_survive_a_cast_of_the_model(dtype):
    """`.to(bfloat16)` must not round the continuous mixer's Gauss-Legendre nodes and weights:
    rounded nodes read the values of tokens several positions away at long contexts. A cast
    model must pick exactly the tokens, and the weights, of a float32 model with the same
    (rounded) coefficients."""
    from continuumlm.mixers.continuous import ContinuousAttention

    cfg = ModelConfig(vocab_size=31, hidden_size=16, num_heads=2, num_layers=1,
                      max_seq_len=8192, mixer="continuous",
                      components={"continuous": {"sob_lambda": 1e-3}})
    torch.manual_seed(0)
    cast = ContinuousAttention(cfg).to(dtype)
    ref = ContinuousAttention(cfg)
    ref.coef.data.copy_(cast.coef.float())
    assert cast.nodes.dtype == cast.log_w.dtype == torch.float32
    q = torch.arange(4000, 4100)
    p, lo, hi, alpha = cast.quadrature(q, 4100)
    p_ref, lo_ref, hi_ref, alpha_ref = ref.quadrature(q, 4100)
    assert torch.equal(lo, lo_ref) and torch.equal(hi, hi_ref)
    torch.testing.assert_close(alpha, alpha_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(p, p_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(cast.penalty(), ref.penalty(), rtol=1e-6, atol=0)  # no underflow
    back = cast.double()  # and a float64 model gets float64 constants
    assert back.nodes.dtype == torch.float64


def test_rope_angles_stay_float32_when_the_model_is_cast():
    """`.to(bfloat16)` must not round RoPE's frequencies: the one-token step computes angles
    from them, and tables regrown past max_seq_len too, so a rounded frequency turns far
    positions by up to half a radian. Either path must equal float32 RoPE to bf16 precision."""
    from continuumlm.nn.position import RotaryEmbedding

    x = torch.randn(1, 1, 16)
    ref = RotaryEmbedding(16, 4096)
    cast = RotaryEmbedding(16, 2048).to(torch.bfloat16)
    for pos in (300, 1500, 3000):  # 3000 regrows the table
        want = ref(x, offset=pos)
        step = cast.at(x.bfloat16(), torch.tensor([pos]))
        table = cast(x.bfloat16(), offset=pos)
        for got in (step, table):
            torch.testing.assert_close(got.float(), want, rtol=0, atol=0.03)


# ------------------------------------------------------------------ CAT's other quadratures

def cat(**own):
    torch.manual_seed(0)
    m = model("continuous", num_layers=1, max_seq_len=64,
              components={"continuous": {"sob_lambda": 1e-3, **own}}).double()
    att = m.depth.layers[0].mixer
    with torch.no_grad():
        att.coef.normal_(0, 0.5)  # a kernel that prefers some distances
    return m, att


def bias_qkv(att, x):
    """The bias mode's own content queries and keys and its values, (B, H, T, D) each."""
    B, T, _ = x.shape
    q, k = att.qk(x).view(B, T, 2, att.num_heads, att.head_dim).permute(2, 0, 3, 1, 4)
    return q, k, att.v_proj(x).view(B, T, att.num_heads, att.head_dim).transpose(1, 2)


def test_exact_quadrature_is_the_sum_over_every_earlier_token():
    """quadrature = "exact" against the definition, one query at a time:
    y_i = sum_{j <= i} softmax_j(phi(s_i)^T C phi(t_j)) v_j (then out_proj)."""
    _, att = cat(quadrature="exact")
    x = torch.randn(2, 23, att.num_heads * att.head_dim, dtype=torch.float64)
    got = att(x)
    B, T, C = x.shape
    v = att.v_proj(x).view(B, T, att.num_heads, att.head_dim).transpose(1, 2)
    phi = att.phi(torch.arange(T, dtype=torch.float64) / att.scale)       # (T, F)
    W = torch.einsum("if,hfg,jg->hij", phi, att.coef, phi)                # (H, T, T)
    rows = []
    for i in range(T):
        p = torch.softmax(W[:, i, :i + 1], -1)                            # (H, i+1)
        rows.append(torch.einsum("hj,bhjd->bhd", p, v[:, :, :i + 1]))
    want = att.out_proj(torch.stack(rows, 2).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_composite_quadrature_with_one_panel_is_gauss_legendre():
    _, gauss = cat(quadrature="gauss", n_quad=8)
    _, comp = cat(quadrature="composite", n_quad=8, panel=64)  # one panel covers every query
    x = torch.randn(2, 40, 32, dtype=torch.float64)
    torch.testing.assert_close(comp(x), gauss(x), rtol=1e-10, atol=1e-12)
    # more panels: more nodes for later queries, so the rows differ past the first panel
    _, many = cat(quadrature="composite", n_quad=8, panel=10)
    a, b = many(x), gauss(x)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=1e-10, atol=1e-12)
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    p, lo, hi, alpha = many.quadrature(torch.tensor([0, 9, 35]), 40)
    assert p.shape[-1] == 4 * 8  # the furthest query (35) reaches 4 panels of 10
    assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)))
    assert (p[:, 0, 8:] == 0).all() and (p[:, 1, 8:] == 0).all()  # one panel for s < 10


def test_bias_mode_without_a_kernel_is_softmax_attention():
    """mode = "bias" is softmax(q.k / sqrt(d) + W); with C = 0 it is plain causal attention on
    its own q, k and v projections."""
    _, att = cat(mode="bias")
    with torch.no_grad():
        att.coef.zero_()
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    B, T, C = x.shape
    q, k, v = bias_qkv(att, x)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = att.out_proj(y.transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(att(x), want, rtol=1e-10, atol=1e-12)
    assert att.penalty() == 0  # the Sobolev penalty acts on C


@pytest.mark.parametrize("own", [{"quadrature": "exact"}, {"mode": "bias"},
                                 {"quadrature": "composite", "panel": 5, "n_quad": 4},
                                 {"mode": "bias", "kernel": "relative", "length": 6}],
                         ids=["exact", "bias", "composite", "relative"])
@pytest.mark.parametrize("depth", ["discrete", "ode"])
def test_cat_variants_are_causal_and_decode_exactly(own, depth):
    from continuumlm.testing import check_cached_decoding, check_causal, check_trains

    m = model("continuous", depth=depth, components={"continuous": own}).double()
    check_causal(m, atol=1e-10)
    check_cached_decoding(m, torch.randint(0, 31, (2, 5)), 12, atol=1e-9)
    check_trains(m)


def test_cat_settings_by_their_flat_names():
    from continuumlm.config import load_config

    cfg = load_config(None, ["model.mixer=continuous", "model.cat_quadrature=exact",
                             "model.cat_mode=bias", "model.cat_panel=64"])
    own = cfg.model.component("continuous")
    assert (own.quadrature, own.mode, own.panel) == ("exact", "bias", 64)


def test_bias_mode_is_attention_plus_the_kernel():
    """mode = "bias" with a kernel: softmax_j(q_i.k_j / sqrt(d) + phi(s_i)^T C phi(t_j)) v_j over
    j <= i, against the formula written out."""
    _, att = cat(mode="bias")
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    B, T, C = x.shape
    q, k, v = bias_qkv(att, x)
    phi = att.phi(torch.arange(T, dtype=torch.float64) / att.scale)
    W = torch.einsum("if,hfg,jg->hij", phi, att.coef, phi)
    scores = q @ k.transpose(-2, -1) / att.head_dim ** 0.5 + W
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    y = torch.softmax(scores, -1) @ v
    want = att.out_proj(y.transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(att(x), want, rtol=1e-10, atol=1e-12)


def test_relative_kernel_is_attention_plus_a_prior_on_the_log_distance():
    """kernel = "relative": softmax_j(q_i.k_j / sqrt(d) + b_h(i - j)) v_j over j <= i with
    b_h(d) = sum_f c_hf cos(pi f min(1, log(1 + d) / log(1 + length))), written out, on a
    length (23) past the kernel's `length` (7) and not a multiple of the query chunk (5)."""
    import math

    _, att = cat(mode="bias", kernel="relative", length=7)
    att.query_chunk = 5
    with torch.no_grad():
        att.coef.normal_(0, 0.5)
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    B, T, C = x.shape
    q, k, v = bias_qkv(att, x)
    f = torch.arange(att.n_freq, dtype=torch.float64)
    want_rows = []
    for i in range(T):
        d = i - torch.arange(i + 1, dtype=torch.float64)
        u = (torch.log(1 + d) / math.log(8)).clamp(max=1)
        prior = att.coef @ torch.cos(math.pi * f[:, None] * u[None, :])      # (H, i+1)
        scores = q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-1, -2) / att.head_dim ** 0.5
        p = torch.softmax(scores + prior[:, None], -1)
        want_rows.append((p @ v[:, :, :i + 1])[:, :, 0])
    want = att.out_proj(torch.stack(want_rows, 2).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(att(x), want, rtol=1e-10, atol=1e-12)
    # every distance from `length` on shares one value; below it they differ
    prior = att.distance_prior(torch.arange(12))
    torch.testing.assert_close(prior[:, 7:], prior[:, 7:8].expand(-1, 5))
    assert not torch.allclose(prior[:, 5], prior[:, 6])
    # the Sobolev penalty on its one axis: lambda * sum f^4 c^2
    torch.testing.assert_close(att.penalty(), 1e-3 * (f ** 4 * att.coef ** 2).sum())


def test_relative_kernel_in_encoder_mode_reads_both_sides_at_the_distance():
    """Encoder mode: softmax over every token of q.k / sqrt(d) + b_h(|i - j|)."""
    torch.manual_seed(0)
    m = model("continuous", mode="encoder", num_layers=1,
              components={"continuous": {"mode": "bias", "kernel": "relative",
                                         "length": 5}}).double()
    att = m.depth.layers[0].mixer
    with torch.no_grad():
        att.coef.normal_(0, 0.5)
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    B, T, C = x.shape
    q, k, v = bias_qkv(att, x)
    d = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs()
    scores = q @ k.transpose(-1, -2) / att.head_dim ** 0.5 + att.distance_prior(d)
    want = att.out_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(att(x), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("basis, atol", [("cheb", 1e-5), ("fourier", 0.3)])
def test_relative_kernel_starts_as_a_power_law_per_head(basis, atol):
    """At init b_h(d) - b_h(0) = -m_h log(1 + d) up to `length` (exact in the Chebyshev basis,
    up to the truncated cosine series in the Fourier one), m_h from 1/4 to 4 over the heads,
    and constant past `length`."""
    m = model("continuous", num_layers=1, num_heads=8, hidden_size=64, max_seq_len=256,
              components={"continuous": {"mode": "bias", "kernel": "relative", "basis": basis}})
    att = m.depth.layers[0].mixer
    d = torch.tensor([0, 1, 2, 5, 40, 255, 256, 3000])
    with torch.no_grad():
        b = att.distance_prior(d)
    slopes = torch.logspace(-2, 2, 8, base=2.0)[:, None]
    want = -slopes * torch.log1p(d.clamp(max=256).float())
    torch.testing.assert_close(b - b[:, :1], want, rtol=0, atol=atol)


def test_relative_kernel_needs_bias_mode():
    from continuumlm.config import load_config
    from continuumlm.errors import ConfigError

    with pytest.raises(ConfigError, match="needs model.continuous.mode = 'bias'"):
        load_config(None, ["model.mixer=continuous", "model.cat_kernel=relative"])
    cfg = load_config(None, ["model.mixer=continuous", "model.cat_kernel=relative",
                             "model.cat_mode=bias"])
    assert cfg.model.component("continuous").kernel == "relative"


def test_exact_forms_keep_the_kernel_in_float32_under_autocast(monkeypatch):
    """Under bf16 autocast the projections run in bf16, but the attention over positions (its
    queries C^T phi(s) and keys phi(t)) runs in float32, with autocast off."""
    import torch.nn.functional as F

    _, att = cat(quadrature="exact")
    att = att.float()
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        out = real(q, k, v, **kw)
        seen.append((q.dtype, k.dtype, torch.is_autocast_enabled("cpu"), out.dtype))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        att(torch.randn(1, 300, 32))
    assert seen == [(torch.float32, torch.float32, False, torch.float32)]


@pytest.mark.parametrize("dq,dv", [(48, 16), (8, 16), (16, 16)])
def test_attention_with_unequal_widths_equals_the_explicit_softmax(dq, dv):
    """continuous attention's SDPA with query/key and value widths that differ (zero-padded to
    the wider for the fused kernels) equals softmax(q k^T) v written out, causal and masked,
    on a length that is not a power of two."""
    from continuumlm.mixers.spectral import sdpa_any_dims as _sdpa_any_dims

    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 37, dq, dtype=torch.float64), torch.randn(2, 3, 37, dq, dtype=torch.float64)
    v = torch.randn(2, 3, 37, dv, dtype=torch.float64)
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    want = torch.softmax((q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf")), -1) @ v
    torch.testing.assert_close(_sdpa_any_dims(q, k, v, None, True), want)
    torch.testing.assert_close(_sdpa_any_dims(q, k, v, causal, False), want)


def _boolean_chunk(offset, T, L):
    return torch.arange(L)[None, :] <= torch.arange(offset, offset + T)[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunk_mask_is_the_boolean_mask_made_additive_and_remembered_per_shape(dtype):
    """The chunk mask (queries at offset.. after cached keys) is 0 where the boolean mask is
    True and -inf elsewhere; attention through it equals attention through the boolean mask
    bitwise; the one remembered mask serves only the same sizes, dtype and mode."""
    from continuumlm.mixers import softmax

    torch.manual_seed(0)
    shapes = [(5, 4, 9), (3, 1, 4), (5, 4, 9), (0, 7, 7), (12, 5, 17)]  # awkward, repeated
    for offset, T, L in shapes:
        mask = softmax.chunk_mask(offset, T, L, torch.empty((), dtype=dtype))
        want = _boolean_chunk(offset, T, L)
        assert mask.dtype == dtype and mask.shape == (T, L)
        assert torch.equal(mask == 0, want) and torch.isinf(mask[~want]).all()
        q, k, v = (torch.randn(2, 3, n, 8, dtype=dtype) for n in (T, L, L))
        assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, k, v, mask),
                           torch.nn.functional.scaled_dot_product_attention(q, k, v, want))
    a = softmax.chunk_mask(2, 3, 5, torch.empty(()))
    assert softmax.chunk_mask(2, 3, 5, torch.empty(())) is a  # remembered
    assert softmax.chunk_mask(2, 3, 5, torch.empty((), dtype=torch.float64)).dtype == \
        torch.float64
    with torch.inference_mode():
        b = softmax.chunk_mask(2, 3, 5, torch.empty(()))
        assert b is not a and b.is_inference()
    c = softmax.chunk_mask(2, 3, 5, torch.empty(()))
    assert c is not b and not c.is_inference()  # an inference tensor is not handed out


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_chunked_extension_equals_one_token_steps_and_frozen_dropout_reads_the_chunk_mask(
        dropout):
    """Extending a KV cache by a chunk of tokens (a verifying pass) gives what one-token
    steps give, with the additive chunk mask; with dropout frozen (ODE training's fixed
    mask), the hand-formed weights read the additive mask as the boolean one."""
    from continuumlm.mixers.softmax import SoftmaxAttention

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, hidden_size=16, num_heads=2, num_layers=1, dropout=dropout)
    att = SoftmaxAttention(cfg).double().eval()
    x = torch.randn(1, 9, 16, dtype=torch.float64)
    one, chunk = att.cache_factory(), att.cache_factory()
    steps = torch.cat([att.extend(x[:, i:i + 1], one) for i in range(9)], 1)
    out = torch.cat([att.extend(x[:, :4], chunk), att.extend(x[:, 4:], chunk)], 1)
    torch.testing.assert_close(out, steps, rtol=0, atol=1e-12)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (5, 9, 9))
    from continuumlm.mixers.softmax import chunk_mask
    additive = chunk_mask(4, 5, 9, q)
    torch.testing.assert_close(att._attend_frozen_dropout(q, k, v, additive, False),
                               att._attend_frozen_dropout(q, k, v, _boolean_chunk(4, 5, 9),
                                                          False), rtol=0, atol=0)
