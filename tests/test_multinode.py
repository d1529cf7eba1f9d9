"""Beyond one node: ranks that SLURM starts itself (srun --ntasks N), launchers on several
nodes meeting at a c10d rendezvous (--nnodes), a requeue signal to every process of such a
job, one job per run folder, and signals honoured from a command's first moment. One machine
stands in for the nodes: the ranks get the variables srun would give them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from continuumlm.errors import REQUEUE_STATUS
from continuumlm.runs.checkpoint import verify_checkpoint
from continuumlm.train import distributed, runlock
from test_reliability import CLI, _wait_for, losses, write_cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun_env(rank: int, ntasks: int, job: int, port: int | None = None, **extra) -> dict:
    """The variables srun gives task ``rank`` of a one-node step of ``ntasks`` tasks."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         runlock.INHERITED)}
    env.update({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
                "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                "SLURM_STEP_TASKS_PER_NODE": str(ntasks), "SLURM_STEP_NODELIST": "localhost",
                "SLURM_STEP_NUM_NODES": "1"})
    if port is not None:
        env["MASTER_PORT"] = str(port)
    env.update(extra)
    return env


# ---------------------------------------------------------------------------- host lists

@pytest.mark.parametrize("spec, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu-a[1-2],cpu7", ["gpu-a1", "gpu-a2", "cpu7"]),
    ("r[1-2]n[08-10]", ["r1n08", "r1n09", "r1n10", "r2n08", "r2n09", "r2n10"]),
    ("a[9-11].site", ["a9.site", "a10.site", "a11.site"]),
    ("x[007]", ["x007"]),
])
def test_slurm_host_lists_expand_as_scontrol_does(spec, hosts):
    assert distributed.expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", "a[[1]]",
                                  "", "a,,b"])
def test_a_malformed_host_list_is_one_paragraph(spec):
    with pytest.raises(distributed.SchedulerError, match="MASTER_ADDR"):
        distributed.expand_hostlist(spec)


def test_tasks_per_node_reads_slurms_repeat_form():
    assert [distributed._tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    assert distributed._tasks_on_node("4", 0) == 4


# ---------------------------------------------------------------------------- srun ranks

def test_srun_tasks_become_ranks_with_a_rendezvous_on_the_first_node():
    env = srun_env(1, 4, job=123456, SLURM_STEP_NODELIST="gpu[07-08]", SLURM_NODEID="0",
                   SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURM_LOCALID="1")
    assert distributed.scheduler_ranks(env) == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07", "MASTER_PORT": str(10000 + (123456 * 16) % 20000)}
    # what the job script exports wins
    env.update(MASTER_ADDR="head", MASTER_PORT="29500")
    assert distributed.scheduler_ranks(env)["MASTER_ADDR"] == "head"
    assert distributed.scheduler_ranks(env)["MASTER_PORT"] == "29500"


@pytest.mark.parametrize("change", [
    {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # one task: a single process
    {"RANK": "0", "WORLD_SIZE": "2"},  # torchrun started it: its variables stand
    {"SLURM_STEP_ID": None},  # the batch script itself, run once whatever --ntasks says
])
def test_processes_that_are_not_srun_ranks_stay_as_they_are(change):
    env = srun_env(0, 2, job=7)
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    assert distributed.scheduler_ranks(env) is None
    before = dict(env)
    assert distributed.adopt_scheduler_ranks(env, say=lambda m: None) is False
    assert env == before


def test_adopting_srun_ranks_sets_torchruns_variables_and_rank_0_says_so():
    said = []
    env = srun_env(0, 2, job=99)
    assert distributed.adopt_scheduler_ranks(env, say=said.append)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "2", "localhost")
    assert len(said) == 1 and "2 ranks started by srun" in said[0]
    assert f"localhost:{10000 + 99 * 16}" in said[0]
    said.clear()
    assert distributed.adopt_scheduler_ranks(srun_env(1, 2, job=99), say=said.append)
    assert said == []  # only rank 0 speaks


def test_unreadable_srun_variables_are_one_paragraph():
    env = srun_env(0, 2, job=5)
    env["SLURM_PROCID"] = "zero"
    with pytest.raises(distributed.SchedulerError, match="SLURM_PROCID"):
        distributed.scheduler_ranks(env)
    env = srun_env(0, 2, job=5)
    del env["SLURM_STEP_NODELIST"]
    with pytest.raises(distributed.SchedulerError, match="MASTER_ADDR"):
        distributed.scheduler_ranks(env)
    env = srun_env(0, 2, job=5)
    del env["SLURM_JOB_ID"]
    with pytest.raises(distributed.SchedulerError, match="MASTER_PORT"):
        distributed.scheduler_ranks(env)


def test_launcher_options_inside_a_job_of_several_tasks_are_refused(tiny_corpus, tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus)
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(tmp_path / "x"),
                        "--nproc", "2"], env=srun_env(0, 2, job=3), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--ntasks-per-node 1" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()


def test_the_rendezvous_of_several_launchers(monkeypatch):
    from argparse import Namespace

    from continuumlm.cli.common import UsageError
    from continuumlm.cli.training import _rank_argv, _rendezvous

    assert _rank_argv(["train", "--config", "c", "--nproc", "2", "--nnodes=2",
                       "--rdzv-endpoint", "h:1", "--rdzv-id=x", "--out", "o"]) == [
        "train", "--config", "c", "--out", "o"]
    one = Namespace(nnodes=None, rdzv_endpoint=None, rdzv_id=None)
    assert _rendezvous(one) == ["--standalone"]
    two = Namespace(nnodes=2, rdzv_endpoint=None, rdzv_id=None)
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    with pytest.raises(UsageError, match="--rdzv-endpoint"):
        _rendezvous(two)
    monkeypatch.setenv("SLURM_JOB_ID", "31")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[3-4]")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert _rendezvous(two) == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                f"n3:{10000 + 31 * 16}", "--rdzv-id", "31-2"]


# ---------------------------------------------------------------------------- run folder lock

_HOLDER = """
import sys, time
from pathlib import Path
from continuumlm.train import runlock
runlock.hold(Path(sys.argv[1]), "holder")
runlock.ready(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def _hold_in_child(out: Path, env=None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE,
                         text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.slow
def test_one_job_per_run_folder_and_a_dead_holder_never_blocks(tmp_path):
    out = tmp_path / "run"
    holder = _hold_in_child(out)
    try:
        info = json.loads((out / runlock.LOCK_NAME).read_text())
        with pytest.raises(runlock.RunFolderBusy, match=f"pid {holder.pid}") as e:
            runlock.hold(out, "second", environ={})
        assert "another --out" in str(e.value) and info["command"] == "holder"
        # another rank of another job refuses too; a rank of the holder's own job does not
        with pytest.raises(runlock.RunFolderBusy):
            runlock.hold(out, "second", rank=1, environ={"SLURM_JOB_ID": "1"})
    finally:
        holder.kill()
        holder.wait()
    # killed with SIGKILL: the kernel released the lock
    child = _hold_in_child(out)
    child.kill()
    child.wait()


@pytest.mark.slow
def test_ranks_of_the_holding_job_pass_the_check(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    holder = _hold_in_child(out, env=env)
    try:
        runlock.hold(out, "rank 1", rank=1, environ={"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"},
                     wait_ready=10)
        with pytest.raises(runlock.RunFolderBusy):  # the same job requeued is another job
            runlock.hold(out, "rank 1", rank=1, environ={
                "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"})
        # a launcher that holds the lock hands it to its ranks
        runlock.hold(out, "rank 0", environ=runlock.inherit_env(out))
    finally:
        holder.kill()
        holder.wait()


@contextlib.contextmanager
def _training_in(cfg: Path, out: Path):
    """A training job in ``out`` that has written its first metrics (the folder is in use);
    killed (SIGKILL, as a crashed node) when the block ends."""
    job = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "metrics.jsonl", timeout=120)
        yield job
    finally:
        job.kill()
        job.wait()


@pytest.mark.slow
def test_a_second_training_job_in_a_busy_folder_exits_2_at_once(tiny_corpus, tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "busy"
    with _training_in(cfg, out) as first:
        t0 = time.time()
        r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(out), "--resume",
                            "auto"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and f"pid {first.pid}" in r.stderr, r.stderr
        assert time.time() - t0 < 30
        steps_before = len(losses(out))
    assert len(losses(out)) >= steps_before  # the first job's records are untouched
    # the holder died (SIGKILL): the requeued job resumes
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(out), "--resume",
                        "auto", "--set", "train.max_steps=3"], capture_output=True, text=True,
                       timeout=120)
    assert "in use by another job" not in r.stderr


# ---------------------------------------------------------------------------- early signals

@pytest.mark.parametrize("sig, status", [(signal.SIGUSR1, REQUEUE_STATUS), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_ends_the_command_cleanly(tiny_corpus, tmp_path, sig, status):
    """The handlers hold from the command's first moment: a signal while the model is built
    (before any step) ends it with the documented status, no traceback, nothing saved."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "early"
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / runlock.LOCK_NAME, timeout=60)  # taken right after the handlers
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == status, stdout + stderr
    if (out / "metrics.jsonl").exists():  # the signal came after the loop began
        assert "saved a checkpoint" in stdout
    else:
        assert "before training began: nothing saved" in stdout and "Traceback" not in stderr
        assert not (out / "checkpoints").exists()


# ---------------------------------------------------------------------------- whole jobs

def _srun(cfg, out, ntasks, job, *extra, timeout=300):
    port = _free_port()
    procs = [subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), *extra],
                              env=srun_env(r, ntasks, job, port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ntasks)]
    return procs


@pytest.mark.slow  # two ranks started like srun, twice, and a two-process reference
def test_srun_ranks_train_as_one_job_and_requeue_loss_for_loss(tiny_corpus, tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "srun"
    procs = _srun(cfg, out, 2, job=4242)
    _wait_for(out / "metrics.jsonl", timeout=180)
    while len(losses(out)) < 4:
        time.sleep(0.05)
    for p in procs:  # --signal=USR1@90 without B: reaches every task
        p.send_signal(signal.SIGUSR1)
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [REQUEUE_STATUS] * 2, outs
    assert "2 ranks started by srun" in outs[0][0]
    last = (out / "checkpoints" / "last").resolve()
    verify_checkpoint(last)
    end = int(last.name.split("-")[1]) + 3
    procs = _srun(cfg, out, 2, 4242, "--resume", "auto", "--set", f"train.max_steps={end}")
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ref = tmp_path / "ref"
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(ref), "--nproc", "2",
                        "--set", f"train.max_steps={end}"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6, abs=0)


@pytest.mark.slow  # two launchers meeting at a c10d rendezvous
def test_two_launchers_at_a_c10d_rendezvous_train_like_two_processes(tiny_corpus, tmp_path):
    cfg = write_cfg(tmp_path, tiny_corpus, steps=12)
    out = tmp_path / "nodes"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    agents = [subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out),
                                "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
                                f"127.0.0.1:{port}", "--rdzv-id", "t1"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    ref = tmp_path / "ref"
    r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(ref), "--nproc", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6, abs=0)


def test_a_command_run_in_process_gives_back_its_handlers_and_folder(tiny_corpus, tmp_path):
    """The Python API (continuumlm.cli.main) leaves the caller's signal handlers and the run
    folder as it found them: another job may use the folder afterwards."""
    from conftest import run_cli

    cfg = write_cfg(tmp_path, tiny_corpus, steps=3)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    out = tmp_path / "api"
    assert run_cli("train", "--config", cfg, "--out", out).returncode == 0
    assert {s: signal.getsignal(s) for s in before} == before
    assert runlock._held == {}
    runlock.hold(out, "next job", environ={})
    runlock.release_all()


# ---------------------------------------------------------------------------- second reading

def test_one_launcher_per_node_under_srun_is_accepted(monkeypatch, tmp_path):
    """srun --ntasks-per-node 1 ... --nnodes 2: a step of two tasks, one per node, whose tasks
    are launchers (the second job script of docs/cluster.md), not ranks."""
    from argparse import Namespace

    from continuumlm.cli.common import UsageError
    from continuumlm.cli.training import _start_job

    for k in [k for k in os.environ if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(k)
    for k, v in srun_env(0, 2, job=8, SLURM_STEP_TASKS_PER_NODE="1(x2)",
                         SLURM_STEP_NODELIST="n[1-2]", SLURM_LOCALID="0").items():
        if k.startswith("SLURM_"):
            monkeypatch.setenv(k, v)
    args = Namespace(nproc=4, nnodes=2, rdzv_endpoint=None, rdzv_id=None,
                     argv=["train", "--nnodes", "2"])
    assert _start_job(args, tmp_path / "run", "train") == "nodes"
    assert not (tmp_path / "run").exists()  # launchers neither lock nor touch the folder
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2")  # two tasks on this node: ranks
    with pytest.raises(UsageError, match="--ntasks-per-node 1"):
        _start_job(args, tmp_path / "run", "train")


@pytest.mark.slow
def test_a_lock_file_removed_by_its_holder_is_taken_afresh(tmp_path):
    """release_all removes a folder (and its lock file) that a refused command created; a
    process that opened the old file meanwhile must not hold a lock on a deleted file while a
    third holds the new one."""
    out = tmp_path / "fresh"
    runlock.hold(out, "first", environ={})
    stale = os.open(out / runlock.LOCK_NAME, os.O_RDWR)
    runlock.release_all()  # created by the hold, nothing else in it: removed again
    assert not out.exists()
    out.mkdir()
    (out / runlock.LOCK_NAME).write_text("")
    assert not runlock._same_file(stale, out / runlock.LOCK_NAME)
    os.close(stale)
    holder = _hold_in_child(out)
    try:
        with pytest.raises(runlock.RunFolderBusy):
            runlock.hold(out, "third", environ={})
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_second_job_with_nproc_leaves_a_running_jobs_folder_alone(tiny_corpus, tmp_path):
    """The one-node launcher takes the lock before --resume auto may clear anything: a second
    job with --nproc 2 into a folder a single process is training stops with 2 and removes
    nothing of it."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "busy"
    with _training_in(cfg, out) as first:
        r = subprocess.run([CLI, "train", "--config", str(cfg), "--out", str(out), "--nproc",
                            "2", "--resume", "auto"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and "in use by another job" in r.stderr, r.stderr
        assert (out / "config.toml").exists() and (out / "metrics.jsonl").exists()
        assert first.poll() is None  # still training


@pytest.mark.slow
def test_signals_in_quick_succession_during_start_up_end_the_command_once(tiny_corpus,
                                                                          tmp_path):
    """A rank that gets the scheduler's signal directly and again from its launcher, or a
    requeue signal and SIGTERM together: one clean stop, status 75, no traceback."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    for second in (signal.SIGUSR1, signal.SIGTERM):
        out = tmp_path / f"twice{int(second)}"
        p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_for(out / runlock.LOCK_NAME, timeout=60)
        p.send_signal(signal.SIGUSR1)
        time.sleep(0.002)
        p.send_signal(second)
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == REQUEUE_STATUS, (second, stdout, stderr)
        assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_launcher_waiting_at_its_rendezvous_answers_signals(tiny_corpus, tmp_path):
    """One of two --nnodes launchers whose peer never comes: SIGTERM ends it with 143 and a
    requeue signal with 75, at once, instead of both being ignored until the rendezvous
    times out."""
    cfg = write_cfg(tmp_path, tiny_corpus)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for sig, status in ((signal.SIGTERM, 143), (signal.SIGUSR1, REQUEUE_STATUS)):
        p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(tmp_path / "n"),
                              "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
                              f"127.0.0.1:{_free_port()}", "--rdzv-id", f"lonely{sig}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        out = ""
        while "launching: torchrun" not in out and time.time() < deadline:
            out += p.stdout.readline()
        time.sleep(2)  # inside the rendezvous
        t0 = time.time()
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == status, (sig, stdout, stderr)
        assert time.time() - t0 < 30


@pytest.mark.slow  # a killed first run, then two ranks started like srun
def test_srun_ranks_restart_a_run_that_died_before_its_first_checkpoint(tiny_corpus, tmp_path):
    # the same job both times (a requeue): no checkpoint and no evaluation before step 300
    cfg = write_cfg(tmp_path, tiny_corpus, steps=300, ckpt=1000)
    out = tmp_path / "died"
    every = ("--set", "train.eval_interval=1000")
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), *every],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(out / "config.toml", timeout=120)
    _wait_for(out / "metrics.jsonl", timeout=120)
    p.kill()  # a node lost: config.toml and metrics.jsonl written, no checkpoint yet
    p.wait()
    if (out / "checkpoints").exists() or max(losses(out), default=0) >= 300:
        pytest.skip("the killed run got as far as a checkpoint on this machine")
    procs = _srun(cfg, out, 2, 77, "--resume", "auto", *every)
    outs = [q.communicate(timeout=300) for q in procs]
    assert [q.returncode for q in procs] == [0, 0], outs
    assert max(losses(out)) == 300


@pytest.mark.slow  # two ranks under a launcher that is then killed
def test_ranks_stop_when_their_launcher_dies(tiny_corpus, tmp_path):
    """The one-node launcher holds the lock for its ranks; killed (SIGKILL), its ranks must not
    train on unguarded: they get SIGTERM, save and stop."""
    cfg = write_cfg(tmp_path, tiny_corpus, steps=100000, ckpt=1000)
    out = tmp_path / "orphans"
    p = subprocess.Popen([CLI, "train", "--config", str(cfg), "--out", str(out), "--nproc", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(out / "metrics.jsonl", timeout=180)
    while len(losses(out)) < 3:
        time.sleep(0.05)
    ranks = [int(s.parent.name) for s in Path("/proc").glob("[0-9]*/stat")
             if _parent(s) == p.pid]
    assert ranks
    p.kill()
    p.wait()
    deadline = time.time() + 120
    while time.time() < deadline and any(Path(f"/proc/{r}").exists() and not _zombie(r)
                                         for r in ranks):
        time.sleep(0.2)
    alive = [r for r in ranks if Path(f"/proc/{r}").exists() and not _zombie(r)]
    for r in alive:
        os.kill(r, signal.SIGKILL)
    assert not alive, "ranks outlived their launcher"
    verify_checkpoint((out / "checkpoints" / "last").resolve())  # they saved on the way out


def _parent(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
