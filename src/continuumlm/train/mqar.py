"""Multi-query associative recall as a task on the trainer (``continuumlm mqar``).

A fixed training set is sampled once from a seeded generator and visited in shuffled epochs;
recall accuracy is measured on a held-out set drawn from a different seed. The run is an
ordinary training run (:class:`~continuumlm.train.trainer.Trainer`: AMP, DDP/FSDP, bad-step
handling, signals, checkpoints in ``checkpoints/``, exact resume) with this module's task
supplying the data, the objective and the evaluation.

The loss is the cross-entropy at the query positions only (every other target is ignored), so
the output layer is applied to those positions alone (``model(x, y, targets_only=True)``): the
same loss as a full forward at a fraction of the vocabulary-sized work. A checkpoint is saved
after every evaluation; running the same command again continues from the newest one (same
batches, same result as an uninterrupted run). ``result.json`` is rewritten at every evaluation
too, with ``"complete": false`` until the run stops, so an interrupted run still leaves a record
of how far it got (``mqar_results.progress``, which reads a run from outside, as it goes or
after it ends). A run folder written by the standalone MQAR loop of earlier
versions (``state.pt``) is adopted: its state becomes a checkpoint, and the run continues.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ..config import RunConfig
from ..data.mqar import (
    mqar_batch,
    mqar_bytes,
    mqar_mixed_batch,
    recall_accuracy,
)
from ..errors import CheckpointError, ConfigError
from ..model.lm import LanguageModel
from ..model.memory import available_memory
from ..runs.checkpoint import (
    load_run_config,
    save_checkpoint,
)
from ..runs.folder import LEGACY_STATE, RESULT, checkpoints, clear_unstarted_run, has_checkpoints
from .optim import make_optimizer
from .tasks import Evaluation


def _test_set(cfg: RunConfig, offset: int = 10_000) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out sequences: drawn from their own seed, never from the training set's."""
    q = cfg.mqar
    return mqar_batch(q.test_examples, q.vocab_size, q.seq_len, q.num_kv_pairs, q.power_a,
                      torch.Generator().manual_seed(cfg.train.seed + offset))


# The held-out set above also decides when a run stops (stop_accuracy), so the accuracy it
# reports at the stop is chosen by it (slightly optimistic). A second held-out set, from yet
# another seed and never seen during the run, scores the final model once.
FRESH_OFFSET = 20_000


EXAMPLE_CACHE = "CONTINUUMLM_MQAR_CACHE"  # a folder: training sets built once, shared


def train_set(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The training sequences (seeded). With ``$CONTINUUMLM_MQAR_CACHE`` set to a folder, the
    set of one seed and [mqar] section is built once (by the first process to ask, the others
    wait) and memory-mapped by every run that asks again: runs of several learning rates side
    by side share one copy in the page cache instead of each drawing its own."""
    folder = os.environ.get(EXAMPLE_CACHE)
    if not folder:
        return _draw_train_set(cfg)
    key = json.dumps({"seed": cfg.train.seed, "mqar": dataclasses.asdict(cfg.mqar)},
                     sort_keys=True)
    path = Path(folder) / f"mqar-train-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait for its file
        if not path.exists():
            x, y = _draw_train_set(cfg)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save({"key": key, "x": x, "y": y}, tmp)
            os.replace(tmp, path)  # complete or absent
            return x, y
    saved = torch.load(path, mmap=True, weights_only=True)
    if saved["key"] != key:  # a hash collision, in principle
        return _draw_train_set(cfg)
    return saved["x"], saved["y"]


def _draw_train_set(cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    # one pair count draws exactly mqar_batch's sequences, so both cases share one call (the
    # config has checked that every pair count fits the vocabulary and the sequence length)
    q = cfg.mqar
    return mqar_mixed_batch(q.train_examples, q.vocab_size, q.seq_len,
                            q.train_kv_pairs or [q.num_kv_pairs], q.power_a,
                            torch.Generator().manual_seed(cfg.train.seed))


class EpochSampler:
    """A fixed set of examples visited in shuffled epochs: each optimizer step takes the next
    ``batch_size x grad_accum x world_size`` examples of a permutation drawn from its own
    seeded generator, reshuffling when fewer than that are left (as Zoology trains MQAR).
    Rank r's micro-step j reads slice r * grad_accum + j of the step's examples, so one process
    with grad_accum 1 reads exactly what the standalone loop read. Every rank keeps the same
    state (the permutation, the cursor, the generator)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int,
                 rank: int = 0, world: int = 1, grad_accum: int = 1):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.slot0, self.per_step = rank * grad_accum, batch_size * grad_accum * world
        if self.per_step > len(x):
            raise ConfigError(
                f"mqar.train_examples = {len(x):,} is fewer than one optimizer step's examples "
                f"(train.batch_size x train.grad_accum x processes = {self.per_step:,}); raise "
                f"mqar.train_examples or lower the batch.")
        self.order = torch.Generator().manual_seed(seed + 1)
        self.perm, self.cursor, self.base = torch.randperm(len(x), generator=self.order), 0, 0

    def next(self, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if micro_step == 0:  # a new optimizer step
            if self.cursor + self.per_step > len(self.x):
                self.perm, self.cursor = torch.randperm(len(self.x), generator=self.order), 0
            self.base = self.cursor
            self.cursor += self.per_step
        at = self.base + (self.slot0 + micro_step) * self.batch_size
        idx = self.perm[at:at + self.batch_size]
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict:
        return {"perm": self.perm, "cursor": self.cursor, "order": self.order.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not {"perm", "cursor", "order"} <= state.keys() or len(state["perm"]) != len(self.x):
            raise ValueError("its sampler state is not that of an MQAR run with this training "
                             "set size")
        self.perm, self.cursor = state["perm"], int(state["cursor"])
        self.order.set_state(state["order"])


class RecallEvaluator:
    """Recall accuracy on the held-out set every ``train.eval_interval`` steps and at the last
    one (not before the first step); ``stop`` once it reaches ``mqar.stop_accuracy``. Every
    rank scores the whole set (under FSDP every forward is a collective)."""

    def __init__(self, x, y, t, q, device, amp, dist=None):
        self.x, self.y, self.t, self.q, self.device, self.amp = x, y, t, q, device, amp
        self.dist = dist if dist is not None and dist.enabled else None

    def due(self, step: int) -> bool:
        return step > 0 and (step % self.t.eval_interval == 0 or step >= self.t.max_steps)

    def __call__(self, model) -> Evaluation:
        with self.amp:
            acc = recall_accuracy(model, self.x.to(self.device), self.y.to(self.device))
        if self.dist is not None:  # rank 0's on every rank (it decides when all of them stop)
            acc = self.dist.gather(acc)[0]
        return Evaluation(1.0 - acc, {"accuracy": acc}, f"recall accuracy {acc:.4f}",
                          stop=acc >= self.q.stop_accuracy)


class MQARTask:
    """The MQAR task for :class:`~continuumlm.train.trainer.Trainer` (see the module's text).
    Its part of the trainer state: the evaluation history, the best accuracy and the run's
    wall time so far, from which :func:`progress` rebuilds the record."""

    name = "mqar"
    checkpoint_each_evaluation = True
    tokenizer = None

    def __init__(self, cfg: RunConfig, out: Path, resumed_from: Path | None = None,
                 state: dict | None = None):
        from .distributed import env_from_environment

        self.world = env_from_environment().world_size
        if resumed_from is not None:
            _refuse_other_settings(load_run_config(resumed_from).to_dict(), cfg, out,
                                   resumed_from / "run.json")
            ran = int(state.get("world_size", 1))
            if ran != self.world:
                raise ConfigError(
                    f"{out} holds an MQAR run trained with {ran} process(es); continuing it "
                    f"with {self.world} would change its batch (each step reads "
                    f"batch_size x grad_accum x processes examples). Continue it with "
                    f"{'--nproc ' + str(ran) if ran > 1 else 'one process'}.")
        self.cfg, self.out = cfg, out
        self.seq_len = cfg.mqar.seq_len  # train.seq_len does not apply: MQAR has its own
        self.train_x, self.train_y = train_set(cfg)
        self.test_x, self.test_y = _test_set(cfg)
        saved = (state or {}).get("task") or {}
        self.history = [list(h) for h in saved.get("history", [])]
        self.best = float(saved.get("best", 0.0))
        self.elapsed0, self.start = float(saved.get("elapsed", 0.0)), time.perf_counter()

    def sampler(self, t, dist) -> EpochSampler:
        self.start = time.perf_counter()  # the run's time starts here, after the model's build
        return EpochSampler(self.train_x, self.train_y, t.batch_size, t.seed, dist.rank,
                            dist.world_size, t.grad_accum)

    @staticmethod
    def merge_sampler_states(states: list[dict]) -> dict:
        return states[0]  # every rank alike

    def evaluator(self, t, device, amp, dist, fsdp) -> RecallEvaluator:
        return RecallEvaluator(self.test_x, self.test_y, t, self.cfg.mqar, device, amp, dist)

    @staticmethod
    def forward(fn, x, y):
        return fn(x, y, targets_only=True)

    def elapsed(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.start

    def state(self) -> dict:
        return {"history": self.history, "best": self.best, "elapsed": self.elapsed()}

    @staticmethod
    def trainer_state() -> dict:
        return {}

    def on_evaluation(self, trainer, evaluation: Evaluation) -> None:
        acc = evaluation.fields["accuracy"]
        # a resumed run scores its first step again (the same weights): one entry per step
        self.history = [h for h in self.history if h[0] != trainer.step] + [[trainer.step, acc]]
        self.best = max(self.best, acc)

    def record(self, trainer) -> None:
        _write_result(self.out, self.result(trainer, complete=False))

    def on_end(self, trainer, summary: dict) -> None:
        if self.history:  # stopped before its first evaluation: nothing to record
            _write_result(self.out, self.result(trainer, complete=not summary["interrupted"]))

    def result(self, trainer, complete: bool) -> dict:
        step, acc = self.history[-1]
        return _result(self.cfg, trainer.model.num_parameters(), step, acc, self.best,
                       self.history, self.elapsed(), complete, self.world)


def _task_model(cfg: RunConfig):
    """The model settings the task imposes: its vocabulary, room for its sequences."""
    q = cfg.mqar
    return dataclasses.replace(cfg.model, vocab_size=q.vocab_size,
                               max_seq_len=max(cfg.model.max_seq_len, q.seq_len))


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


def _refuse_other_settings(saved: dict, cfg: RunConfig, out: Path, where: Path) -> None:
    from .resume import differences

    old = RunConfig.from_dict(saved, saved=True)
    if old.to_dict() != cfg.to_dict():
        differ = differences(old, cfg, ("model", "data", "train", "mqar"))
        raise ConfigError(f"{out} holds an MQAR run with other settings ({'; '.join(differ)}; "
                          f"its settings are in {where}); use another --out, or delete the "
                          f"folder to restart.")


def _quiet_model(cfg: RunConfig) -> LanguageModel:
    """The run's model, built without drawing from the global RNG (a caller's seeded stream,
    or a run going on in the same process, stays as it was)."""
    with torch.random.fork_rng(devices=[]):
        return LanguageModel(cfg.model)


def run_mqar(cfg: RunConfig, out: str | Path, quiet: bool = False,
             clear: bool | None = None) -> dict:
    """Train ``cfg``'s model on MQAR into ``out`` (continuing the run there, if any) and return
    its record (also in ``out/result.json``). A run stopped by a signal returns its record
    with ``"complete": false`` and ``"interrupted"`` naming the signal. ``clear``: whether this
    process clears what a run that died before its first checkpoint left (default: when it is
    the only process; the CLI says so for rank 0, which holds the run folder's lock)."""
    import gc

    from . import distributed, runlock
    from .trainer import Trainer

    out = Path(out)
    prepare_run_folder(cfg, out, clear=clear)
    runlock.ready(out)  # the other ranks read the folder from here on
    try:
        trainer = Trainer(cfg, out, resume=has_checkpoints(out), quiet=quiet, task=MQARTask)
        summary = trainer.run()
        # the model and its DDP/FSDP state go while the process group still exists
        del trainer
        gc.collect()
        distributed.teardown(wait=True)
    finally:
        distributed.teardown()
    if not distributed.env_from_environment().is_main:  # rank 0 writes the record
        return {"steps": summary["step"], "interrupted": summary["interrupted"]}
    if not (out / RESULT).exists():  # stopped before its first evaluation
        return {"steps": summary["step"], "interrupted": summary["interrupted"]}
    result = json.loads((out / RESULT).read_text())
    return {**result, "interrupted": summary["interrupted"]} if summary["interrupted"] else result


def prepare_run_folder(cfg: RunConfig, out: Path, clear: bool | None = None) -> None:
    """Before training: the config suits the task (it gets the task's model settings), the
    data fits in memory, and a run folder of the standalone loop is adopted (one process:
    the launcher of a multi-process run, or the run itself). ``clear`` (default: when this is
    the only process) removes what this same run left before its first checkpoint."""
    from . import distributed

    cfg.check_trainable()
    cfg.model = _task_model(cfg)
    _check_data_memory(cfg.mqar)
    if clear is None:
        clear = not distributed.env_from_environment().enabled
    if not has_checkpoints(out) and not (out / LEGACY_STATE).exists() and clear:
        # the first checkpoint comes with the first evaluation; steps up to it may be logged
        # before it is written
        clear_unstarted_run(out, cfg, min(cfg.train.eval_interval, cfg.train.max_steps),
                            "it stopped before its first evaluation")
    if not has_checkpoints(out) and (out / LEGACY_STATE).exists():
        if distributed.env_from_environment().enabled:
            raise ConfigError(f"{out} holds a run of an earlier version's MQAR loop "
                              f"({LEGACY_STATE}); continue it once with one process (or with "
                              f"`continuumlm mqar --nproc N`, which adopts it first).")
        _adopt_legacy_state(out, cfg)


def _adopt_legacy_state(out: Path, cfg: RunConfig) -> None:
    """Turn the standalone loop's ``state.pt`` into the checkpoint of its step, from which the
    trainer continues exactly where that loop would have (same batches, same optimizer and RNG
    state). The file itself stays."""
    path = out / LEGACY_STATE
    st = _load_state(path, "delete the folder to start the run afresh")
    _refuse_other_settings(st["config"], cfg, out, path)
    model = _quiet_model(cfg)
    model.load_state_dict(st["model"])
    opt = make_optimizer(model, cfg.train, "cpu")
    opt.load_state_dict(st["optimizer"])
    state = {"step": st["step"], "best_val": 1.0 - st["best"],
             "sampler": {"perm": st["perm"], "cursor": st["cursor"], "order": st["order"]},
             "torch_rng": st["torch_rng"], "rank_rng": [st["torch_rng"]], "rank_cuda_rng": [None],
             "world_size": 1, "skipped_steps": 0, "bad_steps": 0, "optimizer": opt.state_dict(),
             "task": {"name": "mqar", "history": st["history"], "best": st["best"],
                      "elapsed": st["elapsed"]}}
    save_checkpoint(checkpoints(out), st["step"], model, None, cfg, state,
                    keep=cfg.train.keep_checkpoints, evaluated=True)


def _result(cfg: RunConfig, parameters: int, step: int, acc: float, best: float,
            history: list, seconds: float, complete: bool, world: int = 1) -> dict:
    t, q = cfg.train, cfg.mqar
    return {"accuracy": acc, "best_accuracy": best, "steps": step, "max_steps": t.max_steps,
            "complete": complete, "stopped_early": complete and step < t.max_steps,
            "parameters": parameters, "seconds": seconds,
            "mixer": cfg.model.mixer, "depth": cfg.model.depth,
            "num_kv_pairs": q.num_kv_pairs, "train_kv_pairs": q.train_kv_pairs,
            "seq_len": q.seq_len, "history": history,
            "examples_seen": step * t.batch_size * t.grad_accum * world}


def _write_result(out: Path, result: dict) -> None:
    tmp = out / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / RESULT)


def _load_state(path: Path, advice: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path} cannot be read ({e}); {advice}.") from None
