"""Checkpoints: atomic, verifiable, loaded without unpickling arbitrary objects.

Layout of a run folder's ``checkpoints/``::

    step-00000500/     config.json  model.safetensors  tokenizer.json  run.json
                       trainer_state.pt  manifest.json
    last -> step-...   (symlink, swapped atomically)
    best -> step-...

A run trained with ``train.strategy = "fsdp"`` keeps its weights and optimizer state as
per-rank shards in ``sharded/`` (torch.distributed.checkpoint) instead of
``model.safetensors``; ``continuumlm export`` consolidates them into an ordinary
``model.safetensors`` that eval, generate and ``from_pretrained`` read.

A checkpoint is written into a hidden temporary folder, every file is fsynced, and the folder is
renamed into place; only then does ``last`` move. A crash at any point leaves the previous
checkpoint intact. ``manifest.json`` records the sha256 of every file, checked on load.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import torch

from ..atomic import fsync_dir
from ..config import RunConfig
from ..data.corpora import sha256_file
from ..data.tokenizers import TOKENIZER_FILE, load_tokenizer, save_tokenizer
from ..errors import CheckpointError, first_line
from ..model.lm import CONFIG_FILE, WEIGHTS_FILE, LanguageModel
from .folder import BEST, CHECKPOINTS, LAST

RUN_FILE = "run.json"
ASIDE_PREFIX = ".old-"  # a step's previous copy while the step is saved again
STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
SHARDS_DIR = "sharded"




def _point(link: Path, target_name: str) -> None:
    """Atomically make ``link`` a symlink to ``target_name`` (a sibling folder)."""
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target_name, tmp)
    os.replace(tmp, link)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _write_manifest(folder: Path, step: int) -> None:
    # a *.tmp file is a write in progress or one that failed: never part of a checkpoint
    files = [f for f in _files(folder) if f != MANIFEST and not f.endswith(".tmp")]
    for f in files:
        with open(folder / f, "rb") as fh:
            os.fsync(fh.fileno())
    manifest = {"step": step, "files": {f: sha256_file(folder / f) for f in files}}
    tmp = folder / (MANIFEST + ".tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump(manifest, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(folder)


def save_checkpoint(ckpt_root: Path, step: int, model: LanguageModel, tokenizer, run_cfg: RunConfig,
                    trainer_state: dict, best: bool = False, keep: int = 3,
                    shards: Path | None = None, evaluated: bool = False) -> Path:
    """Write ``step-NNNNNNNN`` atomically. ``shards``: a torch.distributed.checkpoint folder
    (FSDP) moved in as ``sharded/`` in place of ``model.safetensors``. ``evaluated``: point
    ``evaluated`` at it (the state a task's record was made from; never pruned)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"{STEP_PREFIX}{step:08d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{os.getpid()}"
    aside = ckpt_root / f"{ASIDE_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        raw = model.module if hasattr(model, "module") else model
        if shards is None:
            raw.save_pretrained(tmp)
        else:
            (tmp / CONFIG_FILE).write_text(json.dumps(raw.config.to_dict(), indent=2) + "\n")
            os.rename(shards, tmp / SHARDS_DIR)
        if tokenizer is not None:  # a task without text (MQAR) has none
            save_tokenizer(tokenizer, tmp)
        (tmp / RUN_FILE).write_text(json.dumps(run_cfg.to_dict(), indent=2) + "\n")
        torch.save(trainer_state, tmp / STATE_FILE)
        _write_manifest(tmp, step)
        # The same step saved again (a resumed run that redoes a step): the old copy, which
        # `last` may point at, is moved aside, not deleted, until the new one is in place; a
        # crash between the two renames is undone by recover_interrupted_save.
        if final.exists():
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not final.exists():
            os.rename(aside, final)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    _point(ckpt_root / LAST, name)
    if best:
        _point(ckpt_root / BEST, name)
    if evaluated:
        _point(ckpt_root / "evaluated", name)
    _prune(ckpt_root, keep)
    return final


def recover_interrupted_save(ckpt_root: Path) -> None:
    """Undo what a crash in the middle of re-saving a step left: its complete old copy set
    aside with no new copy in place (``last`` would point at nothing). A set-aside copy whose
    step folder exists again is deleted."""
    for aside in sorted(Path(ckpt_root).glob(ASIDE_PREFIX + "*")):
        name = aside.name[len(ASIDE_PREFIX):].rsplit("-", 1)[0]
        final = aside.with_name(name)
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            try:
                os.rename(aside, final)
            except FileNotFoundError:  # another rank of the same job moved it back first
                pass


def _prune(ckpt_root: Path, keep: int) -> None:
    steps = sorted(p for p in ckpt_root.iterdir()
                   if p.name.startswith(STEP_PREFIX) and p.is_dir() and not p.is_symlink())
    protected = {(ckpt_root / n).resolve() for n in (LAST, BEST, "evaluated")
                 if (ckpt_root / n).exists()}
    for p in steps[:-keep] if keep > 0 else []:
        if p.resolve() not in protected:
            shutil.rmtree(p, ignore_errors=True)


def resolve_checkpoint(path: str | Path, which: str = "last") -> Path:
    """A checkpoint folder from a checkpoint folder, a ``checkpoints/`` folder or a run folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a run folder (e.g. runs/demo) or a "
                              f"checkpoint folder (e.g. runs/demo/checkpoints/best).")
    for candidate in (p, p / which, p / CHECKPOINTS / which):
        if (candidate / WEIGHTS_FILE).exists() or (candidate / CONFIG_FILE).exists():
            return candidate
    others = sorted(w for w in (BEST, LAST) if w != which and any(
        (c / CONFIG_FILE).exists() for c in (p / w, p / CHECKPOINTS / w)))
    if others:
        raise CheckpointError(
            f"{p} has no {which!r} checkpoint (a run whose validation loss never improved on its "
            f"first evaluation saves no 'best'), but it has {others[0]!r}; pass --which "
            f"{others[0]}.")
    raise CheckpointError(f"{p} holds no checkpoint (no {WEIGHTS_FILE} in it, in {p / which} or "
                          f"in {p / 'checkpoints' / which}); pass a run folder or a checkpoint folder.")


def verify_checkpoint(ckpt: Path) -> None:
    """Check every file against the manifest's sha256 (folders saved by save_pretrained alone
    carry no manifest and are checked by the loaders instead). A training checkpoint is always
    written with its manifest, so one without gets a warning: its files load unverified."""
    mpath = ckpt / MANIFEST
    if not mpath.exists():
        if (ckpt / STATE_FILE).exists():
            print(f"warning: {ckpt} has no {MANIFEST} (training writes one into every "
                  f"checkpoint), so its files cannot be checked against their sha256; they are "
                  f"loaded as they are.", file=sys.stderr)
        return
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        inside = ckpt.resolve()
        if not isinstance(files, dict) or not all(
                isinstance(n, str) and isinstance(d, str)
                and (inside / n).resolve().is_relative_to(inside) for n, d in files.items()):
            raise TypeError("files must map names inside the checkpoint to digests")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, OSError):
        raise CheckpointError(f"{mpath} is corrupt; the checkpoint {ckpt} cannot be trusted.") from None
    for name, digest in files.items():
        f = ckpt / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing from checkpoint {ckpt}.")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f} does not match the sha256 in {mpath}: the file is corrupt "
                                  f"or truncated.")


# What a torch.distributed.checkpoint ``.metadata`` file may name. torch reads that file with an
# unrestricted unpickler (and non-tensor entries with a full, not weights-only, torch load), so
# it is checked here first with an unpickler that builds nothing else.
_SHARD_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}


class _ShardMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        allowed = (module == "torch.distributed.checkpoint.metadata"
                   or (module, name) in _SHARD_METADATA_GLOBALS
                   or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not allowed:
            raise CheckpointError(
                f"the sharded checkpoint's .metadata names {module}.{name}, which no "
                f"torch.distributed.checkpoint metadata holds; the file was not written by "
                f"ContinuumLM and is not loaded (it could run code). Use a checkpoint you "
                f"trained yourself.")
        return super().find_class(module, name)


def load_shards(state: dict, shards: Path, **kw) -> None:
    """``torch.distributed.checkpoint.load`` into ``state``, after checking that the shard
    metadata builds only checkpoint-metadata objects and with non-tensor entries (optimizer
    hyper-parameters) read through ``torch.load(weights_only=True)``."""
    import io

    import torch.distributed.checkpoint as dcp

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, weights_only=True)  # plain data only
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{shards}: an entry of the sharded checkpoint is not "
                                      f"plain data ({e}); it is not loaded.") from None
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    try:
        with open(shards / ".metadata", "rb") as f:
            _ShardMetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any damage to the file
        raise CheckpointError(f"{shards}/.metadata cannot be read ({type(e).__name__}: {e}); the "
                              f"sharded checkpoint is damaged: use an earlier checkpoint "
                              f"(--which or a step-* folder).") from None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(shards), planner=SafeLoadPlanner(), **kw)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - torch's CheckpointException wraps each rank's error
        raise CheckpointError(f"{shards}: the sharded checkpoint cannot be loaded ({first_line(e)}); it "
                              f"is damaged or was written for another model: use an earlier "
                              f"checkpoint (--which or a step-* folder).") from None


def _write_advice(e: BaseException) -> str:
    """What to do about a failed write, from its errno."""
    no = getattr(e, "errno", None)
    if no in (errno.ENOSPC, errno.EDQUOT):
        return "Free some space on that disk and run the command again."
    if no in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Make the folder writable (or copy the checkpoint somewhere writable) and run " \
               "the command again."
    return "Fix the cause and run the command again."


def export_sharded(path: str | Path, which: str = "last") -> Path:
    """Consolidate an FSDP checkpoint's ``sharded/`` weights into ``model.safetensors`` in the
    same folder (no process group needed) and add it to the manifest."""
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    ckpt = resolve_checkpoint(path, which).resolve()
    verify_checkpoint(ckpt)
    if not (ckpt / SHARDS_DIR).is_dir():
        raise CheckpointError(f"{ckpt} holds no {SHARDS_DIR}/ folder: it is not an FSDP "
                              f"checkpoint, and its {WEIGHTS_FILE} can be used as it is.")
    cfg = load_run_config(ckpt)
    model = LanguageModel(cfg.model)
    state = {"model": model.state_dict()}
    load_shards(state, ckpt / SHARDS_DIR)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt}: the shards do not fit the model in its config.json "
                              f"({first_line(e)}); the folder was changed "
                              f"after it was written.") from None
    tmp, final = ckpt / (WEIGHTS_FILE + ".tmp"), ckpt / WEIGHTS_FILE
    existed, placed = final.exists(), False
    try:
        # the consolidated file is complete and on disk before it takes its name, so a crash
        # leaves either no model.safetensors or a whole one; the shards are never touched
        save_model(model, str(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        placed = True
        manifest = json.loads((ckpt / MANIFEST).read_text()) if (ckpt / MANIFEST).exists() else {}
        _write_manifest(ckpt, manifest.get("step", 0))
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if placed and not existed:  # not in the manifest: the folder goes back to what it was
            final.unlink(missing_ok=True)
        if not isinstance(e, (OSError, SafetensorError)):
            raise
        raise CheckpointError(f"{ckpt}: writing the consolidated {WEIGHTS_FILE} failed "
                              f"({first_line(e)}); the sharded checkpoint is unchanged. "
                              f"{_write_advice(e)}") from None
    return ckpt


def load_model_and_tokenizer(path: str | Path, which: str = "last", map_location="cpu"):
    ckpt = resolve_checkpoint(path, which)
    verify_checkpoint(ckpt)
    if not (ckpt / WEIGHTS_FILE).exists() and (ckpt / SHARDS_DIR).is_dir():
        raise CheckpointError(f"{ckpt} holds FSDP shards, not {WEIGHTS_FILE}; consolidate them "
                              f"first with: continuumlm export --checkpoint {ckpt}")
    if not (ckpt / TOKENIZER_FILE).exists() and (ckpt / STATE_FILE).exists():
        task = (load_trainer_state(ckpt).get("task") or {}).get("name")
        if task == "mqar":
            raise CheckpointError(
                f"{ckpt} holds a model of the MQAR task (`continuumlm mqar`): its tokens are "
                f"the task's integer ids, with no tokenizer, so it cannot be evaluated or "
                f"sampled on text. Its recall is in the run folder's result.json (the same "
                f"`continuumlm mqar` command continues the run; bench/mqar_runs.py --fresh "
                f"scores it on unseen sequences).")
    model = LanguageModel.from_pretrained(ckpt, map_location=map_location)
    tok = load_tokenizer(ckpt)
    if tok.vocab_size != model.config.vocab_size:
        raise CheckpointError(f"the tokenizer in {ckpt} has {tok.vocab_size} tokens but the model "
                              f"expects {model.config.vocab_size}; the files come from different runs.")
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise CheckpointError(
                f"{ckpt / WEIGHTS_FILE} holds non-finite values (NaN or inf) in {name}, so every "
                f"output of the model would be NaN; the run diverged before this checkpoint was "
                f"written. Use an earlier checkpoint (--which, or a step-* folder).")
    return model, tok, ckpt


def load_run_config(ckpt: Path) -> RunConfig:
    p = ckpt / RUN_FILE
    if not p.is_file():
        raise CheckpointError(f"{p} is missing; only checkpoints written by training can be "
                              f"resumed or evaluated on their corpus.")
    try:
        return RunConfig.from_dict(json.loads(p.read_text()), where=str(p), saved=True)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p} is not valid JSON ({e}).") from None


def load_trainer_state(ckpt: Path) -> dict:
    p = ckpt / STATE_FILE
    if not p.is_file():
        raise CheckpointError(f"{p} is missing; the checkpoint cannot be resumed.")
    try:
        # weights_only: tensors and plain containers only; never runs code from the file
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "GLOBAL" not in str(e) and "global" not in str(e):  # no foreign object: bad bytes
            raise CheckpointError(f"{p} is not a trainer state written by torch.save (it is "
                                  f"damaged, or another kind of file) and was refused; resume "
                                  f"from another checkpoint.") from None
        what = next((line.strip() for line in str(e).splitlines()
                     if "GLOBAL" in line or "global" in line), first_line(e))
        raise CheckpointError(f"{p} holds objects other than tensors and plain data and was "
                              f"refused (it may be malicious): {what}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{p} is corrupt or truncated: {e}") from None
