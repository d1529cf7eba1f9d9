"""Property tests: random valid configs build, train-step and stay causal; random invalid
configs always fail with a ConfigError that names a key."""

import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuumlm import ConfigError, LanguageModel, ModelConfig

SOLVER_GRAD = [("euler", "direct"), ("midpoint", "adjoint"), ("heun", "checkpoint"),
               ("rk4", "direct"), ("rk4_38", "checkpoint"), ("rk2_gated", "direct"),
               ("reversible_heun", "reversible")]
WIDTHS = [(16, 2), (24, 3), (32, 4)]
CAT = [{}, {"quadrature": "exact"}, {"quadrature": "composite", "panel": 20},
       {"mode": "bias"}, {"mode": "bias", "kernel": "relative", "length": 16}]

valid_configs = st.fixed_dictionaries({
    "mixer": st.sampled_from(["softmax", "deltanet", "continuous"]),
    "depth": st.sampled_from(["discrete", "ode"]),
    "field": st.sampled_from(["attention", "sequential", "parallel"]),
    "solver_grad": st.sampled_from(SOLVER_GRAD),
    "ode_steps": st.integers(1, 3),
    "norm_type": st.sampled_from(["layernorm", "rmsnorm"]),
    "use_bitnet": st.booleans(),
    "mode": st.sampled_from(["decoder", "encoder"]),
    "position": st.sampled_from(["rope", "learned", "none"]),
    "width": st.sampled_from(WIDTHS),
    "num_layers": st.integers(1, 2),
    "time": st.sampled_from(["none", "sinusoidal"]),
    "cat": st.sampled_from(CAT),  # [model.continuous], read when the mixer is continuous
})


def build(d) -> ModelConfig:
    solver, grad = d["solver_grad"]
    hidden, heads = d["width"]
    return ModelConfig(vocab_size=23, hidden_size=hidden, num_heads=heads,
                       num_layers=d["num_layers"], max_seq_len=96, mixer=d["mixer"],
                       depth=d["depth"], field=d["field"], ode_solver=solver, ode_grad=grad,
                       ode_steps=d["ode_steps"], norm_type=d["norm_type"],
                       use_bitnet=d["use_bitnet"], mode=d["mode"], position=d["position"],
                       ode_time_embedding=d["time"],
                       components={"continuous": d["cat"]} if d["mixer"] == "continuous" else {})


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(d=valid_configs, T=st.integers(1, 96), data=st.data())
def test_random_valid_configs(d, T, data):
    torch.manual_seed(0)
    model = LanguageModel(build(d))
    idx = torch.randint(0, 23, (2, T))
    logits, loss = model(idx, idx)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.eval()
    ref, _ = model(idx)
    if d["mode"] == "decoder" and T > 1:
        i = data.draw(st.integers(0, T - 2))
        alt = idx.clone()
        alt[:, i + 1:] = (alt[:, i + 1:] + 1) % 23
        torch.testing.assert_close(model(alt)[0][:, : i + 1], ref[:, : i + 1], rtol=0, atol=1e-5)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        again = LanguageModel.from_pretrained(tmp).eval()
        torch.testing.assert_close(again(idx)[0], ref, rtol=0, atol=0)


BAD_VALUES = {
    "hidden_size": [0, -8, 1.5, "wide", None, True],
    "num_heads": [0, -1, 3.0],
    "num_layers": [0, -2],
    "dropout": [-0.1, 1.0, 2, "0.1"],
    "mixer": ["attention", "", 3],
    "depth": ["continuous", None],
    "field": ["mlp"],
    "ode_solver": ["rk45", "RK4"],
    "ode_grad": ["backsolve"],
    "ode_steps": [0, -4, 2.5],
    "norm_type": ["batchnorm"],
    "position": ["alibi"],
    "mode": ["causal"],
    "use_bitnet": ["yes", 1],
    "ode_rtol": [0.0, -1e-3],
    "not_a_key": [1],
}


@settings(max_examples=80, deadline=None, derandomize=True)
@given(key=st.sampled_from(sorted(BAD_VALUES)), data=st.data())
def test_random_invalid_configs(key, data):
    value = data.draw(st.sampled_from(BAD_VALUES[key]))
    kwargs = {"vocab_size": 10, "hidden_size": 32, "num_heads": 4, key: value}
    try:
        ModelConfig.from_dict(kwargs)
    except ConfigError as e:
        assert key in str(e) or "hidden_size" in str(e)
    else:
        raise AssertionError(f"{key}={value!r} was accepted")
