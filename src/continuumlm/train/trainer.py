"""The training loop: data -> model -> AdamW -> metrics and checkpoints, resumable exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, dump_toml
from ..data import BatchSampler, Dataset, eval_batches, load_tokenizer, prepare_data
from ..errors import ConfigError, DataError
from ..model.lm import LanguageModel
from .checkpoint import (
    load_run_config,
    load_trainer_state,
    resolve_checkpoint,
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
            ckpt = resolve_checkpoint(self.out, "last")
            verify_checkpoint(ckpt)
            saved = load_run_config(ckpt)
            if cfg.model.vocab_size == 0:  # filled in from the tokenizer when the run started
                cfg.model = dataclasses.replace(cfg.model, vocab_size=saved.model.vocab_size)
            if saved.model != cfg.model or saved.data != cfg.data:
                raise ConfigError(
                    f"--resume: the [model] or [data] settings differ from those the run in "
                    f"{self.out} was started with; a resumed run may change only [train] keys "
                    f"(e.g. train.max_steps). Drop --config/--set for those sections.")
            tokenizer = load_tokenizer(ckpt)
            state = load_trainer_state(ckpt)
            self.resumed_from = ckpt
        elif (ckpt_root / "last").exists():
            raise ConfigError(f"{self.out} already holds a run (checkpoints/last); pass --resume to "
                              f"continue it, or choose another --out.")
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

        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.toml").write_text(dump_toml(cfg))
        self.logger = MetricsLogger(self.out, resume_step=self.step if resume else None)

    # ------------------------------------------------------------------ pieces

    def trainer_state(self) -> dict:
        state = {
            "step": self.step,
            "best_val": self.best_val,
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state_all()
        return state

    def save(self, best: bool = False) -> Path:
        return save_checkpoint(self.ckpt_root, self.step, self.model, self.tokenizer, self.cfg,
                               self.trainer_state(), best=best, keep=self.cfg.train.keep_checkpoints)

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
        for _ in range(t.grad_accum):
            x, y = self.sampler.next()
            x, y = x.to(self.device), y.to(self.device)
            with self.amp:
                _, loss = self.model(x, y)
                penalty = self.model.penalty()
                objective = loss + anneal * penalty
            (objective / t.grad_accum).backward()
            total += loss.item()
        self.last_penalty = penalty.item()
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total / t.grad_accum, grad_norm

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
                    say(f"step {self.step}: train loss {last_loss:.4f}, val loss {val:.4f} "
                        f"(ppl {math.exp(min(val, 50.0)):.2f})")
                    if improved and self.step > 0:
                        self.save(best=True)
                        saved_at = self.step
                    window_start = time.perf_counter()
                if self.step >= t.max_steps:
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
        finally:
            bar.close()
            self.logger.close()
        return {"step": self.step, "val_loss": last_val, "best_val_loss": self.best_val,
                "parameters": self.model.num_parameters(), "train_seconds": train_time,
                "tokens_per_s": tokens_per_step * steps_run / train_time if train_time else math.nan}
