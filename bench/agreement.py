"""Agreement and loss against a draft's field evaluations: how often each coarse solve of a
trained ODE model gives the own solve's greedy token (teacher-forced, the validation windows
``continuumlm eval`` scores), the mean KL(own || draft), and the loss of the coarse solve.

    python bench/agreement.py --model ode_rk4=runs/agreement/ode_rk4_s1337 \
        --model ode_any_depth=runs/any_depth/s1337,runs/any_depth/s1,runs/any_depth/s2

writes bench/results/agreement.json: per model and seed (each its best checkpoint) the own
solve's loss, and for each draft (``--drafts``, SOLVER:STEPS) its field evaluations, loss,
agreement and KL; the table gives the means over the seeds given. Rows of a model already in
the JSON are replaced; the other models' rows are kept, so a model can be added later.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch
from common import RESULTS, machine, markdown_table, write_json

from continuumlm.config.any_depth import parse_solve
from continuumlm.config.elastic import solve_nfe
from continuumlm.data import prepare_data
from continuumlm.eval.agreement import agreement
from continuumlm.runs import load_model_and_tokenizer
from continuumlm.runs.checkpoint import load_run_config

DRAFTS = "euler:1,euler:2,euler:4,rk4:1,rk4:2"
SH = "configs/shakespeare_char"
# how each run folder the page's record reads was trained (--train trains the missing ones,
# each resumable: continuumlm train --out FOLDER --resume auto ARGS)
SEEDS = (1337, 1, 2)
TRAINED = {
    **{f"runs/agreement/ode_rk4_s{s}": f"--config {SH}/ode_rk4.toml --set train.seed={s}"
       for s in SEEDS},
    **{f"runs/agreement/ode_elastic_dial_s{s}": f"--config {SH}/ode_elastic_dial.toml "
                                                f"--set train.seed={s}" for s in SEEDS},
    **{f"runs/agreement/ode_euler_lr5e-3_s{s}": f"--config {SH}/ode_euler.toml --set "
                                                f"train.seed={s} --set train.lr=5e-3 "
                                                f"--set train.min_lr=5e-4" for s in SEEDS},
    **{f"runs/agreement/distilled_s{s}": (
        f"--config {SH}/ode_elastic_dial_capped.toml --set train.seed={s} "
        f"--set train.elastic.consistency_weight=1.0 "
        f"--set train.distill.teacher=runs/agreement/ode_euler_lr5e-3_s{s} "
        f"--set train.distill.weight=1.0 --set train.lr=2e-3 --set train.min_lr=2e-4")
       for s in SEEDS},
    **{f"runs/any_depth/ode_any_depth_s{s}": f"--config {SH}/ode_any_depth.toml "
                                             f"--set train.seed={s}" for s in (1337, 1, 2)},
    "runs/agreement/any_depth_top1_s1337": f"--config {SH}/ode_any_depth.toml --set "
                                           f"train.seed=1337 --set train.any_depth.top1_weight=0.5",
    **{f"runs/agreement/any_depth_lr2e-3_s{s}": f"--config {SH}/ode_any_depth.toml --set "
                                                f"train.seed={s} --set train.lr=2e-3 "
                                                f"--set train.min_lr=2e-4" for s in SEEDS},
    "runs/agreement/any_depth_lr5e-3_s1337": f"--config {SH}/ode_any_depth.toml --set "
                                             f"train.seed=1337 --set train.lr=5e-3 "
                                             f"--set train.min_lr=5e-4",
    # ode_rk4.toml at its best learning rate (bench/lr_sweep.py)
    **{f"runs/agreement/ode_rk4_lr2e-3_s{s}": f"--config {SH}/ode_rk4.toml --set train.seed={s} "
                                              f"--set train.lr=2e-3 --set train.min_lr=2e-4"
       for s in SEEDS},
    # bench/gate_exit.py's and bench/truncated_backprop.py's runs
    "runs/agreement/any_depth_gate_s1337": f"--config {SH}/ode_any_depth.toml --set "
                                           f"train.seed=1337 --set model.exit_gate=true --set "
                                           f"train.any_depth.gate_weight=1.0",
    # ... with the read-outs along the own solve taught its distribution too (step_weight)
    **{f"runs/agreement/any_depth_gate_step{w}_s1337": f"--config {SH}/ode_any_depth.toml "
                                                       f"--set train.seed=1337 --set "
                                                       f"model.exit_gate=true --set "
                                                       f"train.any_depth.gate_weight=1.0 --set "
                                                       f"train.any_depth.step_weight={w}"
       for w in ("0.3",)},
    "runs/agreement/ode_rk4_bp1_s1337": f"--config {SH}/ode_rk4.toml --set train.seed=1337 "
                                        f"--set train.any_depth.backprop_steps=1",
    # ... at RK4 x 8, through its last 2 steps (Huginn's quarter), and through all of them
    "runs/agreement/ode_rk4x8_s1337": f"--config {SH}/ode_rk4.toml --set train.seed=1337 "
                                      f"--set model.ode_steps=8",
    "runs/agreement/ode_rk4x8_bp2_s1337": f"--config {SH}/ode_rk4.toml --set train.seed=1337 "
                                          f"--set model.ode_steps=8 "
                                          f"--set train.any_depth.backprop_steps=2",
    # the quality gap: a lighter KL term, or the term on every other step (lr 2e-3)
    **{f"runs/agreement/any_depth_w{w}_lr2e-3_s{s}": f"--config {SH}/ode_any_depth.toml --set "
                                                     f"train.seed={s} --set train.lr=2e-3 --set "
                                                     f"train.min_lr=2e-4 --set "
                                                     f"train.any_depth.weight={w}"
       for s in SEEDS for w in ("0.5", "0.7")},
    "runs/agreement/any_depth_every2_lr2e-3_s1337": f"--config {SH}/ode_any_depth.toml --set "
                                                    f"train.seed=1337 --set train.lr=2e-3 --set "
                                                    f"train.min_lr=2e-4 --set "
                                                    f"train.any_depth.every=2",
    # ... and weight 0.7 with a finer solve among the drafts (RK4 x 8, as on PTB below)
    "runs/agreement/any_depth_w0.7_fine_lr2e-3_s1337": f"--config {SH}/ode_any_depth.toml --set "
                                                       f"train.seed=1337 --set train.lr=2e-3 "
                                                       f"--set train.min_lr=2e-4 --set "
                                                       f"train.any_depth.weight=0.7 --set "
                                                       "'train.any_depth.drafts=[\"euler:1\", "
                                                       "\"euler:2\", \"rk4:1\", \"rk4:8\"]'",
    # the NFE-4 target: the recipe with Euler x 4 (NFE 4) as the own solve, at the fixed
    # Euler x 4 model's best learning rate (5e-3), RK4 x 4 among the drafts for the finer solves
    **{f"runs/agreement/any_depth_euler4_s{s}": f"--config {SH}/ode_any_depth.toml --set "
                                                f"train.seed={s} --set model.ode_solver=euler "
                                                f"--set train.lr=5e-3 --set train.min_lr=5e-4 "
                                                "--set 'train.any_depth.drafts=[\"euler:1\", "
                                                "\"euler:2\", \"rk4:4\"]'" for s in SEEDS},
    # ode_any_depth_tuned.toml (lr 2e-3, KL weight 0.85, two drafts a step), and the same
    # with one draft a step
    **{f"runs/agreement/any_depth_w0.85_draws2_lr2e-3_s{s}": f"--config "
                                                             f"{SH}/ode_any_depth_tuned.toml "
                                                             f"--set train.seed={s}"
       for s in SEEDS},
    **{f"runs/agreement/any_depth_w0.85_lr2e-3_s{s}": f"--config {SH}/ode_any_depth_tuned.toml "
                                                      f"--set train.seed={s} --set "
                                                      f"train.any_depth.draws=1" for s in SEEDS},
    # ode_any_depth_tuned.toml with the memory from the block's input (model.ode_kv =
    # "block"): every solve reads the same keys and values, so a token may take any of them
    # (bench/exit_ladder.py), and ode_rk4 at lr 2e-3 with that memory beside it
    **{f"runs/agreement/any_depth_kvblock_s{s}": f"--config {SH}/ode_any_depth_tuned.toml "
                                                 f"--set train.seed={s} --set "
                                                 f"model.ode_kv=block" for s in SEEDS},
    # ... with a KL weight of 0.5 (the agreement that memory gives leaves room for quality):
    # ode_any_depth_kvblock.toml (the same run config as ode_any_depth_tuned.toml --set
    # model.ode_kv=block --set train.any_depth.weight=0.5, which trained these folders)
    **{f"runs/agreement/any_depth_kvblock_w0.5_s{s}": f"--config "
                                                      f"{SH}/ode_any_depth_kvblock.toml --set "
                                                      f"train.seed={s}" for s in SEEDS},
    **{f"runs/agreement/ode_rk4_kvblock_lr2e-3_s{s}": f"--config {SH}/ode_rk4.toml --set "
                                                      f"train.seed={s} --set model.ode_kv=block "
                                                      f"--set train.lr=2e-3 --set "
                                                      f"train.min_lr=2e-4" for s in SEEDS},
    # the kv-block recipe with Euler x 4 (NFE 4) as its own solve, at the fixed Euler x 4
    # model's best lr, drafting with Euler x 1 and x 2 only, and that model with block memory
    # trained alone beside it
    # (ode_any_depth_nfe4.toml: the same run config as ode_any_depth_kvblock.toml --set
    # model.ode_solver=euler --set train.lr=5e-3 --set train.min_lr=5e-4 --set
    # 'train.any_depth.drafts=["euler:1", "euler:2"]', which trained these folders)
    **{f"runs/agreement/any_depth_kvblock_euler4_s{s}": f"--config "
                                                        f"{SH}/ode_any_depth_nfe4.toml --set "
                                                        f"train.seed={s}" for s in SEEDS},
    # the kv-block recipe told the time with Euler x 1 alone drafted: ode_any_depth_euler1.toml
    # (KL weight 0.5; the same run config as ode_any_depth_kvblock.toml --set
    # model.ode_time_embedding=sinusoidal --set 'train.any_depth.drafts=["euler:1"]' --set
    # train.any_depth.draws=1, which trained these folders), and at KL weights 1 and 2 (for
    # that draft's agreement); and the recipe with a step-size embedding
    # (model.ode_dt_embedding: each solve's field told its dt)
    **{f"runs/agreement/any_depth_kvblock_time_x1w0.5_s{s}": f"--config "
                                                             f"{SH}/ode_any_depth_euler1.toml "
                                                             f"--set train.seed={s}"
       for s in SEEDS},
    **{f"runs/agreement/any_depth_kvblock_time_x1w{w}_s1337": (
        f"--config {SH}/ode_any_depth_kvblock.toml --set model.ode_time_embedding=sinusoidal "
        f"--set train.seed=1337 --set 'train.any_depth.drafts=[\"euler:1\"]' --set "
        f"train.any_depth.draws=1 --set train.any_depth.weight={w}")
       for w in ("1.0", "2")},
    "runs/agreement/any_depth_kvblock_dt_s1337": (
        f"--config {SH}/ode_any_depth_kvblock.toml --set train.seed=1337 --set "
        f"model.ode_dt_embedding=true"),
    # ... with a KL weight of 1 (for Euler x 1's agreement)
    **{f"runs/agreement/any_depth_kvblock_euler4_w1_s{s}": f"--config "
                                                           f"{SH}/ode_any_depth_nfe4.toml --set "
                                                           f"train.seed={s} --set "
                                                           f"train.any_depth.weight=1.0"
       for s in SEEDS},
    **{f"runs/agreement/ode_euler_kvblock_lr5e-3_s{s}": f"--config {SH}/ode_euler.toml --set "
                                                        f"train.seed={s} --set "
                                                        f"model.ode_kv=block --set "
                                                        f"train.lr=5e-3 --set train.min_lr=5e-4"
       for s in SEEDS},
    # a field told the time (model.ode_time_embedding = "sinusoidal"): ode_rk4 at lr 2e-3,
    # ode_any_depth_kvblock.toml, and the fixed NFE-4 model (ode_euler at lr 5e-3)
    **{f"runs/agreement/ode_rk4_time_lr2e-3_s{s}": f"--config {SH}/ode_rk4.toml --set "
                                                   f"train.seed={s} --set "
                                                   f"model.ode_time_embedding=sinusoidal --set "
                                                   f"train.lr=2e-3 --set train.min_lr=2e-4"
       for s in SEEDS},
    **{f"runs/agreement/any_depth_kvblock_time_s{s}": f"--config "
                                                      f"{SH}/ode_any_depth_kvblock.toml --set "
                                                      f"train.seed={s} --set "
                                                      f"model.ode_time_embedding=sinusoidal"
       for s in SEEDS},
    # ... the kv-block recipe told the time at a KL weight of 1 (agreement for quality)
    "runs/agreement/any_depth_kvblock_time_w1_s1337": f"--config "
                                                      f"{SH}/ode_any_depth_kvblock.toml --set "
                                                      f"model.ode_time_embedding=sinusoidal "
                                                      f"--set train.any_depth.weight=1.0",
    "runs/agreement/ode_euler_time_lr5e-3_s1337": f"--config {SH}/ode_euler.toml --set "
                                                  f"model.ode_time_embedding=sinusoidal --set "
                                                  f"train.lr=5e-3 --set train.min_lr=5e-4",
    # the recipe on other text: Penn Treebank words (configs/ptb/ode_rk4.toml's model and
    # budget with ode_any_depth.toml's drafts), and ode_rk4 itself beside it
    "runs/agreement/ptb_any_depth_s42": "--config configs/ptb/ode_rk4.toml --set "
                                        "'train.any_depth.drafts=[\"euler:1\", \"euler:2\", "
                                        "\"rk4:1\"]'",
    "runs/agreement/ptb_ode_rk4_s42": "--config configs/ptb/ode_rk4.toml",
    # ... with a finer solve among the drafts (RK4 x 8 also taught the own solve's
    # distribution), for the loss past the own solve
    "runs/agreement/ptb_any_depth_fine_s42": "--config configs/ptb/ode_rk4.toml --set "
                                             "'train.any_depth.drafts=[\"euler:1\", "
                                             "\"euler:2\", \"rk4:1\", \"rk4:8\"]'",
    # ... with ode_any_depth_euler1.toml's recipe (the memory from the block's input, the
    # field told the time, Euler x 1 alone taught at KL weight 0.5)
    "runs/agreement/ptb_any_depth_euler1_s42": "--config configs/ptb/ode_rk4.toml --set "
                                               "model.ode_kv=block --set "
                                               "model.ode_time_embedding=sinusoidal --set "
                                               "'train.any_depth.drafts=[\"euler:1\"]' --set "
                                               "train.any_depth.weight=0.5",
    # discrete stacks drafting with their first layers: nanoGPT's baby GPT, and the same
    # trained with [train.layer_skip] (transformer_layerskip.toml), and its variants
    **{f"runs/agreement/transformer_baby_s{s}": f"--config {SH}/transformer_baby.toml "
                                                f"--set train.seed={s}" for s in SEEDS},
    **{f"runs/agreement/layerskip_s{s}": f"--config {SH}/transformer_layerskip.toml "
                                         f"--set train.seed={s}" for s in SEEDS},
    "runs/agreement/layerskip_exit_only_s1337": f"--config {SH}/transformer_layerskip.toml "
                                                f"--set train.layer_skip.dropout=0",
    "runs/agreement/layerskip_drop_only_s1337": f"--config {SH}/transformer_layerskip.toml "
                                                f"--set train.layer_skip.exit_weight=0",
    "runs/agreement/layerskip_e0.3_s1337": f"--config {SH}/transformer_layerskip.toml "
                                           f"--set train.layer_skip.exit_weight=0.3",
    "runs/agreement/layerskip_e2_s1337": f"--config {SH}/transformer_layerskip.toml "
                                         f"--set train.layer_skip.exit_weight=2.0",
    "runs/agreement/layerskip_d0.3_s1337": f"--config {SH}/transformer_layerskip.toml "
                                           f"--set train.layer_skip.dropout=0.3",
    **{f"runs/agreement/layerskip_x1_s{s}": f"--config {SH}/transformer_layerskip.toml "
                                            f"--set train.seed={s} --set "
                                            f"train.layer_skip.exit_layers=[1]" for s in SEEDS},
    # ... and its first layer also taught the stack's own distribution (exit_kl)
    **{f"runs/agreement/layerskip_x1kl1_s{s}": f"--config {SH}/transformer_layerskip_kl.toml "
                                               f"--set train.seed={s}" for s in SEEDS},
    **{f"runs/agreement/layerskip_x1kl3_s{s}": f"--config {SH}/transformer_layerskip_kl.toml "
                                               f"--set train.seed={s} --set "
                                               f"train.layer_skip.exit_kl=3.0" for s in SEEDS},
    # 12 layers of the same width: more layers for the first ones to stand in for
    "runs/agreement/transformer12_s1337": f"--config {SH}/transformer_baby.toml --set "
                                          f"model.num_layers=12",
    "runs/agreement/layerskip12_s1337": f"--config {SH}/transformer_layerskip.toml --set "
                                        f"model.num_layers=12",
}


def train_missing(runs: list[str]) -> None:
    """Train (or finish) each run folder of ``runs`` that TRAINED knows, in order (the
    distilled model's teacher before it)."""
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    cli = os.path.join(os.path.dirname(sys.executable), "continuumlm")
    wanted = set(runs)
    for s in SEEDS:  # a distilled model's teacher first
        if f"runs/agreement/distilled_s{s}" in wanted:
            wanted.add(f"runs/agreement/ode_euler_lr5e-3_s{s}")
    for run, how in TRAINED.items():
        if run in wanted and not (Path(run) / "checkpoints" / "best").exists():
            subprocess.run([cli, "train", "--out", run, "--resume", "auto", "--quiet",
                            *shlex.split(how)], check=True)


def measure(run: str, drafts: list[tuple[str, int]], max_windows: int) -> dict:
    model, tok, ckpt = load_model_and_tokenizer(run, "best")
    cfg = load_run_config(ckpt)
    split = prepare_data(cfg.data, tok).splits["val"]
    context = cfg.train.seq_len
    device = torch.device("cpu")
    layers = model.config.num_layers
    # a discrete stack's own "solve" is all its layers, its drafts its first layers
    own = ((model.config.ode_solver, model.config.ode_steps) if model.config.depth == "ode"
           else ("layers", layers))

    def nfe(solver, steps):
        return steps if solver == "layers" else layers * solve_nfe(model.config, solver, steps)

    agreed = agreement(model, split, context, drafts, device, max_windows=max_windows)
    first = next(iter(agreed.values()))
    return {"run": run, "own": f"{own[0]}:{own[1]}",
            "own_nfe": nfe(*own), "own_loss": first["own_loss"],
            "positions": first["positions"],
            "drafts": [{"draft": f"{s}:{n}", "nfe": nfe(s, n),
                        **{k: agreed[f"{s}:{n}"][k] for k in ("loss", "agreement", "kl")}}
                       for s, n in drafts]}


def table(models: dict) -> tuple[list[dict], str]:
    rows = []
    for name, seeds in models.items():
        for i, d in enumerate(seeds[0]["drafts"]):
            per = [s["drafts"][i] for s in seeds]
            rows.append({"model": name, "seeds": len(seeds), "draft": d["draft"],
                         "nfe": d["nfe"],
                         "own_loss": round(statistics.mean(s["own_loss"] for s in seeds), 4),
                         "loss": round(statistics.mean(p["loss"] for p in per), 4),
                         "agreement": round(statistics.mean(p["agreement"] for p in per), 4),
                         "agreement_min": round(min(p["agreement"] for p in per), 4),
                         "kl": round(statistics.mean(p["kl"] for p in per), 4)})
    shown = [{**r, **{k: f"{r[k]:.4f}" for k in ("own_loss", "loss", "kl")},
              **{k: f"{100 * r[k]:.1f}%" for k in ("agreement", "agreement_min")}}
             for r in rows]
    return rows, markdown_table(shown, [
        ("model", "model"), ("seeds", "seeds"), ("draft", "draft solve"),
        ("nfe", "field evaluations"), ("loss", "draft val loss"),
        ("own_loss", "own-solve val loss"), ("agreement", "greedy agreement"),
        ("agreement_min", "... lowest seed"), ("kl", "KL(own, draft)")])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True, metavar="NAME=RUN[,RUN...]",
                    help="a model's name and its run folders (one per seed)")
    ap.add_argument("--drafts", default=DRAFTS)
    ap.add_argument("--max-windows", type=int, default=400,
                    help="validation windows, evenly spread (default 400)")
    ap.add_argument("--train", action="store_true",
                    help="first train the run folders given that TRAINED knows and lack a "
                         "checkpoint (resumable)")
    args = ap.parse_args()
    drafts = [parse_solve(d, "--drafts") for d in args.drafts.split(",")]
    if args.train:
        train_missing([r for spec in args.model for r in spec.partition("=")[2].split(",")])
    measured = {}
    for spec in args.model:
        name, _, runs = spec.partition("=")
        measured[name] = [measure(r, drafts, args.max_windows) for r in runs.split(",")]
        for seed in measured[name]:
            print(name, seed["run"], json.dumps(seed["drafts"]), flush=True)
    # the record as it is now, read after measuring (another measurement may have written it)
    path = RESULTS / "agreement.json"
    models = json.loads(path.read_text())["models"] if path.is_file() else {}
    commands = json.loads(path.read_text()).get("commands", []) if path.is_file() else []
    models.update(measured)
    command = ("python bench/agreement.py " + " ".join(f"--model {m}" for m in args.model)
               + (f" --drafts {args.drafts}" if args.drafts != DRAFTS else "")
               + (f" --max-windows {args.max_windows}" if args.max_windows != 400 else ""))
    rows, text = table(models)
    # an earlier command whose every model was measured again here no longer made the record
    names = {spec.partition("=")[0] for spec in args.model}
    commands = [c for c in commands
                if not {m.split("=")[0] for m in re.findall(r"--model (\S+)", c)} <= names]
    commands = list(dict.fromkeys([*commands, command]))
    write_json("agreement", {
        "command": " && ".join(commands),  # each model's as measured
        "commands": commands,
        "setup": (f"teacher-forced on {args.max_windows} evenly spread validation windows of "
                  f"each run's training context, its best checkpoint; agreement: the fraction "
                  f"of positions where the draft's greedy token equals the own solve's; "
                  f"{machine()}"),
        "models": models, "rows": rows, "table": text})
    print(text)


if __name__ == "__main__":
    main()
