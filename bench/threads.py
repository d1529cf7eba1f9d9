"""Intra-op threads on a quiet machine and beside other work: torch's default count, one
thread, and the thread policy (``--threads auto``, continuumlm.threads).

    python bench/threads.py            # writes bench/results/threads.json
    python bench/threads.py --suite --demo --only   # times only the test suite and make demo

Every figure is a process of its own, as a user runs it (a quiet figure the median of three
such processes). "Loaded" runs beside two busy
processes (a Python loop each, started by this script a second before and stopped after), which
on 2 cores leaves a fair share of about 2/3 of a core. The work:

- demo training: configs/shakespeare_char/demo.toml (d 128, 4 layers), 60 steps, tokens/s of
  the training steps as ``continuumlm train`` reports them;
- RK4 x 4 training: configs/shakespeare_char/ode_rk4.toml with 4 blocks (NFE 64 per forward),
  12 steps;
- decoding: 4 ODE blocks (sequential field, softmax) of 4 RK4 steps, d 128 (as
  bench/decode_speed.py), 64-token prompt, greedy: eager cached (256 new tokens), recompute
  (24 new tokens) and compiled (256 new tokens, timed on a second generation: the compile is
  left out).

"default" is torch's own count (this machine's cores), which ContinuumLM used before the
policy; "1" one thread; "auto" the policy, made at the child's start and looked at again every
few seconds while the work runs. ``--suite`` times ``pytest`` (the `make test` selection) quiet
and loaded, and a part of it (the model and mixer tests) with the suite's threads at 2 (as
before conftest.py set 1) and at 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from common import RESULTS, ROOT, write_json

POLICIES = ("default", "1", "auto")
TRAIN = {"demo_train": ("configs/shakespeare_char/demo.toml", 60, []),
         "rk4x4_train": ("configs/shakespeare_char/ode_rk4.toml", 12, ["model.num_layers=4"])}
DECODE = {"decode_cached": 256, "decode_recompute": 24, "decode_compiled": 256}
SUITE_PART = ["tests/test_model.py", "tests/test_mixers.py"]
TARGET = {"train": 0.4, "decode": 0.5}  # loaded / quiet, per row, for the policy
FAIR_SHARE = 2 / 3  # of a core: what two busy processes and this one on 2 cores leave it


class Load:
    """``n`` busy processes for the length of a with-block."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        time.sleep(1.0 if self.n else 0.0)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def default_threads() -> int:
    """torch's own count in a fresh process without OMP_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, env=env, check=True)
    return int(out.stdout)


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def run_train(work: str, policy: str, default: int, runs_dir) -> dict:
    config, steps, sets = TRAIN[work]
    out = os.path.join(runs_dir, f"{work}-{policy}-{time.monotonic_ns()}")
    threads = str(default) if policy == "default" else policy
    cmd = [sys.executable, "-m", "continuumlm", "train", "--config", str(ROOT / config),
           "--out", out, "--threads", threads, "--set", f"train.max_steps={steps}",
           "--set", "train.eval_interval=100000", "--set", "train.eval_iters=1",
           "--set", "train.log_interval=2", "--set", "train.checkpoint_interval=100000"]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{work} ({policy}) failed:\n{r.stderr[-2000:]}")
    tps = float(re.search(r"([\d.]+) tokens/s, [\d.]+ s training", r.stdout).group(1))
    chosen = re.search(r"on cpu, (\d+) threads? \(([^)]*)\)", r.stdout)
    last = re.findall(r"tokens/s, (\d+) threads?, ", r.stdout)
    return {"tokens_per_s": tps, "wall_s": round(wall, 1), "threads_start": int(chosen.group(1)),
            "threads_end": int(last[-1]) if last else int(chosen.group(1)),
            "reason": chosen.group(2)}


def decode_child(work: str, policy: str) -> None:
    """In the child: build, decode, print one JSON line."""
    from continuumlm.threads import ThreadPolicy

    threads = None if policy == "default" else ThreadPolicy(policy, "decoding")
    import torch

    from continuumlm import LanguageModel, ModelConfig

    torch.manual_seed(0)
    m = LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=4,
                                  max_seq_len=512, mixer="softmax", depth="ode",
                                  field="sequential", ode_solver="rk4", ode_steps=4)).eval()
    prompt = torch.randint(0, 65, (1, 64), generator=torch.Generator().manual_seed(1))
    n = DECODE[work]
    kw = dict(greedy=True, use_cache=work != "decode_recompute",
              compile=work == "decode_compiled", threads=threads)
    if work == "decode_compiled":
        m.generate(prompt, n, **kw)  # compiles; the second generation is timed
    t0 = time.perf_counter()
    m.generate(prompt, n, **kw)
    dt = time.perf_counter() - t0
    chosen = threads.choice if threads is not None else None
    print(json.dumps({"tokens_per_s": n / dt,
                      "threads_end": chosen.threads if chosen else torch.get_num_threads(),
                      "changes": threads.changes if threads else 0,
                      "reason": chosen.reason if chosen else "torch's default"}))


def run_decode(work: str, policy: str) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--child", work, policy], capture_output=True,
                       text=True, env=child_env(), cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{work} ({policy}) failed:\n{r.stderr[-2000:]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "wall_s": round(wall, 1)}


def run_suite(paths: list[str], test_threads: int | None) -> dict:
    env = child_env()
    if test_threads is not None:
        env["CONTINUUMLM_TEST_THREADS"] = str(test_threads)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *paths],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    counts = re.findall(r"\d+ (?:passed|failed|skipped|deselected|errors?)", r.stdout)
    return {"wall_s": round(wall, 1), "counts": ", ".join(counts), "status": r.returncode}


def run_demo() -> dict:
    """``make demo`` as a user runs it (installed already): train, eval, generate."""
    t0 = time.perf_counter()
    r = subprocess.run(["make", "demo"], capture_output=True, text=True, env=child_env(),
                       cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"make demo failed:\n{r.stderr[-2000:]}")
    done = re.search(r"([\d.]+) tokens/s, ([\d.]+) s training", r.stdout)
    return {"wall_s": round(wall, 1), "train_tokens_per_s": float(done.group(1)),
            "summary": f"training {float(done.group(2)):.0f} s at {float(done.group(1)):,.0f} "
                       f"tokens/s"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("WORK", "POLICY"))
    ap.add_argument("--suite", action="store_true", help="also time the test suite")
    ap.add_argument("--only", nargs="*", help="these rows only (names as in the JSON; none: "
                    "no rows, with --suite or --demo)")
    ap.add_argument("--loads", nargs="+", default=["quiet", "loaded"],
                    choices=("quiet", "loaded"), help="measure under these loads only")
    ap.add_argument("--demo", action="store_true", help="also time make demo, quiet and "
                    "loaded")
    ap.add_argument("--table-only", action="store_true", help="measure nothing: write the "
                    "table again from the recorded figures")
    ap.add_argument("--repeats", type=int, default=3, help="processes per quiet figure (its "
                    "median; a loaded figure is one process: the load is the noise)")
    args = ap.parse_args()
    if args.child:
        return decode_child(*args.child)
    import tempfile

    default = default_threads()
    path = RESULTS / "threads.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    rows = {(r["work"], r["load"], r["policy"]): r for r in old.get("rows", [])}
    works = [] if args.table_only else args.only if args.only is not None else [*TRAIN, *DECODE]
    with tempfile.TemporaryDirectory(prefix="threads_bench_") as runs_dir:
        for work in works:
            for load in args.loads:
                for policy in POLICIES:
                    samples = []
                    with Load(2 if load == "loaded" else 0):
                        for _ in range(args.repeats if load == "quiet" else 1):
                            samples.append(run_train(work, policy, default, runs_dir)
                                           if work in TRAIN else run_decode(work, policy))
                    r = sorted(samples, key=lambda x: x["tokens_per_s"])[len(samples) // 2]
                    r["samples"] = [round(x["tokens_per_s"], 1) for x in samples]
                    rows[(work, load, policy)] = {"work": work, "load": load, "policy": policy,
                                                  **r}
                    print(f"{work:18} {load:7} {policy:8} {r['tokens_per_s']:10.1f} tokens/s "
                          f"(threads {r['threads_end']}, {r['wall_s']} s; {r['samples']})",
                          flush=True)
    suite = old.get("suite", {})
    if args.suite and not args.table_only:
        for load in ("quiet", "loaded"):
            with Load(2 if load == "loaded" else 0):
                for threads in (2, 1):
                    suite[f"part_{load}_{threads}"] = run_suite(SUITE_PART, threads)
                    print(f"suite part {load} threads {threads}: {suite[f'part_{load}_{threads}']}",
                          flush=True)
                suite[f"full_{load}"] = run_suite([], None)
                print(f"suite {load}: {suite[f'full_{load}']}", flush=True)
    if args.demo and not args.table_only:
        for load in ("quiet", "loaded"):
            with Load(2 if load == "loaded" else 0):
                suite[f"demo_{load}"] = run_demo()
            print(f"make demo {load}: {suite[f'demo_{load}']}", flush=True)
    raw = sorted(rows.values(), key=lambda r: ([*TRAIN, *DECODE].index(r["work"]),
                                               r["load"] != "quiet", POLICIES.index(r["policy"])))
    table, verdicts = summary(raw)
    write_json("threads", {"default_threads": default, "load": "2 busy Python processes",
                           "rows": raw, "verdicts": verdicts, "suite": suite,
                           "suite_part": SUITE_PART, "target": TARGET,
                           "command": "python bench/threads.py --suite --demo",
                           "setup": SETUP, "table": table + suite_table(suite)})
    print(table)


SETUP = ("each figure a process of its own (quiet: the median of 3) on a quiet machine and "
         "beside 2 busy processes; "
         "tokens/s of training steps (demo: configs/shakespeare_char/demo.toml, 60 steps; "
         "RK4 x 4: configs/shakespeare_char/ode_rk4.toml with 4 blocks, 12 steps) and of "
         "greedy decoding (4 ODE blocks of RK4 x 4, d 128, softmax, 64-token prompt: 256 new "
         "tokens eager cached and compiled, 24 recomputing); torch's default count, 1 thread, "
         "and --threads auto (the threads it used at the end in brackets); the fair-share "
         "ceiling is 2/3 x the quiet 1-thread figure / the quiet auto figure: the most a "
         "process given 2/3 of a core can keep")


def summary(raw: list[dict]) -> tuple[str, list[dict]]:
    """One table row per work: tokens/s quiet and loaded under each policy, auto's loaded /
    quiet ratio against its target, and auto against torch's default when quiet."""
    by = {(r["work"], r["load"], r["policy"]): r for r in raw}
    lines, verdicts = [], []
    for work in [*TRAIN, *DECODE]:
        if not all((work, load, p) in by for load in ("quiet", "loaded") for p in POLICIES):
            continue
        cells = {f"{load}_{p}": by[(work, load, p)]["tokens_per_s"]
                 for load in ("quiet", "loaded") for p in POLICIES}
        kind = "train" if work in TRAIN else "decode"
        ratio = cells["loaded_auto"] / cells["quiet_auto"]
        before = cells["loaded_default"] / cells["quiet_default"]
        vs_default = cells["quiet_auto"] / cells["quiet_default"]
        # what a fair share of the cores allows: two busy processes and this one on two
        # cores leave it 2/3 of a core, at best one thread's quiet speed times 2/3
        ceiling = FAIR_SHARE * cells["quiet_1"] / cells["quiet_auto"]
        verdicts.append({"work": work, "loaded_vs_quiet_auto": ratio,
                         "loaded_vs_quiet_default": before, "target": TARGET[kind],
                         "met": ratio >= TARGET[kind], "quiet_auto_vs_default": vs_default,
                         "fair_share_ceiling": ceiling})
        used = "/".join(str(by[(work, load, "auto")]["threads_end"])
                        for load in ("quiet", "loaded"))
        lines.append(
            f"| {work} | {_rate(cells['quiet_default'])} | {_rate(cells['quiet_1'])} | "
            f"{_rate(cells['quiet_auto'])} | {_rate(cells['loaded_default'])} | "
            f"{_rate(cells['loaded_1'])} | {_rate(cells['loaded_auto'])} | {used} | "
            f"{before:.2f}x | {ratio:.2f}x (target {TARGET[kind]}x: "
            f"{'met' if ratio >= TARGET[kind] else 'missed'}) | {ceiling:.2f}x | "
            f"{vs_default:.2f}x |")
    head = ("| work | quiet: torch default | quiet: 1 thread | quiet: auto | loaded: torch "
            "default | loaded: 1 thread | loaded: auto | auto used (quiet/loaded) | loaded / "
            "quiet, torch default | loaded / quiet, auto | fair-share ceiling | quiet: auto / "
            "torch default |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    return "\n".join([head, *lines]), verdicts


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def suite_table(suite: dict) -> str:
    if not suite:
        return ""
    rows = []
    for key, what in (("demo_quiet", "make demo, quiet"), ("demo_loaded", "make demo, loaded"),
                      ("full_quiet", "make test (pytest), quiet"),
                      ("full_loaded", "make test (pytest), loaded"),
                      ("part_quiet_2", "model + mixer tests at 2 threads (as before), quiet"),
                      ("part_quiet_1", "model + mixer tests at 1 thread (conftest.py), quiet"),
                      ("part_loaded_2", "model + mixer tests at 2 threads (as before), loaded"),
                      ("part_loaded_1", "model + mixer tests at 1 thread (conftest.py), loaded")):
        if key in suite:
            x = suite[key]
            result = (x["summary"] if key.startswith("demo") else
                      ("passed" if x["status"] == 0 else f"failed (exit status {x['status']})")
                      + (f": {x['counts']}" if x.get("counts") else ""))
            rows.append(f"| {what} | {x['wall_s'] / 60:.1f} min | {result} |")
    return ("\n\nThe test suite and the demo, wall time:\n\n| run | wall | result |\n"
            "| --- | --- | --- |\n" + "\n".join(rows))

if __name__ == "__main__":
    main()
