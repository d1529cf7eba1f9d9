"""Train one config with several seeds and record the figures the results table needs.

    python bench/train_seeds.py configs/shakespeare_char/transformer_baby.toml --seeds 1337 1 2

For each seed it runs ``continuumlm train`` as a subprocess (so wall time includes start-up,
evaluation and checkpointing, as a user sees it), then evaluates the final checkpoint on the
whole validation split, and writes ``bench/results/<config>_seed<N>.json``. Runs whose JSON
exists are skipped; an interrupted run (run folder, no JSON) resumes from its checkpoint. Pass
--force to train a seed again from scratch (its run folder is deleted first).

In --set values, {seed} is the run's seed and {runs} the folder of the runs (runs/bench), e.g.
`--set train.distill.teacher={runs}/shakespeare_char-ode_euler_seed{seed}`: each seed distilled
from the teacher trained on that seed. The JSON records the values as they were applied.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

from common import (
    RESULTS,
    RUNS,
    OtherLoad,
    canonical_overrides,
    checkpoint_step,
    cpu_model,
    other_settings,
    replace_json,
)
from experiment import run_child

from continuumlm.cli import main as cli_main
from continuumlm.runs.checkpoint import load_run_config

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).parent / "continuumlm")


def _last_tenth_mean(metrics: list[dict], key: str) -> float | None:
    values = [m[key] for m in metrics if key in m and "loss" in m]
    tail = values[len(values) - max(1, len(values) // 10):] if values else []
    return sum(tail) / len(tail) if tail else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--force", action="store_true", help="train again from scratch: deletes "
                    "the seed's run folder and replaces its JSON")
    ap.add_argument("--contexts", help="also evaluate at these context lengths, e.g. "
                    "128,512,1024,5000 (CAT's protocol)")
    ap.add_argument("--split", default="val")
    ap.add_argument("--max-windows", type=int, help="score at most this many evenly spread "
                    "windows instead of the whole split (smoke tests)")
    ap.add_argument("--also-test", action="store_true",
                    help="also report the test split once, at the end (PTB); added to existing "
                    "JSON whose run folder is still there")
    ap.add_argument("--also-best", action="store_true",
                    help="also score the checkpoint with the best in-training validation "
                    "estimate (early stopping on the validation split) on the whole validation "
                    "split, and with --also-test on the test split; added to existing JSON "
                    "whose run folder is still there")
    ap.add_argument("--tag", help="name the runs and JSON <config>-<TAG>_seed<N> (e.g. one "
                    "point of a hyperparameter sweep made with --set), so they sit beside the "
                    "config's own")
    args = ap.parse_args()
    config = Path(args.config).resolve()
    args.config = str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config)
    name = f"{config.parent.name}-{config.stem}"  # e.g. shakespeare_char-cat_fourier
    if args.tag:
        name += f"-{args.tag}"
    given = args.set
    for seed in args.seeds:
        applied, args.set = seed_sets(given, seed)
        dest = Path(args.out) / f"{name}_seed{seed}.json"
        run = RUNS / f"{name}_seed{seed}"
        if dest.exists() and not args.force:
            old = json.loads(dest.read_text())
            # (a record keeps the spelling of its day: compared under today's)
            if (old.get("config"), canonical_overrides(old.get("overrides", []))) != \
                    (args.config, canonical_overrides(args.set)):
                sys.exit(f"{dest} records {old.get('config')} with --set options "
                         f"{old.get('overrides', [])}, not {args.set}: pass --tag TAG to keep "
                         f"both results (its runs and JSON are named {name}-TAG_seedN), or "
                         f"--force to replace it.")
            print(f"skip {dest} (exists)")
            if (args.also_test or args.also_best) and (run / "checkpoints" / "last").exists():
                # the folder must still hold the model the JSON records, not a later run
                keys = other_settings(run, config, [f"train.seed={seed}", *applied])
                step = checkpoint_step(run)
                if keys or step != old.get("final_step", step):
                    sys.exit(f"{run} no longer holds the run {dest} records (settings "
                             f"{', '.join(keys) or 'alike'}, step {step} against "
                             f"{old.get('final_step')}): the test split and the best checkpoint "
                             f"would score another model. Retrain with --force.")
            if args.also_test:
                add_test(dest, run, args.max_windows)
            if args.also_best:
                add_best(dest, run, args.max_windows, args.also_test)
            continue
        if args.force:
            dest.unlink(missing_ok=True)  # its model is about to go
        if run.exists() and (args.force or not (run / "checkpoints" / "last").exists()):
            shutil.rmtree(run)  # retrained, or stopped before its first checkpoint: start afresh
        cmd = [CLI, "train", "--config", str(config), "--out", str(run), "--quiet",
               "--set", f"train.seed={seed}", *sum((["--set", s] for s in applied), [])]
        resumed = (run / "checkpoints" / "last").exists()
        if resumed:
            # resuming takes the [train] settings of this command; a run made with others
            # (another --set, an edited config) must not be continued and recorded as this one
            keys = other_settings(run, config, [f"train.seed={seed}", *applied])
            if keys:
                sys.exit(f"{run} holds an unfinished run with other settings ({', '.join(keys)}) "
                         f"than {args.config} with --set {args.set}; delete that folder to start "
                         f"this run afresh.")
            cmd.append("--resume")  # an interrupted run continues; its wall time is not comparable
            print(f"resume {run} (no JSON records it yet; to train it again from scratch, pass "
                  f"--force or delete that folder)", flush=True)
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        with OtherLoad() as others:
            r = run_child(cmd)
        wall = time.perf_counter() - t0
        if r.returncode:
            sys.exit(f"`{' '.join(cmd)}` ended with exit status {r.returncode} (its output is "
                     f"above); nothing was recorded. The same command (without --force) resumes the run.")
        row = evaluate(run, args.split, args.max_windows)[0]
        contexts = None
        if args.contexts:
            contexts = evaluate(run, args.split, args.max_windows,
                                "--context-lengths", args.contexts)
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
        nfe = [m["nfe"] for m in metrics if "nfe" in m]
        vals = [m for m in metrics if "val_loss" in m]
        max_steps = load_run_config((run / "checkpoints" / "last").resolve()).train.max_steps
        if not vals or vals[-1]["step"] != max_steps:
            sys.exit(f"{run} stopped before its last step ({max_steps}); nothing was recorded. "
                     f"The same command (without --force) resumes the run.")
        curve = {"val": [[m["step"], m["val_loss"]] for m in vals],
                 "train": [[m["step"], m["loss"]] for m in metrics
                           if "loss" in m and m["step"] % 50 == 0]}
        result = {
            "config": args.config, "overrides": args.set, "seed": seed, "tag": args.tag,
            # as a user types it in the repository, not this machine's paths
            "command": "continuumlm " + " ".join(cmd[1:]).replace(str(ROOT) + "/", ""),
            # the loss on args.split (render.py refuses a split other than val in its tables
            # and marks a score of max_windows windows, a smoke test's, as not the whole split)
            "val_loss_full_split": row["loss"], "val_bpc": row.get("bpc"),
            "max_windows": args.max_windows,
            "val_loss_in_training": vals[-1]["val_loss"], "final_step": vals[-1]["step"],
            "tokens_per_s_median": sorted(tps)[len(tps) // 2] if tps else None,
            "nfe": nfe[-1] if nfe else None,
            # adaptive solvers: the mean forward (and backward) NFE over the last tenth of the
            # logged training steps, where the learned dynamics have settled
            "nfe_mean_last_tenth": _last_tenth_mean(metrics, "nfe"),
            "nfe_backward_mean_last_tenth": _last_tenth_mean(metrics, "nfe_backward"),
            "wall_seconds": None if resumed else wall,
            "machine": f"{cpu_model()}, {os.cpu_count()} cores, CPU",
            # cores that other work kept busy while it trained (its own threads excluded): above
            # common.SHARED_CORES the machine was shared and tokens/s and wall time understate
            # what the model reaches alone. The load averages (which count the run) for context.
            "other_cores": None if resumed else others.cores,  # the earlier part is unknown
            "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "curve": curve,
            "split": args.split,
            "eval_every_target": True,  # eval scores the split's tail too
            "contexts": contexts,
        }
        from continuumlm.runs import load_model_and_tokenizer

        model, _, _ = load_model_and_tokenizer(run, "last")
        result["parameters"] = model.num_parameters()
        replace_json(dest, result)
        if args.also_test:
            add_test(dest, run, args.max_windows)
        if args.also_best:
            add_best(dest, run, args.max_windows, args.also_test)
        print(json.dumps(result))


def seed_sets(values: list[str], seed: int) -> tuple[list[str], list[str]]:
    """A seed's --set values: {seed} and {runs} filled in, as applied (the runs folder's whole
    path) and as recorded (relative to the repository)."""
    applied = [v.replace("{seed}", str(seed)).replace("{runs}", str(RUNS)) for v in values]
    return applied, [v.replace(str(ROOT) + "/", "") for v in applied]


def evaluate(run: Path, split: str, max_windows: int | None, *extra: str,
             which: str = "last") -> list[dict]:
    """`continuumlm eval --json` of the run's last (or best) checkpoint: one result per
    context length.
    Run in this process (the command's own code; a subprocess would add an interpreter
    start-up and torch import per evaluation)."""
    limit = ["--max-windows", str(max_windows)] if max_windows else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli_main(["eval", "--checkpoint", str(run), "--which", which, "--json",
                           "--split", split, *limit, *extra])
    if status:
        sys.exit(f"`continuumlm eval` of {run} ended with exit status {status} (its error is "
                 f"above); nothing was recorded for it.")
    return json.loads(out.getvalue())["results"]


def add_test(dest: Path, run: Path, max_windows: int | None = None) -> None:
    """Score the final checkpoint on the test split once and add it to the JSON."""
    result = json.loads(dest.read_text())
    if "test_loss_full_split" in result:
        return
    if not (run / "checkpoints" / "last").exists():
        print(f"cannot add the test split to {dest}: {run} is gone")
        return
    result["test_loss_full_split"] = evaluate(run, "test", max_windows)[0]["loss"]
    replace_json(dest, result)


def add_best(dest: Path, run: Path, max_windows: int | None, test: bool) -> None:
    """Score the best checkpoint (lowest in-training validation estimate) on the whole
    validation split, and on the test split when ``test``, and add it to the JSON as
    ``best_checkpoint``: the early-stopped model, chosen on the validation split only."""
    result = json.loads(dest.read_text())
    if "best_checkpoint" in result and ("test_loss_full_split" in result["best_checkpoint"]
                                        or not test):
        return
    best = run / "checkpoints" / "best"
    if not best.exists():
        print(f"cannot add the best checkpoint to {dest}: {best} is gone")
        return
    entry = {"step": checkpoint_step(run, "best"),
             "val_loss_full_split": evaluate(run, "val", max_windows, which="best")[0]["loss"]}
    if test:
        entry["test_loss_full_split"] = evaluate(run, "test", max_windows, which="best")[0]["loss"]
    result["best_checkpoint"] = entry
    replace_json(dest, result)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted; nothing was recorded for the run in progress (its last checkpoint "
                 "is kept): the same command (without --force) resumes it.")
