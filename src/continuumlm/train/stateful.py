"""What a checkpoint restores, one owner each: the weights, the run's progress, each rank's
random generators, the batch streams, and (with torch's own ``load_state_dict``) the optimizer
and the gradient scaler. The trainer state is one flat dict (``trainer_state.pt``, its keys
those of earlier versions); each part reads its own keys in ``load_state_dict(state)``, and
:func:`restore` hands every part the state and turns what does not fit into one
``CheckpointError`` naming the folder."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, ConfigError, first_line
from ..runs.checkpoint import SHARDS_DIR


@dataclass
class Progress:
    """Where a run is: its step, its best evaluation score, and the non-finite steps it
    skipped (consecutive ones carry over, so a resumed run stops where the uninterrupted one
    would)."""

    step: int = 0
    best_val: float = math.inf
    bad_steps: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "best_val": self.best_val,
                "skipped_steps": self.skipped_steps, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.best_val = float(state["best_val"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


class RandomState:
    """Each rank's torch generator, and its CUDA generator on a GPU: what draws that rank's
    dropout masks. Saved per rank (``rank_rng``, ``rank_cuda_rng``); checkpoints of one
    process before those keys hold ``torch_rng`` (and ``cuda_rng``)."""

    def __init__(self, dist, device: torch.device) -> None:
        self.dist, self.device = dist, device

    def local(self) -> tuple:
        """This rank's (torch, CUDA or None) generator states, to gather."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @staticmethod
    def state_dict(per_rank: list[tuple]) -> dict:
        """The saved keys from every rank's :meth:`local`, in rank order."""
        return {"torch_rng": per_rank[0][0], "rank_rng": [cpu for cpu, _ in per_rank],
                "rank_cuda_rng": [cuda for _, cuda in per_rank]}

    def load_state_dict(self, state: dict) -> None:
        rank = self.dist.rank
        rngs = state.get("rank_rng") or [state["torch_rng"]]
        if rank < len(rngs):
            torch.set_rng_state(rngs[rank])
        cuda = state.get("rank_cuda_rng") or []
        if self.device.type == "cuda" and rank < len(cuda) and cuda[rank] is not None:
            torch.cuda.set_rng_state(cuda[rank], self.device)
        elif "cuda_rng" in state and torch.cuda.is_available() and not self.dist.enabled:
            torch.cuda.set_rng_state_all(state["cuda_rng"])  # checkpoints before rank_cuda_rng


class BatchStreams:
    """The task's batch sampler on resume: its streams' positions, and the check that the run
    reads as many streams per step (processes x train.grad_accum) as the one that wrote it."""

    def __init__(self, sampler, world_size: int, grad_accum: int, folder: Path) -> None:
        self.sampler, self.world_size, self.grad_accum = sampler, world_size, grad_accum
        self.folder = folder

    def load_state_dict(self, state: dict) -> None:
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:  # its own message: streams that do not fit this run
            raise CheckpointError(f"--resume from {self.folder}: {e}") from None
        saved = set((state["sampler"].get("streams") or {}).keys())
        wanted = set(range(self.world_size * self.grad_accum))
        if saved and saved != wanted:  # each rank reads its own: fewer would pass unseen
            raise CheckpointError(
                f"--resume from {self.folder}: the run read {len(saved)} batch streams per "
                f"step (processes x train.grad_accum) and this one would read {len(wanted)} "
                f"({self.world_size} x {self.grad_accum}), which changes its global batch. "
                f"Resume with processes x train.grad_accum = {len(saved)} (e.g. one process "
                f"with train.grad_accum = {len(saved)}).")


class Keyed:
    """An object with torch's ``load_state_dict`` (the optimizer, the gradient scaler) read
    from its key of the trainer state; absent keys are left alone when ``optional``."""

    def __init__(self, target, key: str, optional: bool = False) -> None:
        self.target, self.key, self.optional = target, key, optional

    def load_state_dict(self, state: dict) -> None:
        if self.key in state or not self.optional:
            self.target.load_state_dict(state[self.key])


def sharded_checkpoint(folder: Path, fsdp: bool, strategy: str) -> bool:
    """Whether the checkpoint ``folder`` holds FSDP shards, refusing one written with another
    strategy than this run's (``fsdp``: this run shards)."""
    sharded = (folder / SHARDS_DIR).is_dir()
    if sharded != fsdp:
        if sharded and strategy == "fsdp":  # fsdp asked for, but in one process
            how = ("resume it under torchrun with as many processes as it was written with "
                   "(continuumlm train --out DIR --resume --nproc N)")
        else:
            how = (f"resume it with the strategy it was written with (--set train.strategy="
                   f"{'fsdp' if sharded else 'ddp'}{' and --nproc N' if sharded else ''})")
        raise ConfigError(
            f"--resume: {folder} was written by a "
            f"{'sharded (fsdp)' if sharded else 'ddp or single-process'} run, but this run "
            f"uses {'fsdp' if fsdp else 'ddp or one process'}; {how}. A checkpoint "
            f"cannot change strategy on resume"
            f"{' (`continuumlm export` makes its weights usable by eval and generate)' if sharded else ''}.")
    return sharded


def load_weights(model: torch.nn.Module, folder: Path, device: torch.device) -> None:
    """The weights of a checkpoint written by one process (or DDP) into ``model``."""
    from safetensors.torch import load_model

    try:
        load_model(model, str(folder / "model.safetensors"), device=str(device))
    except RuntimeError as e:
        raise CheckpointError(
            f"--resume: the weights in {folder} do not fit the model its config describes "
            f"({first_line(e)}); the folder was changed after it was written: remove it to "
            f"resume from an earlier checkpoint.") from None


def restore(parts: dict[str, object], state: dict, folder: Path) -> None:
    """Every part's ``load_state_dict(state)``, in order; what does not fit (a missing key, a
    tensor of another shape) is one ``CheckpointError`` naming the folder and the part."""
    for name, part in parts.items():
        try:
            part.load_state_dict(state)
        except (CheckpointError, ConfigError):
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(
                f"--resume from {folder}: its trainer_state.pt does not fit this run (the "
                f"{name}: {type(e).__name__}: {first_line(e)}); the file was changed after it "
                f"was written: remove the folder to resume from an earlier "
                f"checkpoint.") from None
