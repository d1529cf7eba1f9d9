"""train and mqar: runs, their resumption, and torchrun for several processes."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from ..errors import DISK_STATUS, REQUEUE_STATUS, ContinuumLMError
from .common import UsageError

# ---------------------------------------------------------------------------- train

LAUNCHER_OPTIONS = ("--nproc", "--nnodes", "--rdzv-endpoint", "--rdzv-id")


def _rank_argv(argv: list[str]) -> list[str]:
    """The command line of a rank: this one without the launcher's own options."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in LAUNCHER_OPTIONS:
            skip = True
        elif not a.startswith(tuple(o + "=" for o in LAUNCHER_OPTIONS)):
            rest.append(a)
    return rest


def _rendezvous(args) -> list[str]:
    """torchrun's options for this launcher: one node (--standalone), or ``--nnodes M`` agents
    (one per node, e.g. ``srun --ntasks-per-node 1``) meeting at a c10d rendezvous: the
    endpoint from --rdzv-endpoint, else the job's first node and a port from its id; the id
    from --rdzv-id, else the SLURM job (and its restart count, so that a requeued job does not
    meet the remains of the last one)."""
    nnodes = getattr(args, "nnodes", None)
    if not nnodes or nnodes == 1:
        return ["--standalone"]
    from ..train.distributed import expand_hostlist, job_port

    endpoint, run_id = args.rdzv_endpoint, args.rdzv_id
    job = os.environ.get("SLURM_JOB_ID", "")
    if endpoint is None:
        nodes = (os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
                 or os.environ.get("SLURM_NODELIST"))
        if not nodes or not job.isdigit():
            raise UsageError(f"--nnodes {nnodes}: pass --rdzv-endpoint HOST:PORT (a free port "
                             f"on one of the nodes; the same on every node), or run inside a "
                             f"SLURM job, where the first node and a port from the job id are "
                             f"used.")
        endpoint = f"{expand_hostlist(nodes)[0]}:{job_port(os.environ)}"
    if run_id is None:
        if not job:
            raise UsageError(f"--nnodes {nnodes}: pass --rdzv-id ID (the same on every node, "
                             f"new for every job), or run inside a SLURM job, whose id is used.")
        run_id = f"{job}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id]


def launch_torchrun(nproc: int, argv: list[str], args=None, out: Path | None = None) -> int:
    """Run this command under torchrun's launcher with ``nproc`` processes per node (in this
    process, as ``torchrun`` would). Exit status: 0; 2 when the ranks stopped on a user error
    (bad input, divergence), which they printed; 74 on a disk fault and 75 on a requeue signal
    (every rank alike); 130 on Ctrl-C (the ranks save a checkpoint first); 1 when a rank
    crashed, with its error printed above this summary. On one node this launcher holds the
    run folder ``out``'s lock for its ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..train import runlock, signals

    cmd = [*_rendezvous(args), f"--nproc_per_node={nproc}", "-m", "continuumlm",
           *_rank_argv(argv)]
    inherited = runlock.inherit_env(out) if out is not None and cmd[0] == "--standalone" \
        else {}
    os.environ.update(inherited)  # the ranks' environment: the lock this launcher holds
    print("launching: torchrun " + " ".join(cmd), flush=True)
    # a scheduler's warning signal reaches this launcher (or every process of the job): pass
    # it on to the ranks, which agree, save and exit with REQUEUE_STATUS. Until the ranks
    # exist (a rendezvous may wait for other nodes) a signal ends this command where it stands,
    # as before any training; once they run, torchrun's own SIGINT/SIGTERM handlers take over
    _LAUNCHED.clear()
    previous = {sig: signal.signal(sig, _forward_to_children)
                for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        run(parse_args(cmd))
    except ChildFailedError as e:
        # -15: a rank the launcher terminated (SIGTERM) because another one had ended
        codes = {f.exitcode for f in e.failures.values()} - {-15}
        if len(codes) == 1 and codes <= {2, DISK_STATUS, REQUEUE_STATUS}:
            return codes.pop()  # every rank ended alike: a user error, a disk, a requeue
        ranks = ", ".join(f"rank {r} exited with {f.exitcode}"
                          for r, f in sorted(e.failures.items()))
        print(f"error: the {nproc}-process job failed ({ranks}); the failing rank's error is "
              f"printed above.", file=sys.stderr)
        return 1
    except SignalException as e:  # Ctrl-C or SIGTERM: the launcher passed it on to the ranks
        print(f"launcher stopped by signal {e.sigval}", file=sys.stderr)
        return 130 if e.sigval == 2 else 128 + int(e.sigval)
    finally:
        signals.loop_started()  # the ranks have ended: a late signal changes nothing now
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for key in inherited:
            os.environ.pop(key, None)
    return 0


_LAUNCHED: set = set()  # non-empty once the launcher's forwarder has seen its ranks


def _forward_to_children(signum, frame) -> None:
    """Send the signal on to this process's children, the ranks (Linux /proc): not to their
    own children (compile workers), which the signal would kill."""

    from ..train.signals import StopRequested, before_loop

    me, children = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    if not children and not _LAUNCHED and before_loop():  # no rank yet: end the command here
        from ..train.signals import loop_started

        loop_started()  # once: a second signal is only noted while this one ends the command
        raise StopRequested(signal.Signals(signum).name)
    if children:
        _LAUNCHED.add(True)
    for pid in children:
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _without_resume(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--resume":
            skip = i + 1 < len(argv) and argv[i + 1] == "auto"
        elif not a.startswith("--resume="):
            out.append(a)
    return out


def _resume_mode(args, out: Path, clear: bool = True) -> bool:
    """--resume (must resume), --resume auto (resume when the folder has a checkpoint, else
    start afresh: with ``clear``, a run that died before its first checkpoint is cleared when it
    is this same run), or neither."""
    if args.resume is None:
        return False
    if args.resume == "yes":
        return True
    if args.resume != "auto":
        raise UsageError(f"--resume takes no value or 'auto', got {args.resume!r}.")
    from ..runs.folder import has_checkpoints

    if has_checkpoints(out):
        return True
    if args.config is None:
        raise UsageError(f"--resume auto: {out} holds no checkpoint to continue and there is no "
                         f"--config to start the run from; pass --config FILE.")
    if clear:
        _clear_unstarted_run(args, out)
    return False


def _clear_unstarted_run(args, out: Path) -> None:
    """The files a run leaves before its first checkpoint are removed when they are this
    run's (runs.folder.clear_unstarted_run), so a requeued job starts again; anyone
    else's files are left for the trainer to refuse."""
    from ..config import load_config
    from ..runs.folder import clear_unstarted_run

    cfg = load_config(args.config, args.set, plugins=args.plugin)
    # only a run that died before its first save completed: one that logged a step past it
    # (its checkpoints since removed, say) is left for the trainer to refuse. The step of the
    # first save itself is logged before that save (and its evaluation) run
    t = cfg.train
    clear_unstarted_run(out, cfg, min(t.checkpoint_interval, t.eval_interval, t.max_steps),
                        "--resume auto")


def _stopped_before_training(signame: str) -> int:
    """A signal before the training loop: nothing to save yet (a resumed run's checkpoint is
    where it was); the documented status."""
    from ..train import signals
    from ..train.distributed import env_from_environment

    seen = signals._early.seen if signals._early is not None else set()
    requeue = bool(({signame} | seen) & {"SIGUSR1", "SIGUSR2"})  # a requeue outranks the rest
    signame = next((n for n in ("SIGUSR1", "SIGUSR2") if n in {signame} | seen), signame)
    if env_from_environment().is_main:
        print(f"stopped by {signame} before training began: nothing saved (there was nothing "
              f"new to save); the same command with --resume auto starts or continues the run",
              flush=True)
    if requeue:
        return REQUEUE_STATUS
    return 130 if signame == "SIGINT" else 128 + signal.SIGTERM


def _start_job(args, out: Path, command: str) -> str:
    """What every train and mqar command does first, before it reads the run folder. Returns
    this process's role:

    - ``"nodes"``: one of ``--nnodes`` launchers; it neither locks nor changes the folder (its
      ranks do, rank 0 first);
    - ``"launcher"``: the one-node launcher of ``--nproc N``: it holds the folder's lock for its
      ranks, which inherit it (and end with it: a rank whose launcher dies gets SIGTERM);
    - ``"holder"``: a single process, or rank 0 of a job started elsewhere (torchrun, srun):
      it takes the lock and alone clears what a run that died early left;
    - ``"rank"``: another rank: it checks the lock and waits until rank 0 has the folder ready.

    Ranks that SLURM started take their place first (unless this process launches ranks)."""
    from ..train import distributed, runlock

    text = f"continuumlm {command} " + " ".join(args.argv[1:])
    nnodes = getattr(args, "nnodes", None)
    if (args.nproc and args.nproc > 1) or nnodes:
        slurm = distributed.scheduler_ranks()
        one_per_node = slurm is not None and slurm["LOCAL_WORLD_SIZE"] == "1"
        if distributed.env_from_environment().enabled or (
                slurm is not None and not (nnodes and one_per_node)):
            raise UsageError(
                "--nproc or --nnodes was given in a process that is already one rank of a "
                "job (torchrun, or srun with several tasks on a node); drop them, since the "
                "job already sets the number of processes, or start one task per node (srun "
                "--ntasks-per-node 1) with --nnodes to let this command launch the ranks.")
        if nnodes and nnodes > 1:
            return "nodes"
        runlock.hold(out, text)
        return "launcher"
    distributed.adopt_scheduler_ranks(say=lambda m: print(m, flush=True))
    if os.environ.get(runlock.INHERITED) == str((out / runlock.LOCK_NAME).resolve()):
        distributed.die_with_parent(signal.SIGTERM)  # saves and stops when its launcher dies
        return "rank"
    rank = distributed.env_from_environment().rank
    runlock.hold(out, text, rank=rank)
    return "holder" if rank == 0 else "rank"


def _as_job(body, args) -> int:
    """A train or mqar command as a job: signal handlers from its first moment (a signal
    during start-up ends it cleanly, with its status), and the run folder's lock and the
    handlers given back at its end (in-process callers, the Python API and tests, get theirs
    back; a console process keeps them until it exits)."""
    from ..train import runlock
    from ..train.signals import StopRequested, install_early, uninstall_early

    install_early()
    try:
        return body(args)
    except StopRequested as e:
        return _stopped_before_training(e.signame)
    finally:
        runlock.release_all()
        if getattr(args, "in_process", False):
            uninstall_early()


def cmd_train(args) -> int:
    return _as_job(_train, args)


def _train(args) -> int:
    import gc

    from ..config import load_config
    from ..train import Trainer, distributed, runlock
    from ..train.trainer import find_resumable

    if args.out is None and args.config is None:
        raise UsageError("pass --config FILE (and optionally --out DIR), or --out DIR --resume.")
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    role = _start_job(args, out, "train")
    if role == "nodes":  # every rank decides --resume auto itself, rank 0 first (it clears)
        if args.config:  # a bad config is reported here, once, status 2
            load_config(args.config, args.set, plugins=args.plugin).check_trainable()
        return launch_torchrun(args.nproc or 1, args.argv, args, out)
    # decided by the process that holds the folder (clearing what a run that died before its
    # first checkpoint left), then by every other rank alike from the folder it left
    args.resume = ("yes" if _resume_mode(args, out, clear=role in ("holder", "launcher"))
                   else None)
    runlock.ready(out)
    if role == "launcher":
        if args.config or not args.resume:  # a bad config is reported here, once, status 2
            load_config(args.config, args.set, plugins=args.plugin).check_trainable()
        argv = _without_resume(args.argv) + (["--resume"] if args.resume else [])
        return launch_torchrun(args.nproc or 1, argv, args, out)
    resume = args.resume == "yes"
    if resume:
        if args.config:
            cfg = load_config(args.config, args.set, plugins=args.plugin)
        else:  # the run's own settings, with --set applied on top
            ckpt, saved, _ = find_resumable(out, announce=False)
            cfg = load_config(None, args.set, base=saved.to_dict(), where=str(ckpt),
                              plugins=args.plugin)
    else:
        cfg = load_config(args.config, args.set, plugins=args.plugin)
    try:
        trainer = Trainer(cfg, out, resume=resume, quiet=args.quiet)
        result = trainer.run()
        # the model, its FSDP/DDP state and the device mesh go while the process group still
        # exists, not at interpreter exit (where FSDP's teardown aborted now and then)
        del trainer
        gc.collect()
        distributed.teardown(wait=True)  # every rank done before the group goes
    finally:
        distributed.teardown()
    requeue = result["interrupted"] in cfg.train.requeue_signals
    if not distributed.env_from_environment().is_main:
        return REQUEUE_STATUS if requeue else 0
    if result["interrupted"]:
        print(f"stopped by {result['interrupted']} at step {result['step']} (checkpoint saved); "
              f"resume with: continuumlm train --out {out} --resume auto")
        if requeue:  # every rank alike, so that the launcher reports it (launch_torchrun)
            return REQUEUE_STATUS
        if distributed.env_from_environment().enabled:
            return 0  # under torchrun the launcher reports the signal (launch_torchrun)
        # not a finished run: a script that waits for it must not take it for one
        return 130 if result["interrupted"] == "SIGINT" else 128 + signal.SIGTERM
    print(f"done: step {result['step']}, val loss {result['val_loss']:.4f}, best "
          f"{result['best_val_loss']:.4f}, {result['parameters']:,} parameters, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['train_seconds']:.1f} s training; "
          f"run folder {out}")
    return 0


# ---------------------------------------------------------------------------- mqar

def cmd_mqar(args) -> int:
    return _as_job(_mqar, args)


def _mqar(args) -> int:
    from ..config import load_config
    from ..train import distributed
    from ..train.mqar import run_mqar

    out = Path(args.out) if args.out else Path("runs") / "mqar" / Path(args.config).stem
    role = _start_job(args, out, "mqar")
    cfg = load_config(args.config, args.set, plugins=args.plugin)
    if role == "nodes":
        return launch_torchrun(args.nproc or 1, args.argv, args, out)
    if role == "launcher":
        from ..train.mqar import prepare_run_folder

        try:  # a bad config is reported here, once; an earlier version's run folder adopted
            prepare_run_folder(cfg, out)
        except ContinuumLMError:
            raise
        except ValueError as e:
            raise UsageError(f"[mqar]: {e}") from None
        return launch_torchrun(args.nproc or 1, args.argv, args, out)
    # task sizes that do not fit together are ConfigErrors of the [mqar] section; any other
    # error during training is not the user's input and keeps its traceback
    r = run_mqar(cfg, out, quiet=args.quiet, clear=True if role == "holder" else None)
    # exit statuses as for train: a requeue signal gives REQUEUE_STATUS on every rank
    requeue = r.get("interrupted") in cfg.train.requeue_signals
    if not distributed.env_from_environment().is_main:
        return REQUEUE_STATUS if requeue else 0
    if r.get("interrupted"):
        where = (f"last evaluation at step {r['steps']}" if "accuracy" in r
                 else "before its first evaluation")
        print(f"stopped by {r['interrupted']} (checkpoint saved; {where}); the same command "
              f"continues the run")
        if requeue:
            return REQUEUE_STATUS
        if distributed.env_from_environment().enabled:
            return 0  # under torchrun the launcher reports the signal
        return 130 if r["interrupted"] == "SIGINT" else 128 + signal.SIGTERM
    print(f"done: {r['mixer']}/{r['depth']}, {r['num_kv_pairs']} pairs at length {r['seq_len']}: "
          f"recall accuracy {r['accuracy']:.4f} (best {r['best_accuracy']:.4f}) after "
          f"{r['steps']} steps, {r['seconds']:.0f} s; run folder {out}")
    return 0


