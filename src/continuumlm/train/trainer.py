"""The training loop: data -> model -> AdamW -> metrics and checkpoints, resumable exactly."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, dump_toml
from ..data.batches import stream_seed
from ..errors import (
    ConfigError,
    DiskError,
    TrainingError,
)
from ..model.lm import LanguageModel, check_memory
from ..ode import ODESolverError, solver_errors
from ..runs.checkpoint import SHARDS_DIR
from ..runs.folder import CONFIG, LAST, continue_command, disk_error
from ..threads import ThreadPolicy
from . import distributed as D
from .checkpointer import Checkpointer
from .device import (  # noqa: F401 - pick_device: public here too
    CompiledOrEager,
    autocast_for,
    keep_freed_memory,
    pick_device,
    resolve_dtype,
)
from .diagnose import first_non_finite
from .evaluation import evaluate_loss  # noqa: F401 - public here too
from .logging import MetricsLogger, NullLogger, ProgressLines
from .objective import StepObjective
from .optim import lr_at, make_optimizer, moved_horizon_warning, schedule_warnings
from .resume import find_resumable, open_run_folder  # noqa: F401 - find_resumable: public here
from .signals import StopSignals
from .stateful import (
    BatchStreams,
    Keyed,
    Progress,
    RandomState,
    load_weights,
    restore,
    sharded_checkpoint,
)
from .tasks import Evaluation, language_modeling


class Trainer:
    """Trains ``cfg.model`` on a task (``task``: called as task(cfg, out, resumed_from, state)
    once the run folder is open, and naming the task in ``task.name``; next-token prediction
    on ``[data]`` by default, see :mod:`continuumlm.train.tasks`)."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, resume: bool = False,
                 quiet: bool = False, task=language_modeling):
        self.out = Path(out_dir)
        self.quiet = quiet
        # made first, so that its first look at the machine spans the set-up below
        self.threads = ThreadPolicy(cfg.train.threads, "training")
        state, self.resumed_from = open_run_folder(cfg, self.out, resume, task.name)
        cfg.check_trainable()
        self.cfg = cfg
        t = cfg.train
        self.dist, device_name = D.setup(t.device, t.dist_timeout_s)
        self.checkpointer = Checkpointer(self.out, t, self.dist,
                                         fsdp=t.strategy == "fsdp" and self.dist.enabled)
        self.ckpt_root = self.checkpointer.root
        self.main = self.dist.is_main
        for warning in schedule_warnings(t) if self.main else ():
            print(warning, file=sys.stderr)
        self.device = pick_device(device_name)
        self.checkpointer.device = self.device
        self.amp = autocast_for(self.device, t.dtype)
        self.fsdp = self.checkpointer.fsdp
        torch.manual_seed(t.seed)  # the same initial weights on every rank

        self.task = task(cfg, self.out, self.resumed_from, state)
        self.checkpointer.task = self.task.name
        self.tokenizer = self.task.tokenizer

        # self.model is the LanguageModel itself (what checkpoints save: never a wrapper's
        # "module." or torch.compile's "_orig_mod." names); self.wrapped adds DDP/FSDP and
        # self.forward is what the training step calls (compiled when train.compile is on).
        check_memory(cfg.model, self.device, training=True,
                     shards=self.dist.world_size if self.fsdp else 1,
                     copies=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                     if self.device.type == "cpu" else 1)
        self.model = LanguageModel(cfg.model).to(self.device)
        # after the data is prepared (its worker pool and buffers keep the system's malloc)
        if t.keep_freed_memory and self.device.type == "cpu" and not keep_freed_memory() \
                and sys.platform.startswith("linux") and self.main and not quiet:
            print("note: train.keep_freed_memory could not be applied (this process's C "
                  "library has no glibc mallopt, or it refused the settings); training is "
                  "unchanged, only slower where large tensors are freed every step.",
                  file=sys.stderr)
        sharded = state is not None and sharded_checkpoint(self.resumed_from, self.fsdp,
                                                           t.strategy)
        if state is not None and not sharded:
            load_weights(self.model, self.resumed_from, self.device)
        self.wrapped = D.wrap(self.model, t.strategy, self.dist, self.device)
        self.forward = CompiledOrEager(self.wrapped) if t.compile else self.wrapped
        self.optimizer = make_optimizer(self.model, t, self.device.type)
        # the loss and the terms of [train.elastic], [train.distill] and [train.regularize]
        self.objective = StepObjective(self.model, t, self.tokenizer, self.device, state)
        self.scaler = torch.amp.GradScaler(
            self.device.type, enabled=resolve_dtype(self.device, t.dtype) == "float16")
        self.sampler = self.task.sampler(t, self.dist)
        if self.dist.rank > 0:  # dropout masks differ between ranks
            torch.manual_seed(stream_seed(t.seed, 10**6 + self.dist.rank))
        self.progress = Progress()
        self.rng = RandomState(self.dist, self.device)
        if state is not None:
            if sharded:  # the weights and the optimizer state
                self._load_shards(self.resumed_from / SHARDS_DIR)
            restore({"batch streams": BatchStreams(self.sampler, self.dist.world_size,
                                                   t.grad_accum, self.resumed_from),
                     **({} if sharded else {"optimizer": Keyed(self.optimizer, "optimizer")}),
                     "random generators": self.rng,
                     **({"gradient scaler": Keyed(self.scaler, "scaler", optional=True)}
                        if self.scaler.is_enabled() else {}),
                     "progress": self.progress}, state, self.resumed_from)
            if t.max_steps < self.step:
                raise ConfigError(
                    f"--resume: {self.resumed_from} is at step {self.step}, past train.max_steps "
                    f"= {t.max_steps}; raise train.max_steps (e.g. --set train.max_steps="
                    f"{self.step * 2}) to train further.")
            if t.lr_decay_steps is None and self.dist.is_main:
                from ..runs.checkpoint import load_run_config

                moved = moved_horizon_warning(load_run_config(self.resumed_from).train, t,
                                              self.step)
                if moved:
                    print(moved, file=sys.stderr, flush=True)
        self.signals = StopSignals(requeue=t.requeue_signals)
        self.log_failure: DiskError | None = None
        self.evaluator = self.task.evaluator(t, self.device, self.amp, self.dist, self.fsdp)

        if self.main:
            self.checkpointer.prepare()
            # The loop evaluates at its first step only on an eval_interval multiple or at the
            # end; otherwise an evaluation logged at the resume step (a finished run's last one,
            # now extended) stays: it scored the very weights resumed from.
            redo = self.evaluator.due(self.step)
            self.logger = MetricsLogger(self.out, resume_step=self.step if resume else None,
                                        keep_resume_evaluation=not redo, task=self.task.name)
            try:  # once nothing else can fail
                (self.out / CONFIG).write_text(dump_toml(cfg))
            except OSError as e:
                raise disk_error(CONFIG, self.out / CONFIG, e, self.out,
                                 task=self.task.name) from None
        else:
            self.logger = NullLogger()
        self.dist.barrier()

    def _load_shards(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from ..runs.checkpoint import load_shards

        msd, osd = get_state_dict(self.model, self.optimizer)
        load_shards({"model": msd, "optimizer": osd}, path)
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)

    # ------------------------------------------------------------------ pieces

    @property
    def compile_error(self) -> str | None:
        """Why torch.compile fell back to eager, if it did."""
        return getattr(self.forward, "error", None)

    # where the run is (train/stateful.Progress, what a checkpoint restores)
    step = property(lambda self: self.progress.step,
                    lambda self, v: setattr(self.progress, "step", v))
    best_val = property(lambda self: self.progress.best_val,
                        lambda self, v: setattr(self.progress, "best_val", v))
    bad_steps = property(lambda self: self.progress.bad_steps,
                         lambda self, v: setattr(self.progress, "bad_steps", v))
    skipped_steps = property(lambda self: self.progress.skipped_steps,
                             lambda self, v: setattr(self.progress, "skipped_steps", v))

    def trainer_state(self) -> dict:
        """Everything but the weights; a collective under torchrun (every rank's batch streams
        and RNG state are gathered so that each rank resumes its own)."""
        # each rank's own batch streams and generators (CUDA's too: it draws that rank's
        # dropout masks on a GPU), in one collective
        per_rank = self.dist.gather((self.sampler.state_dict(), self.rng.local()))
        state = {
            **self.progress.state_dict(),
            "sampler": self.task.merge_sampler_states([s for s, _ in per_rank]),
            **RandomState.state_dict([rng for _, rng in per_rank]),
            "world_size": self.dist.world_size,
            "task": {"name": self.task.name, **self.task.state()},
            **self.task.trainer_state(),
            **self.objective.state(),
        }
        if not self.fsdp:  # FSDP keeps the optimizer state in the shards
            state["optimizer"] = self.optimizer.state_dict()
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        return state

    def _backward_nfe(self) -> dict:
        """An ODE model's field evaluations in its last backward pass (the adjoint's backward
        solve, or checkpointed steps recomputed), logged beside the forward's ``nfe``."""
        if self.model.config.depth != "ode":
            return {}
        return {"nfe_backward": self.model.last_backward_nfe}

    def _log(self, event: dict) -> None:
        """Log on rank 0; a failed write is kept and stops the run at the next step boundary,
        where every rank learns of it (the others would wait in a collective otherwise)."""
        if self.log_failure is not None:
            return
        try:
            self.logger.log(event)
        except DiskError as e:
            self.log_failure = e
            if not self.dist.enabled:
                raise

    def save(self, best: bool = False, evaluated: bool = False) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; every rank must call this);
        ``evaluated``: right after the step's evaluation, for a task that records from it."""
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.tokenizer,
                                      self.cfg, self.trainer_state(), best=best,
                                      evaluated=evaluated)

    def evaluate(self) -> Evaluation:
        return self.evaluator(self.model)

    def train_step(self) -> tuple[float, float]:
        with self.objective.at(self.step) as draw:
            return self._train_step(draw)

    def _train_step(self, draw: tuple[str, int] | None) -> tuple[float, float]:
        """One optimizer step; ``draw``: the (solver, steps) elastic training drew for it."""
        t = self.cfg.train
        lr = lr_at(self.step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The step's metrics stay on the device until one read after clipping: a .item() per
        # micro-batch, the penalty and the gradient norm each made the host wait for the GPU.
        terms = self.objective
        terms.begin()
        # regularizers (the continuous mixer's Sobolev term) are annealed as in CAT, over the
        # learning rate's decay horizon (so extending a run with a fixed lr_decay_steps keeps it)
        anneal = max(0.2, 1.0 - self.step / (t.lr_decay_steps or t.max_steps))
        solver_error = None
        for j in range(t.grad_accum):
            x, y = self.sampler.next(j)
            x, y = x.to(self.device), y.to(self.device)
            try:
                # gradients are all-reduced only on the last micro-step
                with D.no_grad_sync(self.wrapped, self.model, sync=j == t.grad_accum - 1):
                    with self.amp:
                        loss, penalty, objective = terms.micro_batch(
                            self.task, self.forward, x, y, draw, self.step, anneal)
                    # Each micro-batch backpropagates its own mean loss; the sum is divided by
                    # grad_accum below. Scaling the loss instead would change the gradient an
                    # adaptive adjoint solve sees (its atol is absolute), so grad_accum and the
                    # number of processes would change the gradients themselves.
                    with solver_errors():  # an adjoint's backward solve runs in here
                        self.scaler.scale(objective).backward()
            except ODESolverError as e:  # an adaptive solve gave up: a bad step like a NaN
                if self.dist.enabled:  # the other ranks wait in the gradient all-reduce
                    raise TrainingError(f"rank {self.dist.rank}, step {self.step + 1}: {e}") from None
                solver_error = str(e)
                terms.failed()
                break
            terms.add_loss(loss)
        if self.dist.enabled:  # on the device: no wait for the host
            terms.all_reduce(self.dist)
        if t.grad_accum > 1:
            with torch.no_grad():
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.div_(t.grad_accum)
        self.scaler.unscale_(self.optimizer)
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
            grad_norm = grad_norm.full_tensor()
        # the step's one host synchronisation: whether to apply the update depends on it
        # (with no gradient at all, e.g. a solver error in the first micro-batch, the norm is
        # a CPU zero: hence the device too)
        loss_value, grad_norm = terms.read(penalty if solver_error is None else None,
                                           grad_norm, t.grad_accum)
        # read before a bad step's diagnostic forward (first_non_finite) overwrites them
        self.last_step_nfe = {"nfe": self.model.last_nfe, **self._backward_nfe()}
        # fp16: an overflowing gradient is the scaler's business (it skips and lowers the scale)
        scaler_skips = self.scaler.is_enabled() and math.isfinite(loss_value)
        if math.isfinite(loss_value) and (math.isfinite(grad_norm) or scaler_skips):
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.bad_steps = 0
        else:  # skip the update, keep the weights; stop after max_bad_steps in a row
            if self.scaler.is_enabled():
                # unscale_ ran this step: without an update() the next step's unscale_ raises.
                # A new scale, since a step that failed before any backward recorded no inf
                # checks for a plain update(); lowered as the scaler would for an overflow
                self.scaler.update(new_scale=self.scaler.get_scale()
                                   * self.scaler.get_backoff_factor())
            culprit = solver_error or first_non_finite(self.model, self.amp, x, y, loss_value)
            self.bad_steps += 1
            self.skipped_steps += 1
            self.last_culprit = culprit
            if self.bad_steps >= t.max_bad_steps:
                last = self.ckpt_root / LAST
                kept = (f"the last good checkpoint is {last.resolve()}" if last.exists()
                        else "no checkpoint was written yet")
                error = TrainingError(
                    f"training diverged: {self.bad_steps} consecutive steps up to step "
                    f"{self.step + 1} had a non-finite loss or gradient (first non-finite "
                    f"tensor: {culprit}); {kept}. Lower train.lr, raise train.warmup_steps or "
                    f"check the data, then resume from it with --resume.")
                # decided on the all-reduced loss and gradient norm: every rank stops here
                error.collective = True
                raise error
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, grad_norm

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        t = self.cfg.train
        quiet = self.quiet or not self.main  # only rank 0 speaks
        tty = sys.stdout.isatty() and not quiet
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not tty, dynamic_ncols=True,
                   file=sys.stdout)
        say = (lambda msg: bar.write(msg)) if tty else (lambda msg: None if quiet else print(msg, flush=True))
        world = self.dist.world_size
        tokens_per_step = t.batch_size * self.task.seq_len * t.grad_accum * world
        if self.dist.enabled:
            say(f"{world} processes ({self.cfg.train.strategy}, "
                f"{'nccl' if self.device.type == 'cuda' else 'gloo'}); effective batch = "
                f"batch_size {t.batch_size} x grad_accum {t.grad_accum} x world_size {world} = "
                f"{t.batch_size * t.grad_accum * world} sequences")
        threads = self.threads.apply()
        if self.step == 0:
            say(f"training {self.model.num_parameters():,} parameters on {self.device.type}, "
                f"{threads}; {tokens_per_step} tokens per step; run folder {self.out}")
        else:
            say(f"resuming at step {self.step} from {self.resumed_from}; {threads}")
        # away from a terminal (a log file, CI) a line at a steady interval stands in for the bar
        progress = None if tty or quiet else ProgressLines(t.max_steps, self.step)
        last_val = last_loss = math.nan
        window_start, window_steps = time.perf_counter(), 0
        train_time, steps_run = 0.0, 0
        # a resumed run's checkpoint is at its first step already
        self.checkpointer.saved_at = self.step if self.resumed_from is not None else None
        self.signals.install()
        interrupted, finished, reached = None, False, False
        try:
            while True:
                # each step: evaluate when due, save when due (once per step: saving a step
                # twice would replace the folder `last` points at), stop when asked, train
                paused = time.perf_counter()
                improved = evaluated = reached = False
                if self.evaluator.due(self.step):
                    ev = self.evaluate()
                    last_val, evaluated, reached = ev.score, True, ev.stop
                    improved = ev.score < self.best_val
                    self.best_val = min(self.best_val, ev.score)
                    # eval_s: how long the evaluation took (sizing a run to a budget needs it)
                    self._log({"step": self.step, **ev.fields,
                               "eval_s": round(time.perf_counter() - paused, 4)})
                    train_part = "" if math.isnan(last_loss) else f"train loss {last_loss:.4f}, "
                    say(f"step {self.step}: {train_part}{ev.text}")
                    self.task.on_evaluation(self, ev)  # the task's state, before it is saved
                each = evaluated and self.task.checkpoint_each_evaluation and self.step > 0
                if self.checkpointer.due(self.step, improved) or (
                        each and self.checkpointer.saved_at != self.step):
                    self.save(best=improved and self.step > 0, evaluated=each)
                if evaluated and self.main:  # after the save: a record never runs ahead of it
                    self.task.record(self)
                # the throughput window counts training only: move its start past the pause
                window_start += time.perf_counter() - paused
                if self.step >= t.max_steps or reached:
                    break
                # all ranks alike; a metrics write that failed on rank 0 stops every rank
                interrupted = self.signals.agreed_stop(self.dist, self.device,
                                                       fault=self.log_failure is not None)
                if interrupted == "fault":
                    failure = self.log_failure or DiskError(
                        "rank 0 could not write the run's metrics (its message says why); the "
                        "run stops on every rank.")
                    failure.collective = True
                    raise failure
                if interrupted:
                    break
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step()
                train_time += time.perf_counter() - t0
                steps_run += 1
                last_loss = loss
                window_steps += 1
                bar.update(1)
                self.threads.poll()
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    elapsed = time.perf_counter() - window_start
                    tps = tokens_per_step * window_steps / max(elapsed, 1e-9)
                    self._log({"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, t),
                                     "grad_norm": grad_norm, "tokens_per_s": tps,
                                     "penalty": self.objective.penalty, **self.last_step_nfe,
                                     **self.objective.fields(self.step)})
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr_at(self.step - 1, t):.2e}",
                                    tok_s=f"{tps:.0f}", threads=self.threads.choice.threads)
                    window_start, window_steps = time.perf_counter(), 0
                    if progress is not None:
                        progress.update(self.step, loss, tps, self.threads.choice.threads)
            if self.checkpointer.saved_at != self.step:  # the last step, or where a signal stopped
                self.save()
            if interrupted:
                say(f"{interrupted}: saved a checkpoint at step {self.step}; continue with "
                    f"{continue_command(self.task.name, self.out)}")
            finished = True
        finally:
            self.signals.restore()
            bar.close()
            try:
                self.logger.close()
            except DiskError:
                if finished:  # else the error already on its way says more
                    raise
        summary = {"step": self.step, "val_loss": last_val, "interrupted": interrupted,
                "skipped_steps": self.skipped_steps, "best_val_loss": self.best_val,
                "parameters": self.model.num_parameters(), "train_seconds": train_time,
                "compiled": bool(t.compile) and self.compile_error is None,
                "compile_error": self.compile_error,
                "tokens_per_s": tokens_per_step * steps_run / train_time if train_time else math.nan,
                "stopped_early": reached and self.step < t.max_steps,
                "threads": self.threads.choice.threads if self.threads.choice else None}
        if self.main:
            self.task.on_end(self, summary)
        return summary
