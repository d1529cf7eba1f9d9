"""Multi-process training: process group, model wrapping, collectives.

``torchrun --nproc_per_node=N -m continuumlm train ...`` sets RANK, WORLD_SIZE and friends; so
does :func:`adopt_scheduler_ranks` for ranks that SLURM started itself (``srun --ntasks N
continuumlm train ...``), from the SLURM task variables. :func:`setup` turns them into a process
group (gloo on CPU, nccl on CUDA) with a collective timeout, so a rank that dies makes the others
fail instead of waiting forever. Without those variables everything here is a no-op for a single
process.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError, ContinuumLMError


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


# ---------------------------------------------------------------------------- SLURM ranks

class SchedulerError(ContinuumLMError):
    """The SLURM variables of a rank cannot be read (exit status 2)."""


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: ``"node[01-03,07],gpu-a[1-2]"``
    gives node01, node02, node03, node07, gpu-a1, gpu-a2; several bracket groups in one name
    multiply out (``"r[1-2]n[1-2]"``: r1n1, r1n2, r2n1, r2n2); a range keeps the zero padding
    of its first number. Written here rather than calling ``scontrol show hostnames``: that
    needs SLURM's client tools on every compute node and a controller that answers."""

    def items(s: str) -> list[str]:  # split at the commas outside brackets
        out, depth, start = [], 0, 0
        for i, c in enumerate(s):
            depth += (c == "[") - (c == "]")
            if depth < 0 or depth > 1:
                raise ValueError(s)
            if c == "," and depth == 0:
                out.append(s[start:i])
                start = i + 1
        if depth:
            raise ValueError(s)
        return out + [s[start:]]

    def expand(name: str) -> list[str]:
        if "[" not in name:
            if "]" in name or not name:
                raise ValueError(name)
            return [name]
        head, _, rest = name.partition("[")
        body, _, tail = rest.partition("]")
        values = []
        for part in body.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise ValueError(name)
            if not dash:
                values.append(lo)
                continue
            if int(hi) < int(lo):
                raise ValueError(name)
            values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
        return [head + v + t for v in values for t in expand(tail)] if tail else \
            [head + v for v in values]

    try:
        return [host for item in items(spec.strip()) for host in expand(item)]
    except ValueError:
        raise SchedulerError(
            f"the SLURM node list {spec!r} is not in SLURM's host-list syntax (names, "
            f"bracketed ranges such as node[01-04,07], commas between); set MASTER_ADDR to the "
            f"first node's host name in the job script instead.") from None


def job_port(environ) -> int:
    """A rendezvous port every process of one SLURM job step derives alike: from the job id
    and step id, in 10000-29999 (below Linux's ephemeral ports, where an outgoing connection
    may already hold it). Two steps of one job, or jobs whose ids coincide modulo the range,
    collide: export MASTER_PORT (or pass --rdzv-endpoint) to choose another."""
    job = int(environ["SLURM_JOB_ID"])
    step = environ.get("SLURM_STEP_ID", "0")
    return 10000 + (job * 16 + (int(step) if step.isdigit() else 0)) % 20000


def die_with_parent(sig: int) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent dies (a rank whose
    launcher was killed saves and stops instead of training on unguarded)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() == 1:  # the parent died before the request was in place
        os.kill(os.getpid(), sig)


def _tasks_on_node(spec: str, node: int) -> int:
    """The task count of node ``node`` from SLURM's "2(x3),1" form (2 tasks on each of the
    first three nodes, then 1)."""
    counts = []
    for part in spec.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts[node]


def scheduler_ranks(environ=None) -> dict[str, str] | None:
    """The torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) of a process that SLURM started as one task of a job step with more than one
    task (``srun --ntasks N``), or None: under torchrun (RANK set), outside a job step (the
    batch script itself, which SLURM runs once whatever --ntasks says) or for a step of one
    task. The rendezvous is MASTER_ADDR/MASTER_PORT when the job script exports them, else the
    step's first node and a port derived from the job id."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env or "SLURM_STEP_ID" not in env:
        return None
    try:
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1")
        if ntasks <= 1:
            return None
        rank = int(env["SLURM_PROCID"])
        local_rank = int(env.get("SLURM_LOCALID", "0"))
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_world = (_tasks_on_node(per_node, int(env.get("SLURM_NODEID", "0")))
                       if per_node else 1)
    except (KeyError, ValueError, IndexError) as e:
        raise SchedulerError(
            f"this process runs as one task of a {env.get('SLURM_STEP_NUM_TASKS') or env.get('SLURM_NTASKS')}"
            f"-task SLURM job step, but its task variables cannot be read ({e!r} in "
            f"SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID or SLURM_STEP_TASKS_PER_NODE); start the "
            f"ranks with srun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
            f"MASTER_PORT yourself.") from None
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
            or env.get("SLURM_NODELIST")
        if not nodes:
            raise SchedulerError("a SLURM job step of several tasks without a node list "
                                 "(SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) or MASTER_ADDR: "
                                 "export MASTER_ADDR (the first node's host name) in the job "
                                 "script.")
        addr = expand_hostlist(nodes)[0]
    port = env.get("MASTER_PORT")
    if not port:
        if not env.get("SLURM_JOB_ID", "").isdigit():
            raise SchedulerError("a SLURM job step of several tasks without SLURM_JOB_ID or "
                                 "MASTER_PORT: export MASTER_PORT (a free port on the first "
                                 "node) in the job script.")
        port = str(job_port(env))
    return {"RANK": str(rank), "WORLD_SIZE": str(ntasks), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": addr, "MASTER_PORT": port}


def adopt_scheduler_ranks(environ=None, say=print) -> bool:
    """Become the rank SLURM started (see :func:`scheduler_ranks`): its variables go into the
    environment, where the process group (``env://``), the data loader and every later check
    read them, and rank 0 says once what world it resolved. True when it did."""
    env = os.environ if environ is None else environ
    ranks = scheduler_ranks(env)
    if ranks is None:
        return False
    env.update(ranks)
    if ranks["RANK"] == "0":
        say(f"SLURM job {env.get('SLURM_JOB_ID', '?')}: {ranks['WORLD_SIZE']} ranks started by "
            f"srun ({env.get('SLURM_STEP_NUM_NODES') or env.get('SLURM_NNODES') or '?'} "
            f"node(s), {ranks['LOCAL_WORLD_SIZE']} on this one); rendezvous at "
            f"{ranks['MASTER_ADDR']}:{ranks['MASTER_PORT']}")
    return True


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
        # SLURM may bind GPUs to each task (--gpus-per-task): a rank srun started that sees
        # fewer GPUs than its node has ranks takes its first one
        visible = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        bound = "SLURM_PROCID" in os.environ and 0 < visible < local_world
        index = 0 if bound else env.local_rank if env.local_rank < visible else None
        if index is None:
            raise ConfigError(f"local rank {env.local_rank} needs a GPU of its own, and this "
                              f"process sees {visible}; start at most {visible} ranks per node "
                              f"(--nproc, srun --ntasks-per-node) or make more GPUs visible.")
        torch.cuda.set_device(index)
        device_name = f"cuda:{index}"
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
