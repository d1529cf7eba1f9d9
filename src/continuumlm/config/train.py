"""[train]: the optimization, schedule, evaluation, checkpoints and the options of elastic depth,
distillation and the solve regularizers (TrainConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from .checks import _validate


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
    ode_steps_choices: list[int] | None = None
    """Elastic depth (ODE models): each optimizer step integrates with a step count drawn from
    this list, seeded by train.seed and the step (a resumed run and every rank draw alike);
    every entry is equally likely, so a count listed twice is drawn twice as often;
    evaluation and checkpoints keep model.ode_steps."""
    ode_solver_choices: list[str] | None = None
    """... and with a fixed-grid solver drawn from this list (model.ode_solver if unset)."""
    ode_max_nfe: int | None = None
    """With ode_steps_choices / ode_solver_choices: draw only the (solver, steps) pairs whose
    solve takes at most this many field evaluations (RK4 x 16 is 64), every allowed pair
    equally likely (each entry of the lists counted as listed); the consistency term's finer
    solve is the next larger step count within the cap too. None: solver and step count drawn
    independently from the two lists."""
    consistency_weight: float = 0.0
    """With ode_steps_choices: add this weight times KL(finer || drawn) of the next-token
    distributions, the finer solve being the next larger step count of the choices on the same
    batch (no gradient, dropout off); logged as "consistency" on the steps that have it."""
    consistency_max_nfe: int | None = None
    """With ode_max_nfe and the consistency term: the finer solve may take up to this many
    field evaluations (at least ode_max_nfe; None: ode_max_nfe), e.g. 64 so that a drawn
    RK4 x 8 is pulled toward RK4 x 16 although RK4 x 16 itself is never drawn. The finer solve
    runs without gradients, so it costs about a third of a drawn solve of its size."""
    elastic_from: int = 0
    """With ode_steps_choices / ode_solver_choices: the first optimizer step (counted from 0)
    that draws; every step before it integrates with model.ode_solver and model.ode_steps and
    has no consistency term. A fixed-trained run made elastic for its last
    max_steps - elastic_from steps; the draws from there on are the ones a run with 0 makes."""
    distill_from: str | None = None
    """Distillation: a trained run folder (its last checkpoint) or checkpoint folder whose model
    is the teacher. Each micro-batch adds train.distill_weight times KL(teacher || model) of the
    next-token distributions (the teacher in eval mode, without gradients, at its own solver
    and step count), logged as "distill". The teacher must have this run's tokenizer; its
    weights' digest is saved with the run, and a resume refuses a teacher that changed. With
    elastic depth, a fixed-trained teacher pulls every drawn solve toward one good solution."""
    distill_weight: float = 0.0
    """The weight of the distillation term (with train.distill_from)."""
    consistency_every: int = 1
    """Add the consistency term on every N-th optimizer step only (steps 0, N, 2N, ...): its
    finer solve is an extra forward pass, so N = 2 halves what the term costs."""
    kinetic_weight: float = 0.0
    """ODE models: add this weight times the kinetic energy of the solve, the integral of
    ||f||^2 / hidden_size over t per token, averaged (Finlay et al. 2020): straighter
    trajectories that adaptive solvers take in fewer steps. Adaptive solvers only (a fixed
    grid takes the same steps whatever the field). Logged as "kinetic"."""
    jacobian_weight: float = 0.0
    """ODE models: add this weight times the integral of ||df/dh||_F^2 / hidden_size along the
    solve, estimated with one Gaussian probe per forward (Hutchinson; one extra
    vector-Jacobian product per evaluation). Adaptive solvers only, as kinetic_weight.
    Logged as "jacobian"."""
    step_readout_weight: float = 0.0
    """ODE models with a fixed-grid solver: add this weight times the mean cross-entropy of the
    read-out (final norm + head) of every intermediate solver step's state, in every block
    (deep supervision along depth: a solve that is good at every step, which per-token exit,
    eval --exit-threshold, needs). Needs model.ode_grad = "direct" or "checkpoint" and at
    least two steps. Logged as "step_readout"."""
    steer: float = 0.0
    """ODE models: STEER (Ghosh et al. 2020) draws each training step's end time uniformly from
    [ode_t1 - steer, ode_t1 + steer] (from the seed and the step, so a resumed run and every
    rank draw alike); evaluation integrates to ode_t1. Must be below ode_t1 - ode_t0."""

    def __post_init__(self) -> None:
        _validate(self, "train")
        from ..threads import parse_threads

        self.threads = parse_threads(self.threads, "train.threads")
        for name in ("ode_steps_choices", "ode_solver_choices"):
            v = getattr(self, name)
            if v is not None and not v:
                raise ConfigError(f"train.{name} is empty; list at least one value, or leave "
                                  f"it out.")
        if self.ode_steps_choices is not None and not all(
                isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 10_000
                for n in self.ode_steps_choices):
            raise ConfigError(f"train.ode_steps_choices must list positive integers (up to "
                              f"10000), got {self.ode_steps_choices}.")
        for name in ("kinetic_weight", "jacobian_weight", "steer", "step_readout_weight"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}.")
        if not self.consistency_weight >= 0:
            raise ConfigError(f"train.consistency_weight must be >= 0, got "
                              f"{self.consistency_weight}.")
        if self.ode_max_nfe is not None and not (
                isinstance(self.ode_max_nfe, int) and not isinstance(self.ode_max_nfe, bool)
                and self.ode_max_nfe >= 1):
            raise ConfigError(f"train.ode_max_nfe must be a positive integer (or left out), "
                              f"got {self.ode_max_nfe!r}.")
        if self.ode_max_nfe is not None and not (self.ode_steps_choices
                                                 or self.ode_solver_choices):
            raise ConfigError("train.ode_max_nfe caps the solves that elastic training draws; "
                              "set train.ode_steps_choices (and/or ode_solver_choices), or "
                              "leave it out.")
        if self.consistency_max_nfe is not None:
            if self.ode_max_nfe is None or not self.consistency_weight > 0:
                raise ConfigError("train.consistency_max_nfe caps the consistency term's finer "
                                  "solve beyond train.ode_max_nfe: set both ode_max_nfe and "
                                  "consistency_weight > 0, or leave it out.")
            if not (isinstance(self.consistency_max_nfe, int)
                    and not isinstance(self.consistency_max_nfe, bool)
                    and self.consistency_max_nfe >= self.ode_max_nfe):
                raise ConfigError(f"train.consistency_max_nfe must be an integer at least "
                                  f"train.ode_max_nfe ({self.ode_max_nfe}), got "
                                  f"{self.consistency_max_nfe!r}.")
        if not (isinstance(self.elastic_from, int) and not isinstance(self.elastic_from, bool)
                and self.elastic_from >= 0):
            raise ConfigError(f"train.elastic_from must be an integer >= 0 (the first optimizer "
                              f"step that draws a solve), got {self.elastic_from!r}.")
        if self.elastic_from and not (self.ode_steps_choices or self.ode_solver_choices):
            raise ConfigError("train.elastic_from is the step where elastic training starts; "
                              "set train.ode_steps_choices (and/or ode_solver_choices), or "
                              "leave it out.")
        if self.elastic_from and self.elastic_from >= self.max_steps:
            raise ConfigError(f"train.elastic_from ({self.elastic_from}) is not below "
                              f"train.max_steps ({self.max_steps}): no step would draw. Lower "
                              f"it, or leave out the elastic settings for a fixed-step run.")
        if not self.distill_weight >= 0:
            raise ConfigError(f"train.distill_weight must be >= 0, got {self.distill_weight}.")
        if (self.distill_from is None) != (self.distill_weight == 0):
            raise ConfigError(
                "train.distill_from (the teacher's run or checkpoint folder) and "
                "train.distill_weight (> 0) go together: set both to distill, or neither "
                f"(got distill_from = {self.distill_from!r}, distill_weight = "
                f"{self.distill_weight}).")
        if not (isinstance(self.consistency_every, int) and self.consistency_every >= 1):
            raise ConfigError(f"train.consistency_every must be a positive integer (1: every "
                              f"step), got {self.consistency_every!r}.")
        if self.consistency_weight > 0 and len(set(self.ode_steps_choices or [])) < 2:
            raise ConfigError("train.consistency_weight pulls a coarse solve toward a finer one: "
                              "it needs train.ode_steps_choices with at least two step counts.")
        bad = [s for s in self.requeue_signals if s not in ("SIGUSR1", "SIGUSR2")]
        if bad:
            raise ConfigError(f"train.requeue_signals may list SIGUSR1 and SIGUSR2, got "
                              f"{bad[0]!r}; SIGINT and SIGTERM always stop a run (status 130 "
                              f"and 143).")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes > 0:
            raise ConfigError(f"train.checkpoint_minutes must be positive (or left out), got "
                              f"{self.checkpoint_minutes}.")
