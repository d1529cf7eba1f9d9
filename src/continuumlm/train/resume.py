"""Finding where a run folder can be resumed, and what a resumed run must agree with."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ..config import RunConfig
from ..errors import CheckpointError, ConfigError
from ..runs.checkpoint import (
    SHARDS_DIR,
    load_run_config,
    load_trainer_state,
    recover_interrupted_save,
    verify_checkpoint,
)
from ..runs.folder import (  # noqa: F401 - has_checkpoints, continue_command: public here too
    CHECKPOINTS,
    CONFIG,
    LAST,
    METRICS,
    RESUMED_BY,
    TASK_NAMES,
    absolute_data_path,
    checkpoints,
    continue_command,
    has_checkpoints,
    refuse_foreign_files,
)


def find_resumable(out: Path, announce: bool = True):
    """(checkpoint folder, its run config, its trainer state) of the newest checkpoint in a run
    folder that passes its manifest and loads; damaged ones are skipped with a message."""
    root = checkpoints(out)
    if root.is_dir():
        recover_interrupted_save(root)
    candidates = []
    if (root / LAST).exists():
        candidates.append((root / LAST).resolve())
    if root.is_dir():
        candidates += sorted((p.resolve() for p in root.glob("step-*") if p.is_dir()),
                             reverse=True)
    if not candidates:
        if any((Path(out) / n).exists() for n in (CONFIG, METRICS)):
            # a new run would refuse these files: say what to do about them
            raise CheckpointError(
                f"--resume: {root} holds no checkpoint: the run in {out} stopped before it "
                f"saved its first one, so there is nothing to resume. Delete {out} and start "
                f"the run again without --resume (or choose another --out).")
        raise CheckpointError(f"--resume: {root} holds no checkpoint; start the run without "
                              f"--resume.")
    problems = []
    for ckpt in dict.fromkeys(candidates):
        try:
            verify_checkpoint(ckpt)
            saved = load_run_config(ckpt)
            state = load_trainer_state(ckpt)
            from safetensors import SafetensorError, safe_open

            if not isinstance(state, dict) or not {"step", "best_val", "sampler"} <= state.keys():
                raise CheckpointError("trainer_state.pt lacks the step, best_val or sampler entry")
            if not (ckpt / SHARDS_DIR).is_dir():  # FSDP checkpoints hold shards instead
                try:
                    with safe_open(str(ckpt / "model.safetensors"), framework="pt"):
                        pass
                except SafetensorError as e:
                    raise CheckpointError(f"model.safetensors cannot be read ({e})") from None
        except (CheckpointError, ConfigError, OSError, RuntimeError, ValueError) as e:
            # intact files whose run.json this version refuses are not damage
            refused = isinstance(e, ConfigError)
            problems.append((f"{ckpt.name}: {e}", refused))
            if announce:
                what = "cannot be used: its run config is refused" if refused else "is damaged"
                print(f"warning: checkpoint {ckpt} {what} ({e}); trying an older one",
                      file=sys.stderr)
            continue
        if problems and announce:
            print(f"resuming from {ckpt}, the newest usable checkpoint", file=sys.stderr)
        return ckpt, saved, state
    if all(refused for _, refused in problems):
        raise CheckpointError(
            f"--resume: the run config saved with the checkpoints in {root} is refused by this "
            f"version of ContinuumLM ({problems[0][0]}); the checkpoints were written by another "
            f"version or their run.json was edited. Evaluate or continue the run with the "
            f"version that wrote it, or start a new run.")
    raise CheckpointError(f"--resume: no intact checkpoint in {root}: "
                          + "; ".join(text for text, _ in problems))


def differences(saved: RunConfig, cfg: RunConfig, sections=("model", "data"),
                limit: int = 4) -> list[str]:
    """``section.key: the run's value, given value`` for the keys of ``sections`` that differ
    (component tables flattened: model.deltanet.activation)."""
    def flat(d: dict, prefix: str) -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    def sections_of(c: RunConfig) -> dict:
        out = {}
        for name in sections:
            part = getattr(c, name)
            out.update(flat(part.to_dict() if hasattr(part, "to_dict")
                            else dataclasses.asdict(part), f"{name}."))
        return out

    a, b = sections_of(saved), sections_of(cfg)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    shown = [f"{k}: the run's {a.get(k)!r}, given {b.get(k)!r}" for k in keys[:limit]]
    return shown + ([f"{len(keys) - limit} more"] if len(keys) > limit else [])


def open_run_folder(cfg: RunConfig, out: Path, resume: bool, task: str = "lm"):
    """For a new run, check that ``out`` holds no other run; for ``resume``, find the newest
    usable checkpoint and check that ``cfg`` changes only [train] settings. Returns (trainer
    state or None, the checkpoint folder or None); fills in ``cfg.data.path`` (absolute, so
    `eval` and `--resume` read the same file from any folder) and, on resume, the model's
    vocabulary size. A run resumes only on the task it was started on (``task``)."""
    cfg.data = absolute_data_path(cfg.data)
    if resume:
        ckpt, saved, state = find_resumable(out)
        ran = (state.get("task") or {}).get("name", "lm")  # runs before tasks: language modeling
        if ran != task:
            raise ConfigError(
                f"{out} holds a {TASK_NAMES.get(ran, ran)} run, not a "
                f"{TASK_NAMES.get(task, task)} one; continue it with "
                f"{RESUMED_BY.get(ran, 'the command that started it')}, or choose another "
                f"--out.")
        saved.data = absolute_data_path(saved.data)
        if cfg.model.vocab_size == 0:  # filled in from the tokenizer when the run started
            cfg.model = dataclasses.replace(cfg.model, vocab_size=saved.model.vocab_size)
        if saved.model != cfg.model or saved.data != cfg.data:
            differ = differences(saved, cfg)
            raise ConfigError(
                f"--resume: the [model] or [data] settings differ from those the run in "
                f"{out} was started with"
                f"{' (' + '; '.join(differ) + ')' if differ else ''}; a resumed run may change "
                f"only [train] keys (e.g. train.max_steps). Drop --config/--set for those "
                f"sections.")
        return state, ckpt
    if has_checkpoints(out):
        raise ConfigError(f"{out} already holds a run (its {CHECKPOINTS}/); pass --resume "
                          f"to continue it, or choose another --out.")
    # an MQAR run, a run that died before its first checkpoint, a user's config.toml
    refuse_foreign_files(out, "A new training run")
    return None, None
