"""Training step time with and without ``train.keep_freed_memory`` (glibc's malloc keeping
freed blocks in the process instead of unmapping every block above 32 MB), on configs whose
steps allocate large tensors (PTB's 10k-word logits, MQAR's 8,192-word head) and on one that
does not (the baby GPT).

    python bench/keep_freed_memory.py [--steps 30]   # writes bench/results/keep_freed_memory.json
    python bench/keep_freed_memory.py --only configs/shakespeare_char/transformer_baby.toml

Each point is a real ``continuumlm train`` (or ``continuumlm mqar``) run in a fresh process
with one thread, the two settings of a config run back to back. s / step is the median of the
logged per-step throughput after the first quarter of the steps; page faults, system time and
peak resident memory are the child process's own (``os.wait4``), start-up and data included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, OtherLoad, markdown_table, write_json

from continuumlm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")

# (config, command, steps per --steps, extra settings); MQAR with a small generated set, as
# its data size does not change the step; the baby GPT's 0.1 s steps ten times as many
CONFIGS = [
    ("configs/ptb_std/transformer.toml", "train", 1, []),
    ("configs/ptb_std/ode_euler.toml", "train", 1, []),
    ("configs/mqar/softmax_kv64.toml", "mqar", 1,
     ["mqar.train_examples=2048", "mqar.test_examples=64"]),
    ("configs/shakespeare_char/transformer_baby.toml", "train", 10, []),
]


def tokens_per_step(config: str, command: str) -> int:
    """What the trainer's tokens/s counts per step (one process)."""
    cfg = load_config(ROOT / config)
    t = cfg.train
    return t.batch_size * t.grad_accum * (cfg.mqar.seq_len if command == "mqar" else t.seq_len)


def run(config: str, command: str, extra: list[str], keep: bool, steps: int) -> dict:
    tokens = tokens_per_step(config, command)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        sets = [f"train.max_steps={steps}", f"train.eval_interval={10 * steps}",
                f"train.checkpoint_interval={10 * steps}", "train.log_interval=1",
                f"train.keep_freed_memory={str(keep).lower()}", "train.device=cpu", *extra]
        cmd = [CLI, command, "--config", str(ROOT / config), "--out", str(out), "--quiet",
               *sum((["--set", s] for s in sets), [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        errors = Path(tmp) / "stderr.txt"  # a file, not a pipe: nothing blocks the child
        with OtherLoad() as load, errors.open("w") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage
            wall = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code:
            raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{errors.read_text()}")
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
    tps = tps[len(tps) // 4:]
    row = {"config": config, "keep_freed_memory": keep, "steps": steps,
           "s_per_step": round(tokens / statistics.median(tps), 3),
           "minor_faults": usage.ru_minflt, "system_s": round(usage.ru_stime, 1),
           "user_s": round(usage.ru_utime, 1), "peak_rss_mb": round(usage.ru_maxrss / 1024),
           "wall_s": round(wall, 1), "other_cores": load.cores}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="configs to run again; the other rows are kept "
                    "from bench/results/keep_freed_memory.json")
    args = ap.parse_args()
    unknown = set(args.only or ()) - {c[0] for c in CONFIGS}
    if unknown:
        raise SystemExit(f"--only: {', '.join(sorted(unknown))} not among "
                         f"{', '.join(c[0] for c in CONFIGS)}")
    kept = []
    if args.only and (RESULTS / "keep_freed_memory.json").exists():
        kept = json.loads((RESULTS / "keep_freed_memory.json").read_text())["rows"]
    rows = []
    for config, command, scale, extra in CONFIGS:
        if args.only and config not in args.only:
            rows += [r for r in kept if r["config"] == config]
            continue
        off = run(config, command, extra, False, scale * args.steps)
        on = run(config, command, extra, True, scale * args.steps)
        on["speedup"] = round(off["s_per_step"] / on["s_per_step"], 2)
        on["rss_ratio"] = round(on["peak_rss_mb"] / off["peak_rss_mb"], 2)
        rows += [off, on]
    table = markdown_table(rows, [
        ("config", "config"), ("keep_freed_memory", "train.keep_freed_memory"),
        ("steps", "steps"), ("s_per_step", "s / step"), ("speedup", "speedup"), ("minor_faults", "page faults (run)"),
        ("system_s", "system s (run)"), ("peak_rss_mb", "peak MB"), ("rss_ratio", "peak vs off"),
        ("other_cores", "other cores busy")])
    write_json("keep_freed_memory", {
        "command": "python bench/keep_freed_memory.py",
        "setup": "one thread, a fresh process per point, the two settings of a config back to "
                 "back; s / step is the median after the first quarter of the steps",
        "rows": rows,
        "table": table})
    print(table)


if __name__ == "__main__":
    main()
