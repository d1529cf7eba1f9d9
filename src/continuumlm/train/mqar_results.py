"""An MQAR run read from outside, while it trains or after it ended: the newest state saved
right after an evaluation (a checkpoint, or the standalone loop's ``state.pt``), the result
record as far as the run got (:func:`progress`), recall on a fresh held-out set
(:func:`fresh_recall`) and recall by how far each query lies after its pair
(:func:`recall_by_distance`). The task itself is ``mqar.py``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..config import RunConfig
from ..data.mqar import query_distances, query_hits, recall_accuracy
from ..errors import CheckpointError, ConfigError
from ..model.lm import LanguageModel
from ..runs.checkpoint import load_run_config, load_trainer_state, verify_checkpoint
from ..runs.folder import LEGACY_STATE, RESULT, checkpoints
from .device import autocast_for, pick_device
from .mqar import (
    FRESH_OFFSET,
    _load_state,
    _quiet_model,
    _result,
    _same_settings,
    _task_model,
    _test_set,
)

# advice for a file read from outside the run (it may be mid-write)
_WHILE_RUNNING = "it is being written or is damaged: try again after the next evaluation"


def _last_evaluated(out: Path) -> tuple[RunConfig, dict, Path | dict] | None:
    """(run config, task state with "step", where the weights are) of the newest state saved
    right after an evaluation: a checkpoint whose step is its history's last (a checkpoint a
    signal wrote between evaluations is passed over), or the standalone loop's ``state.pt``
    (its weights in the returned dict). None before the first evaluation."""
    root = checkpoints(out)
    # the one `evaluated` points at first (kept from pruning), then any other, newest first
    linked = [(root / "evaluated").resolve()] if (root / "evaluated").exists() else []
    for ckpt in [*linked, *sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)]:
        try:
            verify_checkpoint(ckpt)
            st = load_trainer_state(ckpt)
            cfg = load_run_config(ckpt)
        except (CheckpointError, ConfigError, OSError):
            continue  # being replaced, or damaged: an older one
        task = st.get("task") or {}
        if task.get("history") and task["history"][-1][0] == st["step"]:
            return cfg, {**task, "step": st["step"],
                         "world_size": int(st.get("world_size", 1))}, ckpt
    if (out / LEGACY_STATE).exists():
        st = _load_state(out / LEGACY_STATE, _WHILE_RUNNING)
        return (RunConfig.from_dict(st["config"], saved=True),
                {"history": st["history"], "best": st["best"], "elapsed": st["elapsed"],
                 "step": st["step"]}, {"model": st["model"]})
    return None


def _evaluated_model(out: Path) -> tuple[RunConfig, dict, LanguageModel]:
    found = _last_evaluated(Path(out))
    if found is None:
        raise CheckpointError(f"{out} holds no MQAR run that has evaluated yet (no checkpoint "
                              f"after an evaluation in {Path(out) / 'checkpoints'}).")
    cfg, task, where = found
    model = _quiet_model(cfg)
    if isinstance(where, dict):
        model.load_state_dict(where["model"])
    else:
        from safetensors.torch import load_model

        load_model(model, str(where / "model.safetensors"))
    return cfg, task, model


def _score_here(score, cfg: RunConfig, model: LanguageModel, x: torch.Tensor,
                y: torch.Tensor):
    """``score(model, x, y)`` (``query_hits`` or ``recall_accuracy``) of a saved run's model on
    this machine's best device (a GPU when there is one: scoring an ODE DeltaNet's held-out set
    on the CPU of a GPU machine took minutes per run) in the precision ``train.dtype`` gives
    on it, as the run's own evaluations did."""
    device = pick_device("auto")
    with autocast_for(device, cfg.train.dtype):
        return score(model.to(device), x.to(device), y.to(device))


def fresh_recall(out: str | Path) -> dict:
    """Recall of the run's model at its last evaluation on the fresh held-out set:
    ``{"step", "accuracy"}``."""
    cfg, task, model = _evaluated_model(Path(out))
    x, y = _test_set(cfg, FRESH_OFFSET)
    return {"step": task["step"], "accuracy": _score_here(recall_accuracy, cfg, model, x, y)}


def progress(out: str | Path, cfg: RunConfig | None = None) -> dict | None:
    """The result record of the run in ``out`` as far as it got, or None before its first
    evaluation. Read from the newest checkpoint saved after an evaluation, so it also works
    while the run is still going. With ``cfg``, a run with other settings is refused
    (ConfigError)."""
    out = Path(out)
    found = _last_evaluated(out)
    if found is None:
        return None
    saved, task, _ = found
    if cfg is not None:
        cfg = dataclasses.replace(cfg, model=_task_model(cfg))
        if not _same_settings(saved.to_dict(), cfg):
            raise ConfigError(f"{out} holds an MQAR run with other settings than the config "
                              f"and --set options given; record it with the ones it ran with.")
    done = out / RESULT
    if done.exists():
        result = json.loads(done.read_text())
        if result.get("complete", True) and result["steps"] == task["step"]:
            return {**result, "complete": True}
    params = _quiet_model(saved).num_parameters()  # tied weights counted once
    step, acc = task["history"][-1]
    # the last evaluation reached the target or the last step: only result.json was missing
    complete = step >= saved.train.max_steps or acc >= saved.mqar.stop_accuracy
    return _result(saved, params, step, acc, task["best"], task["history"], task["elapsed"],
                   complete=complete, world=task.get("world_size", 1))


DISTANCE_EDGES = (0, 32, 64, 128)


def recall_by_distance(out: str | Path, edges: tuple[int, ...] = DISTANCE_EDGES) -> dict:
    """Held-out recall of the run's model at its last evaluation split by how far each query
    lies after its key-value pair: buckets [edges[i], edges[i+1]), the last one open-ended.
    Shows whether errors come from long distances or everywhere. Returns
    ``{"step": step of that evaluation, "buckets": [{"from", "to", "queries", "accuracy"}]}``."""
    cfg, task, model = _evaluated_model(Path(out))
    x, y = _test_set(cfg)
    hits = _score_here(query_hits, cfg, model, x, y)
    dist = query_distances(x, y, cfg.mqar.num_kv_pairs)
    rows = []
    for i, lo in enumerate(edges):
        hi = edges[i + 1] if i + 1 < len(edges) else None
        sel = (dist >= lo) & (dist < hi) if hi is not None else dist >= lo
        n = int(sel.sum())
        rows.append({"from": lo, "to": hi, "queries": n,
                     "accuracy": hits[sel].float().mean().item() if n else None})
    return {"step": task["step"], "buckets": rows}
