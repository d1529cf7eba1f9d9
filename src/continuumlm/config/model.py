"""[model]: the architecture (ModelConfig), the gradient modes and ode_kv options, the check of
the component names against the registries."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..errors import ConfigError
from ..registry import DEPTHS, FIELDS, GRADS, MIXERS, SOLVERS, load_plugins
from .checks import (
    ODE_TIME_LIMIT,
    _origin,
    _strict,
    _suggest,
    _validate,
    reading_saved_config,
)
from .components import MODEL_KEYS, _build_components, _component_class, _configurable
from .legacy import split_tables


@dataclass
class ModelConfig:
    """Architecture of a :class:`~continuumlm.LanguageModel`.

    Field names follow the seed documents (``hidden_size``, ``num_heads``, ``ode_solver``...).
    """

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)
    tables_field: ClassVar[str] = "components"  # every [model.NAME] table goes in here

    vocab_size: int = 0
    """Number of token ids; 0 means "take it from the tokenizer" (filled in by the trainer)."""
    hidden_size: int = 128
    """Width of the residual stream (d_model)."""
    num_heads: int = 4
    """Attention (or DeltaNet) heads; hidden_size must be divisible by it."""
    num_layers: int = 4
    """Distinct layers (discrete depth) or stacked ODE blocks, each with its own weights."""
    ffn_hidden_size: int | None = None
    """Width of the MLP; defaults to 4 * hidden_size."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (one mask per forward
    inside an ODE field, shared by every step and stage)."""
    norm_type: str = "layernorm"
    """"layernorm", "rmsnorm" or "dyt" (Dynamic Tanh: gamma * tanh(alpha x) + beta, no
    statistics; the default of the ODE-attention seed's implementation)."""
    use_bitnet: bool = False
    """BitNet b1.58 projections: ternary weights and 8-bit activations, trained through a
    straight-through estimator."""
    mode: str = "decoder"
    """"decoder": causal language model; "encoder": bidirectional."""
    position: str = "rope"
    """Positions: "rope" (rotary, any length), "learned" (a table of max_seq_len) or "none"."""
    max_seq_len: int = 256
    """Longest sequence the learned position table covers (also the continuous mixer's
    default kernel length, and the exported tokenizer's model_max_length)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output layer."""
    bias: bool = False
    """Biases in linear layers and norms (nanoGPT's ``bias``)."""
    mixer: str = "softmax"
    """Token mixer: softmax, deltanet, continuous, or one a plugin registers. A mixer's own
    settings are its table, e.g. [model.deltanet] short_conv = 4."""
    depth: str = "discrete"
    """"discrete" (num_layers distinct layers) or "ode" (shared-weight fields integrated over
    t from ode_t0 to ode_t1, num_layers blocks)."""
    field: str = "sequential"
    """Vector field of ODE blocks: attention, sequential or parallel."""
    ode_solver: str = "rk4"
    """Fixed grid: euler, midpoint, heun, rk4 (classical), rk4_38, rk2_gated, reversible_heun;
    adaptive (torchdiffeq's step-size control): tsit5, dopri5, dopri8, bosh3, fehlberg2,
    adaptive_heun."""
    ode_steps: int = 4
    """Uniform steps of a fixed-grid solver from ode_t0 to ode_t1."""
    ode_grad: str = "direct"
    """direct, adjoint, checkpoint, binomial or reversible (reversible needs a reversible
    solver; binomial keeps ode_checkpoints states and recomputes the rest, exact gradients)."""
    ode_kv: str = "evaluation"
    """What the mixers' memory (what later tokens read: softmax keys and values, DeltaNet's
    writes and short-convolution inputs, continuous attention's values) is computed from:
    "evaluation", every field evaluation's own state (a cache per evaluation: 64 for 4 blocks
    of RK4 x 4); "step", the state at the start of each solver step (a cache per step); or
    "block", the block's input (one cache per block, a discrete layer's). Queries evolve with
    every evaluation either way; training and decoding compute the same function."""
    ode_t0: float = 0.0
    """Start of the depth interval the ODE blocks integrate over."""
    ode_t1: float = 1.0
    """End of the depth interval (greater than ode_t0)."""
    ode_rtol: float = 1e-3
    """Relative tolerance of adaptive solvers."""
    ode_atol: float = 1e-4
    """Absolute tolerance of adaptive solvers."""
    ode_max_steps: int = 1000
    """Most steps an adaptive solve may take before it stops with an error."""
    reversible_tol: float = 1e-3
    """ode_grad = "reversible": the largest distance (relative to the state's largest value, at
    least 1) between the initial state the backward rebuilds and the true one; beyond it the
    step fails as a solver error (the method's stability region is narrow)."""
    ode_checkpoints: int = 0
    """States that ode_grad = "binomial" keeps per ODE block (0: about log2 of ode_steps);
    fewer keep less memory and recompute more steps in the backward pass."""
    ode_adjoint_norm: str = "default"
    """Error norm of the adjoint's backward solve (ode_grad = "adjoint" with an adaptive
    solver): "default" (torchdiffeq's: state, adjoint state and parameter gradients) or
    "seminorm" (Kidger et al. 2021: the parameter gradients left out of step-size control,
    which is exact for them and takes fewer backward steps)."""
    ode_time_embedding: str = "none"
    """"sinusoidal" makes the field non-autonomous, dh/dt = Block(h, t)."""
    ode_dt_embedding: bool = False
    """Also condition the field on the step size dt = (ode_t1 - ode_t0) / ode_steps (a learned
    projection of a sinusoidal embedding of log2(1 / dt), zero at first), so that one field can
    learn to serve several step counts (train.elastic.steps). Fixed-grid solvers only."""
    ode_dt_embedding_reads: str = "step"
    """What the dt embedding reads: "step", the step size dt; or "evaluation", the spacing of
    field evaluations dt / (evaluations per step), so that solves of equal cost share it (Euler
    x 16 and RK4 x 4 both read 1/16, Euler x 4 and RK4 x 1 both 1/4) instead of an accurate
    and a coarse solve sharing one (Euler x 4 and RK4 x 4 both read dt = 1/4). With
    "evaluation", ode_dt_steps_range counts field evaluations instead of steps."""
    ode_dt_steps_range: list[int] | None = None
    """With ode_dt_embedding: [fewest, most] step counts over [ode_t0, ode_t1] whose step sizes
    the embedding reads as they are; a solve with more steps reads the embedding of the most
    (one with fewer, of the fewest), so the field stays one it was trained as, and Euler or
    RK4 with ever more steps converges to the solution of that field's ODE instead of reading
    an embedding no step trained (None: every step size read as it is)."""
    exit_gate: bool = False
    """ODE models: a per-token halting gate, a linear read of the normalized state that gives
    the probability that a token's greedy prediction after a solver step is already the full
    solve's (CALM's calibrated confidence). Trained beside the model by
    train.any_depth.gate_weight; used by per-token exit with criterion "gate" (eval/generate
    --exit-criterion gate --exit-threshold TAU: a token stops once 1 - gate < TAU)."""
    # not part of a config's identity: a run resumed with its plugin given otherwise (an extra
    # --plugin, an entry point) is the same run
    plugins: list[str] = dataclasses.field(default_factory=list, compare=False)
    """Python modules imported before the model is built, whose components (mixers, fields,
    solvers) register themselves; saved with the run, so evaluation and generation need no
    flag (``--plugin MODULE`` adds one)."""
    components: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)
    """The settings of components that declare a ``Config`` (a [model.NAME] table each),
    keyed by component name; the selected components' are always present (defaults where not
    given). Read them with :meth:`component`."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size
        _validate(self, "model", skip=("components",))
        load_plugins(self.plugins)  # before the selectors are checked against the registries
        if self.hidden_size % self.num_heads != 0:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads "
                f"({self.num_heads}); choose e.g. hidden_size = "
                f"{self.num_heads * max(1, round(self.hidden_size / self.num_heads))}."
            )
        if self.position == "rope" and (self.hidden_size // self.num_heads) % 2 != 0:
            raise ConfigError(
                f"model.position = 'rope' needs an even head size, but hidden_size/num_heads = "
                f"{self.hidden_size // self.num_heads}; change the sizes or use position = 'learned'."
            )
        for name in ("ode_t0", "ode_t1"):
            if abs(getattr(self, name)) > ODE_TIME_LIMIT and _strict():
                raise ConfigError(
                    f"model.{name} = {getattr(self, name)} is outside [-{ODE_TIME_LIMIT:g}, "
                    f"{ODE_TIME_LIMIT:g}]: the solvers keep time in float32, and a step that "
                    f"large overflows it; depth is usually integrated over [0, 1].")
        r = self.ode_dt_steps_range
        if r is not None:
            if not (len(r) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                        and 1 <= n <= 10000 for n in r) and r[0] <= r[1]):
                raise ConfigError(f"model.ode_dt_steps_range must be [fewest, most]: two step "
                                  f"counts from 1 to 10000, fewest first; got {r}.")
            if not self.ode_dt_embedding:
                raise ConfigError("model.ode_dt_steps_range bounds the step sizes that the dt "
                                  "embedding reads, and this model has none: set "
                                  "model.ode_dt_embedding = true, or remove the range.")
        if self.ode_kv not in ODE_KV:
            raise ConfigError(f"model.ode_kv must be one of {', '.join(ODE_KV)} (what the "
                              f"mixers' memory is computed from), got {self.ode_kv!r}.")
        if self.ode_kv != "evaluation" and self.depth != "ode":
            raise ConfigError(f"model.ode_kv = {self.ode_kv!r} says which state of an ODE "
                              f"solve the mixers' memory comes from; depth = {self.depth!r} "
                              f"has no solve (each discrete layer already has one cache). "
                              f"Leave ode_kv out, or set depth = 'ode'.")
        if self.ode_dt_embedding_reads not in ("step", "evaluation"):
            raise ConfigError(f"model.ode_dt_embedding_reads must be 'step' (the step size) or "
                              f"'evaluation' (the spacing of field evaluations), got "
                              f"{self.ode_dt_embedding_reads!r}.")
        if self.ode_dt_embedding_reads != "step" and not self.ode_dt_embedding:
            raise ConfigError("model.ode_dt_embedding_reads says what the dt embedding reads, "
                              "and this model has none: set model.ode_dt_embedding = true, or "
                              "leave ode_dt_embedding_reads out.")
        if self.exit_gate and self.depth != "ode":
            raise ConfigError(f"model.exit_gate halts a token between an ODE block's solver "
                              f"steps; model.depth = {self.depth!r} has none. Leave exit_gate "
                              f"out, or set depth = 'ode'.")
        _check_selectors(self)
        self.components = _build_components(self)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def component(self, name: str):
        """The ``Config`` of component ``name`` (its defaults when this config sets none)."""
        if name in self.components:
            return self.components[name]
        cls = _component_class(name)
        if cls is None:
            raise KeyError(f"no registered component {name!r} declares a Config; components "
                           f"with settings: {', '.join(sorted(_configurable())) or 'none'}.")
        return cls.Config()

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, then one table per configured component (``{"deltanet": {...}}``)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)
             if f.name != "components"}
        d.update({name: dataclasses.asdict(c) for name, c in sorted(self.components.items())})
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None,
                  saved: bool = False) -> ModelConfig:
        with reading_saved_config() if saved else contextlib.nullcontext():
            return _build(cls, d, "model", source)


# the component tables must not shadow these keys
MODEL_KEYS.update(f.name for f in fields(ModelConfig))


GRAD_MODES = GRADS  # model.ode_grad's names: the gradient modes registered in ode/grad.py
ODE_KV = ("evaluation", "step", "block")  # model.ode_kv: what the mixers' memory comes from


def _check_selectors(cfg: ModelConfig) -> None:
    # A lookup loads the built-in components (and installed plugins) on first use.
    for registry, value in ((MIXERS, cfg.mixer), (DEPTHS, cfg.depth), (FIELDS, cfg.field),
                            (SOLVERS, cfg.ode_solver)):
        if value not in registry:
            raise ConfigError(registry.unknown_message(value))
    if cfg.ode_grad not in GRADS:
        raise ConfigError(GRADS.unknown_message(cfg.ode_grad))
    checker = getattr(DEPTHS[cfg.depth], "check_config", None)
    if checker is not None:
        checker(cfg)


def _build(klass, d: dict[str, Any], section: str, source: str | None = None,
           overridden: dict[str, str] | None = None):
    # a section whose tables are gathered in one field (ModelConfig.components) names it
    nest = getattr(klass, "tables_field", None)
    names = {f.name for f in fields(klass)} - {nest}
    d = split_tables(section, d, source, overridden, nest)  # the old flat names too
    for key in d:
        if key == nest:
            continue
        if key not in names:
            where = _origin(f"{section}.{key}", source, overridden)
            raise ConfigError(f"unknown key {section}.{key}{_suggest(key, names)}{where}; "
                              f"valid keys of [{section}] are: {', '.join(sorted(names))}.")
    try:
        return klass(**d)
    except ConfigError as e:
        where = _origin(str(e), source, overridden)
        if where:
            raise ConfigError(f"{e}{where}") from None
        raise
