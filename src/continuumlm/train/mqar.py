"""Train and evaluate a model on multi-query associative recall (``continuumlm mqar``).

A fixed training set is sampled once from a seeded generator and visited in shuffled epochs;
recall accuracy is measured on a held-out set drawn from a different seed. Results go to
``metrics.jsonl`` and ``result.json`` in the run folder.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import RunConfig, dump_toml
from ..data.mqar import mqar_batch, recall_accuracy
from ..model.lm import LanguageModel
from .logging import MetricsLogger
from .optim import lr_at, make_optimizer
from .trainer import pick_device


def run_mqar(cfg: RunConfig, out: str | Path, quiet: bool = False) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t, q = cfg.train, cfg.mqar
    cfg.model = dataclasses.replace(cfg.model, vocab_size=q.vocab_size,
                                    max_seq_len=max(cfg.model.max_seq_len, q.seq_len))
    (out / "config.toml").write_text(dump_toml(cfg))
    device = pick_device(t.device)
    torch.manual_seed(t.seed)
    train_x, train_y = mqar_batch(q.train_examples, q.vocab_size, q.seq_len, q.num_kv_pairs,
                                  q.power_a, torch.Generator().manual_seed(t.seed))
    test_x, test_y = mqar_batch(q.test_examples, q.vocab_size, q.seq_len, q.num_kv_pairs,
                                q.power_a, torch.Generator().manual_seed(t.seed + 10_000))
    model = LanguageModel(cfg.model).to(device)
    opt = make_optimizer(model, t, device.type)
    order = torch.Generator().manual_seed(t.seed + 1)
    perm, cursor = torch.randperm(q.train_examples, generator=order), 0
    logger = MetricsLogger(out, tensorboard=False)
    tty = sys.stdout.isatty() and not quiet
    bar = tqdm(total=t.max_steps, disable=not tty, file=sys.stdout)
    acc, best, start = 0.0, 0.0, time.perf_counter()
    for step in range(t.max_steps):
        if cursor + t.batch_size > q.train_examples:
            perm, cursor = torch.randperm(q.train_examples, generator=order), 0
        idx = perm[cursor:cursor + t.batch_size]
        cursor += t.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        _, loss = model(train_x[idx].to(device), train_y[idx].to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        bar.update(1)
        if (step + 1) % t.log_interval == 0:
            logger.log({"step": step + 1, "loss": loss.item(), "lr": lr_at(step, t)})
        if (step + 1) % t.eval_interval == 0 or step + 1 == t.max_steps:
            acc = recall_accuracy(model, test_x.to(device), test_y.to(device))
            best = max(best, acc)
            logger.log({"step": step + 1, "val_loss": float("nan"), "accuracy": acc})
            msg = f"step {step + 1}: loss {loss.item():.4f}, recall accuracy {acc:.4f}"
            bar.write(msg) if tty else (None if quiet else print(msg, flush=True))
    bar.close()
    logger.close()
    result = {"accuracy": acc, "best_accuracy": best, "steps": t.max_steps,
              "parameters": model.num_parameters(), "seconds": time.perf_counter() - start,
              "mixer": cfg.model.mixer, "depth": cfg.model.depth,
              "num_kv_pairs": q.num_kv_pairs, "seq_len": q.seq_len}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
