"""Helpers shared by the benchmarks: machine description, JSON output, timing."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# `continuumlm experiment NAME --quick` points these elsewhere so smoke runs never mix with the
# committed results.
RESULTS = Path(os.environ.get("CONTINUUMLM_RESULTS_DIR", ROOT / "bench" / "results"))
RUNS = Path(os.environ.get("CONTINUUMLM_RUNS_DIR", ROOT / "runs" / "bench"))
DOCS_DIR = Path(os.environ.get("CONTINUUMLM_DOCS_DIR", ROOT / "docs"))


def load_mark(runs: list[dict]) -> str:
    """How far a training run's throughput can be trusted, from the 1-minute load averages its
    JSON recorded before and after: "" measured alone (both at most 1.5), " *" the 2 cores were
    shared (understated), " °" no load was recorded (older runs: whether it was shared is not
    known)."""
    if any(not r.get("load_average") for r in runs):
        return " °"
    return " *" if any(max(r["load_average"]) > 1.5 for r in runs) else ""


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
    payload = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


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


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "| " + " | ".join("---" for _ in columns) + " |"
    body = []
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, sep, *body])
