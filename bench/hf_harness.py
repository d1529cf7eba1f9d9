"""lm-evaluation-harness on trained checkpoints, at several ODE depths, beside continuumlm eval.

    python bench/hf_harness.py        # writes bench/results/hf_harness.json

Trains (or resumes) the Tiny Shakespeare ODE configs `ode_rk4` (RK4 x 4) and `ode_euler`
(Euler x 4) at their own settings (seed 1337), and the Penn Treebank configs `ptb/transformer`
and `ptb/ode_rk4` (seed 42), into runs/bench/hf_harness/, then runs `continuumlm harness
--checkpoint RUN [--ode-solver S --ode-steps N]` at the training context (64) on the whole
validation split (Shakespeare) or test file (PTB): lm-eval's `--model hf` path with
trust_remote_code on a local rolling-loglikelihood task, and continuumlm eval on the same
tokens. Each result is saved as it finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS,
    ROOT,
    RUNS,
    finished_run,
    machine,
    markdown_table,
    other_settings,
    replace_json,
)

RUNS_HERE = RUNS / "hf_harness"
CLI = [sys.executable, "-m", "continuumlm"]
# run name -> (config, seed, split, [(solver, steps)]; None: as trained)
PLAN = {"ode_rk4": ("configs/shakespeare_char/ode_rk4.toml", 1337, "val",
                    [("rk4", 1), ("rk4", 2), ("rk4", 4), ("rk4", 8), ("euler", 16)]),
        "ode_euler": ("configs/shakespeare_char/ode_euler.toml", 1337, "val",
                      [("euler", 4), ("euler", 8), ("rk4", 4)]),
        "ptb-transformer": ("configs/ptb/transformer.toml", 42, "test", [None]),
        "ptb-ode_rk4": ("configs/ptb/ode_rk4.toml", 42, "test",
                        [("rk4", 2), ("rk4", 4), ("rk4", 8)])}


def main() -> None:
    out_json = RESULTS / "hf_harness.json"
    res = json.loads(out_json.read_text()) if out_json.is_file() else {}
    res.update({"machine": machine(), "command": "python bench/hf_harness.py"})
    rows = res.setdefault("rows", {})
    for name, (config, seed, split, depths) in PLAN.items():
        run = RUNS_HERE / name
        keys = [f"{name}:{d[0]}x{d[1]}" if d else f"{name}:trained" for d in depths]
        if all(k in rows for k in keys):
            continue  # recorded already: no need to train it again
        if (run / "checkpoints" / "last").exists():
            # a folder trained with other settings (an edited config) is not this row's model
            keys = other_settings(run, ROOT / config, [f"train.seed={seed}"])
            if keys:
                raise SystemExit(f"{run} holds a run with other settings ({', '.join(keys)}) "
                                 f"than {config}; delete it to train this one.")
        if not finished_run(run):
            subprocess.run([*CLI, "train", "--config", config, "--out", str(run), "--resume",
                            "auto", "--quiet", "--set", f"train.seed={seed}"], cwd=ROOT,
                           check=True)
        for depth in depths:
            solver, steps = depth or (None, None)
            key = f"{name}:{solver}x{steps}" if depth else f"{name}:trained"
            if key in rows:
                continue
            how = ["--ode-solver", solver, "--ode-steps", str(steps)] if depth else []
            r = subprocess.run([*CLI, "harness", "--checkpoint", str(run), "--split", split,
                                *how, "--json"], cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"harness {key} failed:\n{r.stderr[-3000:]}")
            d = json.loads(r.stdout)
            rows[key] = {"config": name, "split": split, "solver": solver, "steps": steps,
                         "nfe": d["nfe"],
                         "tokens": d["tokens"], "harness_bpb": d["harness"]["bits_per_byte"],
                         "harness_byte_ppl": d["harness"]["byte_perplexity"],
                         "harness_word_ppl": d["harness"]["word_perplexity"],
                         "ours_bpb": d["ours"]["bits_per_byte"], "ours_loss": d["ours"]["loss"],
                         "ratio": d["bits_per_byte_ratio"],
                         "exact_ratio": d.get("harness_windows_ratio")}
            print(key, rows[key], flush=True)
            _write(out_json, res)
    _write(out_json, res)


def _write(path: Path, res: dict) -> None:
    rows = [{**r, "depth": f"{r['solver']} x {r['steps']}" if r.get("solver") else "as trained",
             "split": r.get("split", "val"),
             "bpb": f"{r['harness_bpb']:.4f}", "obpb": f"{r['ours_bpb']:.4f}",
             "wppl": f"{r['harness_word_ppl']:.2f}", "r": f"{r['ratio']:.4f}",
             # the model on lm-eval's own windows (rows recorded before that check: blank)
             "rx": f"{r['exact_ratio']:.6f}" if r.get("exact_ratio") else ""}
            for r in res["rows"].values()]
    res["setup"] = ("Tiny Shakespeare validation split (111,540 characters) or the PTB test file "
                    "(82,430 words), context 64, batch 1; "
                    "lm-eval 0.4.13 `--model hf` with trust_remote_code on a local "
                    "loglikelihood_rolling task (`continuumlm harness`); bits per byte of both, "
                    "the harness's word perplexity (per whitespace-separated word of the text: "
                    "on PTB the line ends, which ContinuumLM scores as <eos> tokens, are not "
                    "words, so it is exp(total / words) where the per-token perplexity of "
                    "continuumlm eval is exp(total / tokens))")
    res["table"] = markdown_table(rows, [("config", "checkpoint"), ("split", "split"),
                                         ("depth", "integrated with"),
                                         ("nfe", "NFE"), ("bpb", "lm-eval bits/byte"),
                                         ("obpb", "continuumlm eval bits/byte"),
                                         ("r", "ratio"),
                                         ("rx", "ratio to the model on lm-eval's windows"),
                                         ("wppl", "lm-eval word ppl")])
    replace_json(path, res)


if __name__ == "__main__":
    main()
