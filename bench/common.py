"""Helpers shared by the benchmarks: machine description, JSON output, timing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# `continuumlm experiment NAME --quick` points these elsewhere so smoke runs never mix with the
# committed results.
RESULTS = Path(os.environ.get("CONTINUUMLM_RESULTS_DIR", ROOT / "bench" / "results"))
RUNS = Path(os.environ.get("CONTINUUMLM_RUNS_DIR", ROOT / "runs" / "bench"))
DOCS_DIR = Path(os.environ.get("CONTINUUMLM_DOCS_DIR", ROOT / "docs"))


# A run counts as measured alone when the rest of the machine kept less than this many cores
# busy on average while it trained.
SHARED_CORES = 0.2


def rss_now_kb() -> int:
    """This process's resident set size now (Linux /proc), in kB; 0 elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def training_step_peak(model, x, timed: int = 1) -> tuple[float, float]:
    """(peak MB, seconds) of one forward+backward of ``model`` on ``x`` (targets ``x``) in a
    fresh process: the peak resident set growth over the size just before it (after a warm-up
    step on a 2-token input that loads every module), and the fastest of that step and
    ``timed`` more (allocator warm)."""
    import resource
    import time

    _, loss = model(x[:1, :2], x[:1, :2])  # warm-up: imports and one-off allocations
    loss.backward()
    model.zero_grad(set_to_none=True)
    before_kb = rss_now_kb()
    seconds = float("inf")
    for i in range(1 + timed):
        model.zero_grad()
        t0 = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        seconds = min(seconds, time.perf_counter() - t0)
        if i == 0:
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (peak_kb - before_kb) / 1024, seconds


def checkpoint_step(run: Path, which: str = "last") -> int | None:
    """The step of the run's ``last`` (or ``best``) checkpoint, read from the folder it points
    to (step-NNNNNNNN); None without one."""
    link = run / "checkpoints" / which
    if not link.exists():
        return None
    try:
        return int(link.resolve().name.rpartition("-")[2])
    except ValueError:
        return None


def finished_run(run: Path) -> bool:
    """Whether the training run in ``run`` has a checkpoint of its last step (a run still
    going, or stopped early, has only earlier ones: its model is not the one a result names)."""
    step = checkpoint_step(run)
    if step is None:
        return False
    from continuumlm.runs.checkpoint import load_run_config

    return step >= load_run_config((run / "checkpoints" / "last").resolve()).train.max_steps


def other_settings(run: Path, config, overrides: list[str]) -> list[str]:
    """The settings ("section.key") in which the run in ``run`` (its last checkpoint) differs
    from ``config`` with ``overrides``: a folder to be resumed or reused must hold this run,
    not one made with another --set or an edited config."""
    from continuumlm.config import load_config
    from continuumlm.runs.checkpoint import load_run_config

    saved = load_run_config((run / "checkpoints" / "last").resolve()).to_dict()
    wanted = load_config(config, list(overrides)).to_dict()
    if not wanted["model"]["vocab_size"]:  # filled in from the tokenizer at the start
        wanted["model"]["vocab_size"] = saved["model"]["vocab_size"]
    return [f"{s}.{k}" for s in wanted for k in wanted[s]
            if saved.get(s, {}).get(k) != wanted[s][k]]


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores have spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How many cores other work kept busy while this process's children ran:
    (machine busy time - CPU time of this process and its finished children) / wall time.
    Unlike the load average, the run's own threads do not count, so a 2-thread run alone on
    2 cores reads about 0, not 2."""

    def __enter__(self) -> OtherLoad:
        self.cores = None
        self._t, self._busy, self._own = time.perf_counter(), machine_busy_seconds(), _own_cpu()
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = machine_busy_seconds(), time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            others = (busy - self._busy) - (_own_cpu() - self._own)
            self.cores = round(max(others, 0.0) / wall, 3)


def _own_cpu() -> float:
    import resource

    return sum(getattr(resource.getrusage(w), f) for w in
               (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))


def load_mark(runs: list[dict]) -> str:
    """How far a training run's throughput can be trusted: "" measured alone (other work kept
    under SHARED_CORES cores busy during the run, recorded as ``other_cores``), " *" the cores
    were shared (understated; runs recorded before ``other_cores`` are judged by their 1-minute
    load averages, which count the run's own threads, so alone runs may carry the mark too),
    " °" not known (nothing recorded, ``other_cores`` None: a resumed run, whose earlier part
    was not watched, or a machine without /proc/stat). A run known to be shared marks the row
    " *" whatever the others' marks: its figures are known to be understated."""
    if any((r.get("other_cores") or 0) > SHARED_CORES for r in runs):
        return " *"
    if any(r.get("other_cores", 0) is None for r in runs):
        return " °"
    if all("other_cores" in r for r in runs):
        return " *" if any(r["other_cores"] > SHARED_CORES for r in runs) else ""
    if any(not r.get("load_average") and "other_cores" not in r for r in runs):
        return " °"
    return " *"


def timed_runs(runs: list[dict]) -> tuple[list[dict], str]:
    """The runs whose throughput and wall time a results row shows, and the row's mark: the
    runs measured alone when there are any (a shared run's tokens/s understate the model, and
    the seeds of one config train the same model at the same cost), else all, marked."""
    alone = [r for r in runs if not load_mark([r])]
    return (alone, "") if alone else (runs, load_mark(runs))


def expected_elastic_nfe(cfg) -> float:
    """The mean forward NFE per optimizer step of an elastic run, from its draw set (uniform
    over the allowed (solver, steps) pairs, or over each list; the model's own solve before
    train.elastic.start), summed over its ODE blocks as the logged NFE is."""
    from continuumlm.config.elastic import solve_nfe, solve_pairs

    m, t = cfg.model, cfg.train
    drawn = statistics.mean(solve_nfe(m, s, n) for s, n in solve_pairs(m, t.elastic))
    start = min(t.elastic.start, t.max_steps)
    own = solve_nfe(m, m.ode_solver, m.ode_steps)
    return m.num_layers * (start * own + (t.max_steps - start) * drawn) / t.max_steps


def forward_nfe(r: dict, cfg) -> tuple[float | None, bool]:
    """A training run's forward NFE per step and whether it varies from step to step: an
    elastic run's expected NFE from its draw set (:func:`expected_elastic_nfe`; its last
    logged step is one draw, and the last tenth of training a few dozen draws), an adaptive
    solver's mean over the last tenth of training (None where the JSON predates that record),
    else the fixed count. ``r``: the run's result JSON; ``cfg``: its config with overrides."""
    from continuumlm.registry import SOLVERS

    if cfg.model.depth == "ode" and (cfg.train.elastic.steps
                                     or cfg.train.elastic.solvers):
        return expected_elastic_nfe(cfg), True
    if cfg.model.depth == "ode" and not getattr(
            SOLVERS.component_class(cfg.model.ode_solver), "fixed_grid", True):
        return r.get("nfe_mean_last_tenth"), True
    return r.get("nfe") or cfg.model.num_layers, False


def canonical_overrides(overrides) -> tuple:
    """--set options with each key under today's spelling (records keep the spelling of their
    day: train.consistency_weight is train.elastic.consistency_weight), to tell recipes apart."""
    from continuumlm.config import canonical_key

    return tuple(f"{canonical_key(k.strip())}={v}" for k, _, v in
                 (o.partition("=") for o in overrides or ()))


def run_config(r: dict, *extra: str):
    """The RunConfig a result JSON's run trained with: its config file and --set options."""
    from continuumlm import load_config

    # a record keeps the spelling of its day (train.kinetic_weight): read under today's
    return load_config(ROOT / r["config"],
                       list(canonical_overrides([*(r.get("overrides") or []), *extra])))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    return (f"{cpu_model()}, {os.cpu_count()} cores, CPU, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    replace_json(path, {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload})
    return path


def replace_json(path: Path, payload: dict) -> None:
    """Write ``path`` whole: an interruption leaves the old JSON or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def time_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn() in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


def say_untrained(missing: list[str]) -> None:
    """Name, on stderr, the models a benchmark left out because no finished run of theirs is in
    runs/bench/."""
    if missing:
        print(f"not trained (run bench/train_seeds.py on their configs): {', '.join(missing)}",
              file=sys.stderr)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = []
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key, "")
            cells.append("" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])


def exit_run(run: str):
    """A trained run for the exit benches (gate_exit.py, exit_ladder.py): (model at its best
    checkpoint, run config, validation split, the own solve's field evaluations per token,
    the run's name)."""
    from continuumlm.data import prepare_data
    from continuumlm.runs import load_model_and_tokenizer
    from continuumlm.runs.checkpoint import load_run_config

    model, tok, ckpt = load_model_and_tokenizer(run, "best")
    cfg = load_run_config(ckpt)
    split = prepare_data(cfg.data, tok).splits["val"]
    full_nfe = model.config.num_layers * model.config.ode_steps * \
        model.depth.blocks[0].solver.evals_per_step
    return model, cfg, split, full_nfe, run.rstrip("/").split("/")[-1]
