"""Every registered component (built-in, or registered by an installed plugin) passes the
checks of continuumlm.testing: causality, cached decoding equal to recompute, finite
gradients, a size that does not depend on the solver's steps."""

from __future__ import annotations

import pytest

from continuumlm import ConfigError, ModelConfig, register_mixer
from continuumlm.registry import MIXERS, REGISTRIES, Registry, UnknownComponent
from continuumlm.testing import check_component

COMPONENTS = [(kind, name) for kind, reg in REGISTRIES.items() if kind != "depth"
              for name in sorted(reg)]


@pytest.mark.parametrize("kind,name", COMPONENTS, ids=[f"{k}-{n}" for k, n in COMPONENTS])
def test_registered_component_keeps_the_invariants(kind, name):
    check_component(kind, name)


def test_the_registries_hold_the_built_ins():
    assert {"softmax", "deltanet", "continuous"} <= set(REGISTRIES["mixer"])
    assert {"attention", "sequential", "parallel"} <= set(REGISTRIES["field"])
    assert {"euler", "rk4", "rk4_38", "rk2_gated", "reversible_heun", "dopri5"} <= \
        set(REGISTRIES["solver"])
    assert set(REGISTRIES["depth"]) == {"discrete", "ode"}


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(UnknownComponent, match="did you mean 'deltanet'.*continuous, deltanet, "
                                               "softmax") as e:
        MIXERS["deltanett"]
    assert isinstance(e.value, KeyError) and isinstance(e.value, ConfigError)
    with pytest.raises(ConfigError, match="model.field = 'sequentail' is not available"):
        ModelConfig(vocab_size=5, field="sequentail")


def test_a_name_is_taken_once(monkeypatch):
    reg = Registry("mixer", "model.mixer", ())
    reg.register("mine", int)
    reg.register("mine", int)  # the same object again: harmless (a module imported twice)
    with pytest.raises(ValueError, match="taken by builtins.int"):
        reg.register("mine", float)
    reg.register("mine", float, replace=True)
    assert reg["mine"] is float
    with pytest.raises(ValueError, match="identifier"):
        reg.register("two words", int)
    with pytest.raises(ValueError, match="taken"):
        register_mixer("softmax")(type("Other", (), {}))


def test_a_broken_component_fails_the_checks(monkeypatch):
    """The harness can fail: a mixer that looks at the next token is caught as not causal."""
    import torch

    from continuumlm.mixers import SoftmaxAttention

    class Peeking(SoftmaxAttention):
        def forward(self, x, cache=None):
            return super().forward(x, cache) + 0.5 * torch.roll(x, -1, dims=1)

    monkeypatch.setitem(MIXERS._entries, "peeking", Peeking)
    with pytest.raises(AssertionError, match="not causal"):
        check_component("mixer", "peeking")


def test_a_plugin_may_replace_a_built_in_before_the_built_ins_load(tmp_path):
    """--plugin imports a plugin before any lookup: its replace=True must win over the
    built-in registering itself afterwards (a fresh interpreter: nothing loaded yet)."""
    import subprocess
    import sys

    code = (
        "import continuumlm\n"
        "from continuumlm.ode.solvers import FixedGridSolver, TABLEAUS\n"
        "@continuumlm.register_solver('midpoint', replace=True)\n"
        "class Mine(FixedGridSolver):\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__(cfg, tableau=TABLEAUS['heun'])\n"
        "from continuumlm.registry import SOLVERS\n"
        "assert SOLVERS['midpoint'] is Mine and 'rk4' in SOLVERS\n"
        "import importlib, sys\n"
        "assert continuumlm.ModelConfig(vocab_size=5, depth='ode', ode_solver='midpoint')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_component_table_may_not_shadow_a_model_key(monkeypatch):
    from dataclasses import dataclass

    from continuumlm.mixers import SoftmaxAttention

    class Position(SoftmaxAttention):
        @dataclass
        class Config:
            k: int = 1
            """A setting."""

    monkeypatch.setitem(MIXERS._entries, "position", Position)
    with pytest.raises(ConfigError, match=r"\[model.position\] would clash with a \[model\] key"):
        ModelConfig(vocab_size=5, mixer="position")


def test_the_old_spelling_on_the_command_line_is_named_in_errors():
    from continuumlm import load_config

    with pytest.raises(ConfigError, match=r"short_conv must be at least 0.*from --set "
                                          r"model.deltanet_short_conv=-1"):
        load_config(None, ["model.mixer=deltanet", "model.deltanet_short_conv=-1"])
