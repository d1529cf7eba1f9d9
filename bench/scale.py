"""Training throughput on this machine: 1 vs 2 processes (torchrun, DDP over gloo) and
torch.compile vs eager and bf16 autocast vs fp32, on the baby-GPT config.

    python bench/scale.py [--steps 300]

Each point is a real ``continuumlm train`` run (subprocess); tokens/s is the median of the
logged windows after the first (which holds start-up and, when compiling, the compilation).
Every process keeps the per-process batch of 12 sequences, so 2 processes train on twice the
tokens per step; scaling efficiency = tokens/s(2 procs) / (2 x tokens/s(1 proc, 1 thread)).
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

from common import markdown_table, write_json

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")
CONFIG = ROOT / "configs" / "shakespeare_char" / "transformer_baby.toml"


def train(label: str, steps: int, threads: int, nproc: int = 1, extra: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        sets = [f"train.max_steps={steps}", f"train.eval_interval={steps}", "train.eval_iters=2",
                f"train.checkpoint_interval={steps}", "train.log_interval=20", *extra]
        args = ["train", "--config", str(CONFIG), "--out", str(out), "--quiet",
                *sum((["--set", s] for s in sets), [])]
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", "continuumlm", *args]
        else:
            cmd = [CLI, *args]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        wall = time.perf_counter() - t0
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m][1:]
    row = {"setup": label, "processes": nproc, "threads_per_process": threads,
           "tokens_per_s": round(statistics.median(tps)), "wall_s": round(wall, 1),
           "steps": steps,
           "command": " ".join({CLI: "continuumlm", sys.executable: "python"}.get(c, c)
                               for c in cmd[:2]) + " ..."}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rows = [
        train("1 process, 1 thread", args.steps, 1),
        train(f"1 process, {cores} threads", args.steps, cores),
        train("2 processes (DDP, gloo), 1 thread each", args.steps, 1, nproc=2),
        train(f"1 process, {cores} threads, torch.compile", args.steps, cores,
              extra=("train.compile=true",)),
        train(f"1 process, {cores} threads, bf16 autocast", args.steps, cores,
              extra=("train.dtype=bf16",)),
    ]
    one, two = rows[0]["tokens_per_s"], rows[2]["tokens_per_s"]
    summary = {"scaling_efficiency_2proc": two / (2 * one),
               "speedup_2proc_vs_best_1proc": two / max(rows[0]["tokens_per_s"],
                                                        rows[1]["tokens_per_s"]),
               "compile_speedup": rows[3]["tokens_per_s"] / rows[1]["tokens_per_s"],
               "bf16_speedup": rows[4]["tokens_per_s"] / rows[1]["tokens_per_s"]}
    table = markdown_table(rows, [("setup", "setup"), ("tokens_per_s", "tokens/s"),
                                  ("wall_s", "wall s (incl. start-up)")])
    setup = (f"{CONFIG.relative_to(ROOT)}, {args.steps} steps, batch 12 x 64 per process; "
             f"scaling efficiency {summary['scaling_efficiency_2proc']:.2f} (2 processes vs 2x "
             f"one single-thread process), 2 processes vs the best single process "
             f"{summary['speedup_2proc_vs_best_1proc']:.2f}x, compile speedup "
             f"{summary['compile_speedup']:.2f}x, bf16 autocast {summary['bf16_speedup']:.2f}x")
    write_json("scale", {"command": "python bench/scale.py", "setup": setup,
                         "config": str(CONFIG.relative_to(ROOT)), "rows": rows, **summary,
                         "table": table})
    print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
