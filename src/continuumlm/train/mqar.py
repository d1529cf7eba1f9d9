"""Train and evaluate a model on multi-query associative recall (``continuumlm mqar``).

A fixed training set is sampled once from a seeded generator and visited in shuffled epochs;
recall accuracy is measured on a held-out set drawn from a different seed. Results go to
``metrics.jsonl`` and ``result.json`` in the run folder.

The loss is the cross-entropy at the query positions only (every other target is ignored), so
the output layer is applied to those positions alone: the same loss as a full forward at a
fraction of the vocabulary-sized work. The run saves ``state.pt`` at every evaluation; running
the same command again continues from it (same batches, same result as an uninterrupted run).
``result.json`` is rewritten at every evaluation too, with ``"complete": false`` until the run
stops, so an interrupted run still leaves a record of how far it got (:func:`progress`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import RunConfig, dump_toml
from ..data.mqar import (
    mqar_batch,
    mqar_bytes,
    mqar_mixed_batch,
    query_distances,
    query_hits,
    recall_accuracy,
)
from ..errors import CheckpointError, ConfigError
from ..model.lm import LanguageModel, check_memory
from ..model.memory import available_memory
from ..ode import solver_errors
from .logging import MetricsLogger, refuse_foreign_files
from .optim import lr_at, make_optimizer
from .trainer import pick_device

STATE = "state.pt"


def query_loss(model: LanguageModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the positions with a target (y >= 0), the head applied only there."""
    h = model.hidden_states(x)
    mask = y >= 0
    return F.cross_entropy(model.lm_head(h[mask]).float(), y[mask])


def _test_set(cfg: RunConfig, offset: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out sequences: drawn from their own seed, never from the training set's."""
    q = cfg.mqar
    return mqar_batch(q.test_examples, q.vocab_size, q.seq_len, q.num_kv_pairs, q.power_a,
                      torch.Generator().manual_seed(cfg.train.seed + offset))


# The held-out set above also decides when a run stops (stop_accuracy), so the accuracy it
# reports at the stop is chosen by it (slightly optimistic). A second held-out set, from yet
# another seed and never seen during the run, scores the final model once.
FRESH_OFFSET = 20_000


def fresh_recall(out: str | Path) -> dict:
    """Recall of the model in ``out/state.pt`` on the fresh held-out set:
    ``{"step", "accuracy"}``."""
    st = _load_state(Path(out) / STATE, _WHILE_RUNNING)
    cfg = RunConfig.from_dict(st["config"], saved=True)
    model = _quiet_model(cfg)
    model.load_state_dict(st["model"])
    x, y = _test_set(cfg, FRESH_OFFSET)
    return {"step": st["step"], "accuracy": recall_accuracy(model, x, y)}


def _train_set(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    # one pair count draws exactly mqar_batch's sequences, so both cases share one call (the
    # config has checked that every pair count fits the vocabulary and the sequence length)
    q = cfg.mqar
    return mqar_mixed_batch(q.train_examples, q.vocab_size, q.seq_len,
                            q.train_kv_pairs or [q.num_kv_pairs], q.power_a,
                            torch.Generator().manual_seed(cfg.train.seed))


def _check_data_memory(q) -> None:
    """Refuse example counts whose generation cannot fit, before drawing any (a trillion
    held-out sequences ended in an allocator traceback)."""
    n_train = -(-q.train_examples // max(1, len(q.train_kv_pairs)))  # largest mixed part
    keep = 2 * 8 * q.seq_len * (q.train_examples + q.test_examples)  # both sets, int64
    need = keep + max(mqar_bytes(n_train, q.vocab_size, q.seq_len),
                      mqar_bytes(q.test_examples, q.vocab_size, q.seq_len))
    free = available_memory(torch.device("cpu"))
    if free is not None and need > free:
        gib = 2 ** 30
        raise ConfigError(
            f"mqar.train_examples = {q.train_examples:,} and mqar.test_examples = "
            f"{q.test_examples:,} sequences of {q.seq_len} tokens (vocab_size {q.vocab_size}) "
            f"need about {need / gib:.1f} GiB to generate and hold, but the machine has "
            f"{free / gib:.1f} GiB available; lower them.")


def _same_settings(saved: dict, cfg: RunConfig) -> bool:
    """Whether a saved run's config is ``cfg``; keys added to the config since the run was saved
    take their defaults (which reproduce what the run did before they existed)."""
    return RunConfig.from_dict(saved, saved=True).to_dict() == cfg.to_dict()


def _load_state(path: Path, advice: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path} cannot be read ({e}); {advice}.") from None


# advice for a state file read from outside the run (it may be mid-write)
_WHILE_RUNNING = "it is being written or is damaged: try again after the next evaluation"


def _quiet_model(cfg: RunConfig) -> LanguageModel:
    """The run's model, built without drawing from the global RNG (a caller's seeded stream,
    or a run going on in the same process, stays as it was)."""
    with torch.random.fork_rng(devices=[]):
        return LanguageModel(cfg.model)


def _task_model(cfg: RunConfig):
    """The model settings the task imposes: its vocabulary, room for its sequences."""
    q = cfg.mqar
    return dataclasses.replace(cfg.model, vocab_size=q.vocab_size,
                               max_seq_len=max(cfg.model.max_seq_len, q.seq_len))


def run_mqar(cfg: RunConfig, out: str | Path, quiet: bool = False) -> dict:
    out = Path(out)
    cfg.check_trainable()
    t, q = cfg.train, cfg.mqar
    cfg.model = _task_model(cfg)
    device = pick_device(t.device)
    check_memory(cfg.model, device, training=True)
    _check_data_memory(q)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(t.seed)
    train_x, train_y = _train_set(cfg)
    test_x, test_y = _test_set(cfg)
    model = LanguageModel(cfg.model).to(device)
    opt = make_optimizer(model, t, device.type)
    order = torch.Generator().manual_seed(t.seed + 1)
    perm, cursor, step = torch.randperm(q.train_examples, generator=order), 0, 0
    acc, best, elapsed, history = 0.0, 0.0, 0.0, []
    state_path = out / STATE
    resumed = state_path.exists()
    if not resumed:  # a training run's folder
        refuse_foreign_files(out, ("checkpoints", "tb"), "A new MQAR run")
    if resumed:
        st = _load_state(state_path, "delete it to start the run afresh")
        if not _same_settings(st["config"], cfg):
            raise ConfigError(f"{out} holds an MQAR run with other settings (its "
                              f"{STATE}); use another --out, or delete the folder to restart.")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        order.set_state(st["order"])
        torch.set_rng_state(st["torch_rng"])
        perm, cursor, step = st["perm"], st["cursor"], st["step"]
        acc, best, elapsed, history = st["accuracy"], st["best"], st["elapsed"], st["history"]
    (out / "config.toml").write_text(dump_toml(cfg))
    logger = MetricsLogger(out, resume_step=step if resumed else None, tensorboard=False,
                           keep_resume_evaluation=True)
    tty = sys.stdout.isatty() and not quiet
    say = (lambda m: None) if quiet else (lambda m: print(m, flush=True))
    if resumed:
        say(f"resuming at step {step} from {state_path}")
    bar = tqdm(total=t.max_steps, initial=step, disable=not tty, file=sys.stdout)
    start = time.perf_counter() - elapsed
    done = acc >= q.stop_accuracy and step > 0
    while step < t.max_steps and not done:
        if cursor + t.batch_size > q.train_examples:
            perm, cursor = torch.randperm(q.train_examples, generator=order), 0
        idx = perm[cursor:cursor + t.batch_size]
        cursor += t.batch_size
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        loss = query_loss(model, train_x[idx].to(device), train_y[idx].to(device))
        opt.zero_grad(set_to_none=True)
        with solver_errors():  # an adjoint's backward solve runs in here
            loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % t.log_interval == 0:
            logger.log({"step": step, "loss": loss.item(), "lr": lr_at(step - 1, t)})
        if step % t.eval_interval == 0 or step == t.max_steps:
            acc = recall_accuracy(model, test_x.to(device), test_y.to(device))
            best = max(best, acc)
            history.append([step, acc])
            logger.log({"step": step, "accuracy": acc})
            msg = f"step {step}: loss {loss.item():.4f}, recall accuracy {acc:.4f}"
            bar.write(msg) if tty else say(msg)
            done = acc >= q.stop_accuracy
            tmp = state_path.with_suffix(".tmp")
            torch.save({"config": cfg.to_dict(), "model": model.state_dict(),
                        "optimizer": opt.state_dict(), "order": order.get_state(),
                        "torch_rng": torch.get_rng_state(), "perm": perm, "cursor": cursor,
                        "step": step, "accuracy": acc, "best": best,
                        "elapsed": time.perf_counter() - start, "history": history}, tmp)
            tmp.replace(state_path)
            if not done and step < t.max_steps:
                _write_result(out, _result(cfg, model.num_parameters(), step, acc, best,
                                           history, time.perf_counter() - start,
                                           complete=False))
    bar.close()
    logger.close()
    result = _result(cfg, model.num_parameters(), step, acc, best, history,
                     time.perf_counter() - start, complete=True)
    _write_result(out, result)
    return result


def _result(cfg: RunConfig, parameters: int, step: int, acc: float, best: float,
            history: list, seconds: float, complete: bool) -> dict:
    t, q = cfg.train, cfg.mqar
    return {"accuracy": acc, "best_accuracy": best, "steps": step, "max_steps": t.max_steps,
            "complete": complete, "stopped_early": complete and step < t.max_steps,
            "parameters": parameters, "seconds": seconds,
            "mixer": cfg.model.mixer, "depth": cfg.model.depth,
            "num_kv_pairs": q.num_kv_pairs, "train_kv_pairs": q.train_kv_pairs,
            "seq_len": q.seq_len, "history": history,
            "examples_seen": step * t.batch_size}


def _write_result(out: Path, result: dict) -> None:
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / "result.json")


def progress(out: str | Path, cfg: RunConfig | None = None) -> dict | None:
    """The result record of the run in ``out`` as far as it got, or None before its first
    evaluation. Read from ``state.pt`` (written at every evaluation), so it also works while the
    run is still going. With ``cfg``, a run with other settings is refused (ConfigError)."""
    out = Path(out)
    done = out / "result.json"
    state_path = out / STATE
    if not state_path.exists():
        return None
    st = _load_state(state_path, _WHILE_RUNNING)
    if cfg is not None:
        cfg = dataclasses.replace(cfg, model=_task_model(cfg))
        if not _same_settings(st["config"], cfg):
            raise ConfigError(f"{out} holds an MQAR run with other settings than the config "
                              f"and --set options given; record it with the ones it ran with.")
    if done.exists():
        result = json.loads(done.read_text())
        if result.get("complete", True) and result["steps"] == st["step"]:
            return {**result, "complete": True}
    cfg = RunConfig.from_dict(st["config"], saved=True)
    params = _quiet_model(cfg).num_parameters()  # tied weights counted once
    # the last evaluation reached the target or the last step: only result.json was missing
    complete = st["step"] >= cfg.train.max_steps or st["accuracy"] >= cfg.mqar.stop_accuracy
    return _result(cfg, params, st["step"], st["accuracy"], st["best"], st["history"],
                   st["elapsed"], complete=complete)


DISTANCE_EDGES = (0, 32, 64, 128)


def recall_by_distance(out: str | Path, edges: tuple[int, ...] = DISTANCE_EDGES) -> dict:
    """Held-out recall of the model in ``out/state.pt`` (its last evaluation) split by how far
    each query lies after its key-value pair: buckets [edges[i], edges[i+1]), the last one
    open-ended. Shows whether errors come from long distances or everywhere. Returns
    ``{"step": step of that evaluation, "buckets": [{"from", "to", "queries", "accuracy"}]}``."""
    out = Path(out)
    st = _load_state(out / STATE, _WHILE_RUNNING)
    cfg = RunConfig.from_dict(st["config"], saved=True)
    model = _quiet_model(cfg)
    model.load_state_dict(st["model"])
    x, y = _test_set(cfg)
    hits = query_hits(model, x, y)
    dist = query_distances(x, y, cfg.mqar.num_kv_pairs)
    rows = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        sel = (dist >= lo) & (dist < hi) if hi is not None else dist >= lo
        n = int(sel.sum())
        rows.append({"from": lo, "to": hi, "queries": n,
                     "accuracy": hits[sel].float().mean().item() if n else None})
    return {"step": st["step"], "buckets": rows}
