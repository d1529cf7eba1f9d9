"""The training loop's checkpointing: where checkpoints go, when one is due, and writing one
(a collective under torchrun: FSDP ranks write their shards, rank 0 the rest)."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

from ..errors import DiskError
from ..runs.checkpoint import save_checkpoint
from ..runs.folder import LAST, checkpoints, disk_error, gib, unwritable_folder
from . import distributed as D


class Checkpointer:
    """Owns ``OUT/checkpoints``. A step is saved at most once: after its evaluation when that
    improved on the best so far (as ``best``), else every ``train.checkpoint_interval`` steps;
    the trainer saves the last step (and a step stopped by a signal) itself."""

    def __init__(self, out: Path, t, dist: D.DistEnv, fsdp: bool, device=None):
        self.out, self.t, self.dist, self.fsdp, self.device = out, t, dist, fsdp, device
        self.root = checkpoints(out)
        self.saved_at: int | None = None  # the step saved last by this process's loop
        self.saved_time = time.monotonic()
        self.task = "lm"  # the run's task (Trainer sets it), for the command that continues it

    def due(self, step: int, improved: bool) -> bool:
        if self.saved_at == step:
            return False
        periodic = step % self.t.checkpoint_interval == 0 and 0 < step < self.t.max_steps
        if self.t.checkpoint_minutes is not None and 0 < step < self.t.max_steps:
            late = time.monotonic() - self.saved_time >= 60 * self.t.checkpoint_minutes
            periodic = self.dist.any(late, self.device) or periodic  # every rank alike
        return (improved and step > 0) or periodic

    def prepare(self) -> None:
        """Rank 0, before training: the folder is writable; leftovers of a crash mid-save go."""
        self._probe_writable()
        for stale in [*self.root.glob(".tmp-*"), *self.root.glob(".shards-*")]:
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, step: int, model, optimizer, tokenizer, cfg, state: dict,
             best: bool = False, evaluated: bool = False) -> Path | None:
        """Write the checkpoint of ``step`` (every rank calls this; rank 0 writes)."""
        shards = None
        if self.fsdp:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, optimizer)
            shards = self.root / f".shards-{step:08d}"
            if self.dist.is_main and shards.exists():
                shutil.rmtree(shards)
            self.dist.barrier()
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(shards))
            self.dist.barrier()
        path, failure = None, None
        if self.dist.is_main:
            try:
                path = self._write(step, model, optimizer, tokenizer, cfg, state, best, shards,
                                   evaluated)
            except DiskError as e:
                failure = e
        # decided on every rank alike: the others would wait for rank 0 in the next collective
        if self.dist.any(failure is not None, self.device):
            if failure is None:
                failure = DiskError(f"rank 0 could not write the checkpoint of step {step} "
                                    f"(its message says why); the run stops on every rank.")
            failure.collective = True
            raise failure
        self.dist.barrier()
        self.saved_at, self.saved_time = step, time.monotonic()
        return path

    def _write(self, step, model, optimizer, tokenizer, cfg, state, best, shards,
               evaluated=False) -> Path:
        """Rank 0's part of a save: refuse it when the disk cannot hold it (when that is cheap
        to tell: not for FSDP, whose shards are already written), then write it; any failure
        of the file system is a DiskError."""
        from safetensors import SafetensorError

        need = self.size_needed(model, optimizer)
        what = f"the checkpoint of step {step}"
        if shards is None:
            try:
                free = shutil.disk_usage(self.root if self.root.exists() else self.out).free
            except OSError:
                free = None
            if free is not None and free < need:  # refused before anything is written
                e = OSError(errno.ENOSPC, f"{gib(need)} needed, {gib(free)} free")
                raise disk_error(what, self.root, e, self.out, need, self.task)
        try:
            return save_checkpoint(self.root, step, model, tokenizer, cfg, state, best=best,
                                   keep=self.t.keep_checkpoints, shards=shards,
                                   evaluated=evaluated)
        except (OSError, SafetensorError) as e:  # safetensors reports ENOSPC its own way
            raise disk_error(what, self.root, e, self.out, need, self.task) from None
        except RuntimeError as e:
            # torch.save reports a full disk as "[enforce fail at inline_container.cc...]
            # unexpected pos ...": a write that came up short
            if "inline_container" not in str(e) and "unexpected pos" not in str(e):
                raise
            raise disk_error(what, self.root, e, self.out, need, self.task) from None

    def size_needed(self, model, optimizer) -> int:
        """Bytes a new checkpoint takes: the last one's size when there is one, else the
        weights in float32 and the optimizer's state (with a margin for the small files)."""
        last = self.root / LAST
        if last.exists():
            return sum(p.stat().st_size for p in last.resolve().rglob("*") if p.is_file())
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        moments = sum(t.numel() * t.element_size() for st in optimizer.state.values()
                      for t in st.values() if hasattr(t, "numel"))
        return weights + (moments or 2 * weights) + (1 << 20)

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
            raise unwritable_folder(self.out, e) from None
