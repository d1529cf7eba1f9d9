"""[train]: the optimization, schedule, evaluation and checkpoints (TrainConfig), holding the
tables of elastic depth, distillation and the solve regularizers, which their own modules
define; and the flat names earlier versions gave those settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigError
from .any_depth import AnyDepthConfig
from .checks import _suggest, _validate
from .distill import DistillConfig
from .elastic import ElasticConfig
from .layer_skip import LayerSkipConfig
from .legacy import OLD_NAMES
from .regularize import RegularizeConfig

# The tables of [train], each owned by the module beside its dataclass.
TABLES = {"elastic": ElasticConfig, "distill": DistillConfig, "regularize": RegularizeConfig,
          "any_depth": AnyDepthConfig, "layer_skip": LayerSkipConfig}

# [train] keys as earlier versions spelled them, flat (config/legacy.py moves them)
LEGACY_TRAIN_KEYS = OLD_NAMES["train"]


@dataclass
class TrainConfig:
    """Optimization, logging and checkpointing."""

    run_config_section: ClassVar[bool] = True  # validated by name-keyed tables (checks.py)

    max_steps: int = 2000
    """Optimizer steps of the run (``--resume --set train.max_steps=N`` extends it)."""
    batch_size: int = 12
    """Sequences per micro-batch and process."""
    seq_len: int = 64
    """Tokens per training sequence (the context the model is trained at)."""
    lr: float = 1e-3
    """Peak learning rate of AdamW, reached after warmup_steps."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 100
    """Steps of linear warm-up from 0 to lr (one not below the decay's end is warned about at
    the start: it leaves no cosine decay)."""
    lr_decay_steps: int | None = None
    """The step at which the cosine decay (from lr, after the warm-up) reaches min_lr;
    defaults to max_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on every weight of two or more dimensions, the token embedding
    included (not on norms' gains, biases or other 1-D parameters)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.99
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (each backpropagates its own mean loss)."""
    eval_interval: int = 250
    """Steps between validation evaluations (each may save the best checkpoint)."""
    eval_iters: int = 20
    """Validation batches per evaluation (fixed windows spread over the split)."""
    log_interval: int = 10
    """Steps between training-metric log lines (loss, lr, grad norm, tokens/s, NFE)."""
    checkpoint_interval: int = 500
    """Steps between checkpoints (one is also written at the end and on SIGINT/SIGTERM)."""
    keep_checkpoints: int = 3
    """Newest step-* checkpoint folders kept (plus best)."""
    max_bad_steps: int = 5
    """Consecutive steps with a non-finite loss or gradient (each skipped) before training stops."""
    seed: int = 1337
    """Seeds the weights, the batch streams and dropout."""
    device: str = "auto"
    """"auto" (CUDA, else MPS, else CPU), "cpu", "cuda", "cuda:N" or "mps"."""
    dtype: str = "auto"
    """Autocast precision: "bf16"/"bfloat16", "fp16"/"float16" (with a gradient scaler),
    "fp32"/"float32", or "auto" (bf16 on CUDA, fp32 elsewhere). Weights, optimizer state and the
    ODE solvers' time variables stay fp32."""
    compile: bool = False
    """Compile the model with torch.compile (falls back to eager with one warning if it fails)."""
    threads: int | str = "auto"
    """Intra-op threads of the training process: "auto" takes the cores that other processes
    leave idle, looked at again every few seconds (continuumlm.threads: on a machine shared
    with other jobs, threads spinning at torch's barriers make small models 15-50x slower),
    or a fixed count. OMP_NUM_THREADS or a torch.set_num_threads call is kept under "auto";
    --threads N sets this key. Float rounding of reductions depends on the count, so a run that
    must repeat bit for bit names one."""
    keep_freed_memory: bool = True
    """CPU runs on Linux (glibc): keep freed memory in the process instead of handing every
    large block (above 32 MB: the logits, their gradients) back to the system at once, which
    makes each step fault those pages in again (bench/keep_freed_memory.py, 2 cores, one
    thread, the other core busy: configs/ptb_std's transformer 1.36x faster per step, its ODE
    model 1.14x, MQAR at 64 pairs 1.25x). The process holds on to its peak memory (5-11% more
    measured). Set once per process: false leaves the allocator as it is (in a process where
    an earlier run set it, it stays set)."""
    strategy: str = "ddp"
    """Under torchrun: "ddp" (replicated weights) or "fsdp" (FSDP2, sharded weights and state)."""
    requeue_signals: list[str] = dataclasses.field(
        default_factory=lambda: ["SIGUSR1", "SIGUSR2"])
    """Signals that a scheduler sends before it stops a job (SLURM: --signal=USR1@90): the run
    saves after the current step and exits with status 75, "requeue me". A signal left out
    keeps its default action (the process ends at once, without a checkpoint)."""
    checkpoint_minutes: float | None = None
    """Also save whenever this many minutes of wall time passed since the last save, so a
    hard kill loses at most that much (None: by step count only)."""
    dist_timeout_s: float = 600.0
    """Collective timeout under torchrun: a rank stuck this long fails the job instead of hanging."""
    elastic: ElasticConfig = dataclasses.field(default_factory=ElasticConfig)
    """[train.elastic]: elastic depth, the solves a step draws and the consistency term
    (config/elastic.py)."""
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    """[train.distill]: distillation from a trained teacher (config/distill.py)."""
    regularize: RegularizeConfig = dataclasses.field(default_factory=RegularizeConfig)
    """[train.regularize]: the solve's kinetic and Jacobian regularizers, the read-outs of
    intermediate steps and STEER (config/regularize.py)."""
    any_depth: AnyDepthConfig = dataclasses.field(default_factory=AnyDepthConfig)
    """[train.any_depth]: the coarse solves that learn from the model's own solve in the same
    step (config/any_depth.py)."""
    layer_skip: LayerSkipConfig = dataclasses.field(default_factory=LayerSkipConfig)
    """[train.layer_skip]: a discrete stack's layer dropout and early-exit loss, so that its
    first layers draft for it (config/layer_skip.py)."""

    def __post_init__(self) -> None:
        _validate(self, "train", skip=tuple(TABLES))
        from ..threads import parse_threads

        self.threads = parse_threads(self.threads, "train.threads")
        for name, klass in TABLES.items():
            value = getattr(self, name)
            if isinstance(value, dict):  # TrainConfig(**asdict(cfg)), a --set, JSON
                setattr(self, name, build_table(klass, value, f"train.{name}"))
            elif not isinstance(value, klass):
                raise ConfigError(f"[train.{name}] must be a table of key = value pairs, got "
                                  f"{type(value).__name__} {value!r}.")
        self.elastic.check_train(self)
        self.regularize.check_train(self)
        bad = [s for s in self.requeue_signals if s not in ("SIGUSR1", "SIGUSR2")]
        if bad:
            raise ConfigError(f"train.requeue_signals may list SIGUSR1 and SIGUSR2, got "
                              f"{bad[0]!r}; SIGINT and SIGTERM always stop a run (status 130 "
                              f"and 143).")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            raise ConfigError(f"train.checkpoint_minutes must be positive (or left out), got "
                              f"{self.checkpoint_minutes}.")


def build_table(klass, value: dict[str, Any], where: str):
    """One [train.NAME] table's dataclass from its dict, unknown keys refused by name."""
    known = {f.name for f in dataclasses.fields(klass)}
    for key in value:
        if key not in known:
            raise ConfigError(f"unknown key {where}.{key}{_suggest(key, known)}; valid keys of "
                              f"[{where}] are: {', '.join(sorted(known))}.")
    return klass(**value)
