"""One MQAR config: train (resumable), score, and record the result.

    python bench/mqar_runs.py configs/mqar/deltanet_kv64.toml [--set SECTION.KEY=VALUE ...]

Runs ``continuumlm mqar`` into runs/bench/mqar-<name> (it continues from its state file when
interrupted) and writes bench/results/mqar-<name>.json once the run is complete; a config whose
JSON exists is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from common import RESULTS, ROOT, RUNS

CLI = str(Path(sys.executable).parent / "continuumlm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    config = Path(args.config)
    config = config if config.is_absolute() else (ROOT / config)
    name = f"mqar-{config.stem}"
    dest = RESULTS / f"{name}.json"
    if dest.exists():
        print(f"skip {dest} (exists)")
        return
    run = RUNS / name
    cmd = [CLI, "mqar", "--config", str(config), "--out", str(run),
           *sum((["--set", s] for s in args.set), [])]
    subprocess.run(cmd, check=True)
    result = json.loads((run / "result.json").read_text())
    result.update(config=str(config.relative_to(ROOT)), overrides=args.set,
                  command="continuumlm " + " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
                  machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))


if __name__ == "__main__":
    main()
