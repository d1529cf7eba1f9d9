"""The training loop's checkpointing: where checkpoints go, when one is due, and writing one
(a collective under torchrun: FSDP ranks write their shards, rank 0 the rest)."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from ..errors import TrainingError
from . import distributed as D
from .checkpoint import save_checkpoint


class Checkpointer:
    """Owns ``OUT/checkpoints``. A step is saved at most once: after its evaluation when that
    improved on the best so far (as ``best``), else every ``train.checkpoint_interval`` steps;
    the trainer saves the last step (and a step stopped by a signal) itself."""

    def __init__(self, out: Path, t, dist: D.DistEnv, fsdp: bool):
        self.out, self.t, self.dist, self.fsdp = out, t, dist, fsdp
        self.root = out / "checkpoints"
        self.saved_at: int | None = None  # the step saved last by this process's loop

    def due(self, step: int, improved: bool) -> bool:
        if self.saved_at == step:
            return False
        periodic = step % self.t.checkpoint_interval == 0 and 0 < step < self.t.max_steps
        return (improved and step > 0) or periodic

    def prepare(self) -> None:
        """Rank 0, before training: the folder is writable; leftovers of a crash mid-save go."""
        self._probe_writable()
        for stale in [*self.root.glob(".tmp-*"), *self.root.glob(".shards-*")]:
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, step: int, model, optimizer, tokenizer, cfg, state: dict,
             best: bool = False) -> Path | None:
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
        path = None
        if self.dist.is_main:
            try:
                path = save_checkpoint(self.root, step, model, tokenizer, cfg, state, best=best,
                                       keep=self.t.keep_checkpoints, shards=shards)
            except OSError as e:
                last = self.root / "last"
                kept = (f"the previous checkpoint {last.resolve()} is intact" if last.exists()
                        else "no earlier checkpoint exists")
                raise TrainingError(f"could not save the checkpoint of step {step} "
                                    f"({e.strerror or e}); {kept}. Free disk space and resume "
                                    f"with --resume.") from None
        self.dist.barrier()
        self.saved_at = step
        return path

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
            advice = {errno.ENOSPC: "free some space or choose another --out",
                      errno.EDQUOT: "free some space or choose another --out",
                      errno.ENOTDIR: "a part of that path is a file, not a folder; choose "
                                     "another --out",
                      errno.EEXIST: "a part of that path is a file, not a folder; choose "
                                    "another --out",
                      errno.EACCES: "you may not write there; choose a writable --out",
                      errno.EPERM: "you may not write there; choose a writable --out",
                      errno.EROFS: "that file system is read-only; choose a writable --out",
                      }.get(e.errno, "choose a writable --out")
            raise TrainingError(f"cannot write to the run folder {self.out} ({e.strerror or e}); "
                                f"{advice}.") from None
