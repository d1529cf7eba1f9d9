"""The training loop: data -> model -> AdamW -> metrics and checkpoints, resumable exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, dump_toml
from ..data import BatchSampler, Dataset, eval_batches, load_tokenizer, prepare_data
from ..errors import CheckpointError, ConfigError, DataError, TrainingError
from ..model.lm import LanguageModel
from ..ode import ODESolverError
from .checkpoint import (
    load_run_config,
    load_trainer_state,
    save_checkpoint,
    verify_checkpoint,
)
from .logging import MetricsLogger
from .optim import lr_at, make_optimizer


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'.")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("train.device = 'mps' but MPS is not available; use 'auto' or 'cpu'.")
    return torch.device(name)


def autocast_for(device: torch.device, dtype: str):
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate_loss(model: LanguageModel, data: torch.Tensor, seq_len: int, batch_size: int,
                  max_windows: int | None, device: torch.device, amp=None) -> float:
    """Mean cross-entropy (nats/token) over fixed, non-overlapping windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches(data, seq_len, batch_size, max_windows):
        with amp or contextlib.nullcontext():
            _, loss = model(x.to(device), y.to(device))
        total += loss.item() * y.numel()
        count += y.numel()
    model.train(was_training)
    return total / max(count, 1)


def find_resumable(out: Path, announce: bool = True):
    """(checkpoint folder, its run config, its trainer state) of the newest checkpoint in a run
    folder that passes its manifest and loads; damaged ones are skipped with a message."""
    root = Path(out) / "checkpoints"
    candidates = []
    if (root / "last").exists():
        candidates.append((root / "last").resolve())
    if root.is_dir():
        candidates += sorted((p.resolve() for p in root.glob("step-*") if p.is_dir()),
                             reverse=True)
    if not candidates:
        raise CheckpointError(f"--resume: {root} holds no checkpoint; start the run without "
                              f"--resume.")
    problems = []
    for ckpt in dict.fromkeys(candidates):
        try:
            verify_checkpoint(ckpt)
            saved = load_run_config(ckpt)
            state = load_trainer_state(ckpt)
            from safetensors import safe_open

            with safe_open(str(ckpt / "model.safetensors"), framework="pt"):
                pass
        except (CheckpointError, ConfigError, OSError, RuntimeError, ValueError) as e:
            problems.append(f"{ckpt.name}: {e}")
            if announce:
                print(f"warning: checkpoint {ckpt} is damaged ({e}); trying an older one",
                      file=sys.stderr)
            continue
        if problems and announce:
            print(f"resuming from {ckpt}, the newest intact checkpoint", file=sys.stderr)
        return ckpt, saved, state
    raise CheckpointError(f"--resume: no intact checkpoint in {root}: " + "; ".join(problems))


class Trainer:
    def __init__(self, cfg: RunConfig, out_dir: str | Path, resume: bool = False,
                 quiet: bool = False):
        self.out = Path(out_dir)
        self.quiet = quiet
        ckpt_root = self.out / "checkpoints"
        self.ckpt_root = ckpt_root
        state = None
        tokenizer = None
        if resume:
            ckpt, saved, state = find_resumable(self.out)
            if cfg.model.vocab_size == 0:  # filled in from the tokenizer when the run started
                cfg.model = dataclasses.replace(cfg.model, vocab_size=saved.model.vocab_size)
            if saved.model != cfg.model or saved.data != cfg.data:
                raise ConfigError(
                    f"--resume: the [model] or [data] settings differ from those the run in "
                    f"{self.out} was started with; a resumed run may change only [train] keys "
                    f"(e.g. train.max_steps). Drop --config/--set for those sections.")
            tokenizer = load_tokenizer(ckpt)
            self.resumed_from = ckpt
        elif (ckpt_root / "last").exists() or any(ckpt_root.glob("step-*")):
            raise ConfigError(f"{self.out} already holds a run (its checkpoints/); pass --resume "
                              f"to continue it, or choose another --out.")
        self.cfg = cfg
        t = cfg.train
        self.device = pick_device(t.device)
        self.amp = autocast_for(self.device, t.dtype)
        torch.manual_seed(t.seed)

        self.data: Dataset = prepare_data(cfg.data, tokenizer)
        self.tokenizer = self.data.tokenizer
        vocab = self.tokenizer.vocab_size
        if cfg.model.vocab_size == 0:
            cfg.model = dataclasses.replace(cfg.model, vocab_size=vocab)
        elif cfg.model.vocab_size != vocab:
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} but the tokenizer has "
                              f"{vocab} tokens; leave model.vocab_size at 0 to take it from the "
                              f"tokenizer (cap word/bpe vocabularies with data.vocab_size).")
        for split in ("train", "val"):
            n = len(self.data.splits[split])
            if n < t.seq_len + 1:
                raise DataError(f"the {split} split has {n} tokens, fewer than one window of "
                                f"train.seq_len + 1 = {t.seq_len + 1}; use a longer corpus or a "
                                f"shorter train.seq_len.")

        self.model = LanguageModel(cfg.model).to(self.device)
        self.optimizer = make_optimizer(self.model, t, self.device.type)
        self.sampler = BatchSampler(self.data.splits["train"], t.batch_size, t.seq_len, t.seed)
        self.step = 0
        self.best_val = math.inf
        if state is not None:
            from safetensors.torch import load_model

            load_model(self.model, str(self.resumed_from / "model.safetensors"),
                       device=str(self.device))
            self.optimizer.load_state_dict(state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["torch_rng"])
            if "cuda_rng" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda_rng"])
            self.step = int(state["step"])
            self.best_val = float(state["best_val"])
        self.bad_steps = 0
        self.skipped_steps = int(state.get("skipped_steps", 0)) if state is not None else 0
        self._stop_signal: str | None = None

        self._probe_writable()
        for stale in ckpt_root.glob(".tmp-*"):  # left by a crash while saving; never complete
            shutil.rmtree(stale, ignore_errors=True)
        (self.out / "config.toml").write_text(dump_toml(cfg))
        self.logger = MetricsLogger(self.out, resume_step=self.step if resume else None)

    def _install_signal_handlers(self) -> dict:
        """SIGINT/SIGTERM: finish the current step, save, exit cleanly. A second SIGINT stops
        at once (the last checkpoint stays intact)."""
        previous = {}

        def handler(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signal.Signals(signum).name

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: leave signals alone
                break
        return previous

    def _probe_writable(self) -> None:
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / f".write-probe-{os.getpid()}"
            with open(probe, "wb") as f:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as e:
            raise TrainingError(f"cannot write to the run folder {self.out} ({e.strerror or e}); "
                                f"free some space or choose a writable --out.") from None

    # ------------------------------------------------------------------ pieces

    def trainer_state(self) -> dict:
        state = {
            "step": self.step,
            "best_val": self.best_val,
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "skipped_steps": self.skipped_steps,
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, best: bool = False) -> Path:
        try:
            return save_checkpoint(self.ckpt_root, self.step, self.model, self.tokenizer,
                                   self.cfg, self.trainer_state(), best=best,
                                   keep=self.cfg.train.keep_checkpoints)
        except OSError as e:
            last = self.ckpt_root / "last"
            kept = f"the previous checkpoint {last.resolve()} is intact" if last.exists() else \
                "no earlier checkpoint exists"
            raise TrainingError(f"could not save the checkpoint of step {self.step} "
                                f"({e.strerror or e}); {kept}. Free disk space and resume with "
                                f"--resume.") from None

    def evaluate(self) -> float:
        t = self.cfg.train
        return evaluate_loss(self.model, self.data.splits["val"], t.seq_len, t.batch_size,
                             t.eval_iters * t.batch_size, self.device, self.amp)

    def train_step(self) -> tuple[float, float]:
        t = self.cfg.train
        lr = lr_at(self.step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = 0.0
        # regularizers (the continuous mixer's Sobolev term) are annealed as in CAT
        anneal = max(0.2, 1.0 - self.step / t.max_steps)
        solver_error = None
        for _ in range(t.grad_accum):
            x, y = self.sampler.next()
            x, y = x.to(self.device), y.to(self.device)
            try:
                with self.amp:
                    _, loss = self.model(x, y)
                    penalty = self.model.penalty()
                    objective = loss + anneal * penalty
                (objective / t.grad_accum).backward()
            except ODESolverError as e:  # an adaptive solve gave up: a bad step like a NaN
                solver_error = str(e)
                total = math.nan
                break
            total += loss.item()
        self.last_penalty = penalty.item() if solver_error is None else math.nan
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        loss_value = total / t.grad_accum
        if math.isfinite(loss_value) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.bad_steps = 0
        else:  # skip the update, keep the weights; stop after max_bad_steps in a row
            culprit = solver_error or self._first_non_finite(x, y, loss_value)
            self.bad_steps += 1
            self.skipped_steps += 1
            self.last_culprit = culprit
            if self.bad_steps >= t.max_bad_steps:
                last = self.ckpt_root / "last"
                kept = (f"the last good checkpoint is {last.resolve()}" if last.exists()
                        else "no checkpoint was written yet")
                raise TrainingError(
                    f"training diverged: {self.bad_steps} consecutive steps up to step "
                    f"{self.step + 1} had a non-finite loss or gradient (first non-finite "
                    f"tensor: {culprit}); {kept}. Lower train.lr, raise train.warmup_steps or "
                    f"check the data, then resume from it with --resume.")
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return loss_value, grad_norm

    @torch.no_grad()
    def _first_non_finite(self, x, y, loss_value: float) -> str:
        """Name the first non-finite tensor: a parameter's gradient, or (when the loss itself is
        not finite) the first depth block whose output is."""
        if math.isfinite(loss_value):
            for name, p in self.model.named_parameters():
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    return f"the gradient of {name}"
            return "the gradient norm"
        for name, p in self.model.named_parameters():
            if not torch.isfinite(p).all():
                return f"the parameter {name}"
        found: list[str] = []
        blocks = getattr(self.model.depth, "layers", None) or self.model.depth.blocks
        kind = "layer" if hasattr(self.model.depth, "layers") else "ODE block"

        def hook(i):
            def fn(module, inputs, output):
                if not found and not torch.isfinite(output).all():
                    found.append(f"the output state of {kind} {i}")
            return fn

        handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(blocks)]
        try:
            was_training = self.model.training
            self.model.eval()
            with self.amp:
                logits, _ = self.model(x, y)
            self.model.train(was_training)
        finally:
            for h in handles:
                h.remove()
        if found:
            return found[0]
        return "the loss" if torch.isfinite(logits).all() else "the logits"

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        t = self.cfg.train
        tty = sys.stdout.isatty() and not self.quiet
        bar = tqdm(total=t.max_steps, initial=self.step, disable=not tty, dynamic_ncols=True,
                   file=sys.stdout)
        say = (lambda msg: bar.write(msg)) if tty else (lambda msg: None if self.quiet else print(msg, flush=True))
        tokens_per_step = t.batch_size * t.seq_len * t.grad_accum
        if self.step == 0:
            say(f"training {self.model.num_parameters():,} parameters on {self.device.type}; "
                f"{tokens_per_step} tokens per step; run folder {self.out}")
        else:
            say(f"resuming at step {self.step} from {self.resumed_from}")
        last_val = math.nan
        window_start, window_steps = time.perf_counter(), 0
        train_time, steps_run, saved_at = 0.0, 0, None
        last_loss = math.nan
        previous_handlers = self._install_signal_handlers()
        interrupted = None
        try:
            while True:
                if self.step % t.eval_interval == 0 or self.step >= t.max_steps:
                    val = self.evaluate()
                    last_val = val
                    improved = val < self.best_val
                    if improved:
                        self.best_val = val
                    self.logger.log({"step": self.step, "val_loss": val,
                                     "val_ppl": math.exp(min(val, 50.0)), "lr": lr_at(self.step, t)})
                    train_part = "" if math.isnan(last_loss) else f"train loss {last_loss:.4f}, "
                    say(f"step {self.step}: {train_part}val loss {val:.4f} "
                        f"(ppl {math.exp(min(val, 50.0)):.2f})")
                    if improved and self.step > 0:
                        self.save(best=True)
                        saved_at = self.step
                    window_start = time.perf_counter()
                if self.step >= t.max_steps:
                    break
                if self._stop_signal is not None:
                    interrupted = self._stop_signal
                    break
                t0 = time.perf_counter()
                loss, grad_norm = self.train_step()
                train_time += time.perf_counter() - t0
                steps_run += 1
                last_loss = loss
                window_steps += 1
                bar.update(1)
                if self.step % t.log_interval == 0 or self.step == t.max_steps:
                    elapsed = time.perf_counter() - window_start
                    tps = tokens_per_step * window_steps / max(elapsed, 1e-9)
                    self.logger.log({"step": self.step, "loss": loss, "lr": lr_at(self.step - 1, t),
                                     "grad_norm": grad_norm, "tokens_per_s": tps,
                                     "nfe": self.model.last_nfe, "penalty": self.last_penalty})
                    bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr_at(self.step - 1, t):.2e}",
                                    tok_s=f"{tps:.0f}")
                    window_start, window_steps = time.perf_counter(), 0
                if self.step % t.checkpoint_interval == 0 and self.step < t.max_steps:
                    self.save()
                    saved_at = self.step
            if saved_at != self.step:
                self.save()
            if interrupted:
                say(f"{interrupted}: saved a checkpoint at step {self.step}; continue with "
                    f"`continuumlm train --out {self.out} --resume`")
        finally:
            for sig, handler in previous_handlers.items():
                signal.signal(sig, handler)
            bar.close()
            self.logger.close()
        return {"step": self.step, "val_loss": last_val, "interrupted": interrupted,
                "skipped_steps": self.skipped_steps, "best_val_loss": self.best_val,
                "parameters": self.model.num_parameters(), "train_seconds": train_time,
                "tokens_per_s": tokens_per_step * steps_run / train_time if train_time else math.nan}
