"""Multi-process training under ``torchrun``: process group, model wrapping, collectives.

``torchrun --nproc_per_node=N -m continuumlm train ...`` sets RANK, WORLD_SIZE and friends;
:func:`setup` turns them into a process group (gloo on CPU, nccl on CUDA) with a collective
timeout, so a rank that dies makes the others fail instead of waiting forever. Without those
variables everything here is a no-op for a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives

    def all_reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is true on at least one."""
        return self.all_reduce_sum([float(flag)], device)[0] > 0

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def env_from_environment() -> DistEnv:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    return DistEnv(rank=int(os.environ["RANK"]), world_size=world,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))


def setup(device_name: str, timeout_s: float) -> tuple[DistEnv, str]:
    """Join the process group torchrun describes. Returns (env, device name for this rank):
    under CUDA each rank takes GPU ``LOCAL_RANK``."""
    env = env_from_environment()
    if not env.enabled:
        return env, device_name
    try:
        kind = "auto" if device_name == "auto" else torch.device(device_name).type
    except RuntimeError:
        kind = device_name  # not a device name: pick_device says so
    use_cuda = kind == "cuda" or (kind == "auto" and torch.cuda.is_available())
    if use_cuda:
        # one GPU per rank: "cuda:0" in a config names the device type here, since every rank
        # on cuda:0 would share one GPU (and gloo instead of nccl)
        if device_name not in ("auto", "cuda", f"cuda:{env.local_rank}") and env.is_main:
            print(f"note: train.device = {device_name!r} under torchrun: each rank uses "
                  f"cuda:LOCAL_RANK", flush=True)
        torch.cuda.set_device(env.local_rank)
        device_name = f"cuda:{env.local_rank}"
    elif device_name == "auto":
        device_name = "cpu"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return env, device_name


def teardown(wait: bool = False) -> None:
    """Leave the process group; ``wait``: first meet every rank at a barrier (on success)."""
    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def wrap(model: torch.nn.Module, strategy: str, env: DistEnv, device: torch.device):
    """The module the training step calls. ``ddp``: DistributedDataParallel (gradients
    all-reduced in buckets during backward). ``fsdp``: FSDP2 ``fully_shard`` on every depth
    block and then on the whole model, so each rank keeps 1/N of the parameters, gradients and
    optimizer state. With one process both are the model itself."""
    if strategy == "fsdp":
        if not env.enabled:
            return model
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # pragma: no cover - torch without FSDP2
            raise ConfigError("train.strategy = 'fsdp' needs torch.distributed.fsdp.fully_shard "
                              "(torch >= 2.6); use strategy = 'ddp' or upgrade torch.") from None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (env.world_size,))
        depth = model.depth
        for block in getattr(depth, "layers", None) or depth.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if not env.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def no_grad_sync(wrapped: torch.nn.Module, raw: torch.nn.Module, sync: bool):
    """Context for one accumulation micro-step: skip the gradient all-reduce unless ``sync``."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync"):  # DDP
        return wrapped.no_sync()
    if hasattr(raw, "set_requires_gradient_sync"):  # FSDP2

        @contextlib.contextmanager
        def fsdp_no_sync():
            raw.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                raw.set_requires_gradient_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()
