"""The experiments behind docs/results.md, this repository's: ``python bench/experiment.py NAME
[--quick] [--redo] [--quick-dir DIR]`` (or ``continuumlm experiment NAME``, which finds this
file in the checkout it is run from), ``--list`` for the table.

Each experiment is a list of benchmark commands from the repository's ``bench/`` folder; every
training run writes one JSON into ``bench/results/`` and is skipped when that JSON exists, and
an interrupted run resumes from its checkpoints, so a full-size experiment (hours on 2 CPU
cores) can be finished over several sittings. ``docs/results.md`` and ``docs/img/`` are then
regenerated from the JSON files.

``--quick`` runs the same commands at smoke-test size (a few training steps, one seed, small
MQAR sets) into ``runs/quick/`` (results, run folders and a results page of their own), never
touching the committed results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from continuumlm.errors import ContinuumLMError

SH = "configs/shakespeare_char"
QUICK_TRAIN = ["train.max_steps=6", "train.eval_interval=3", "train.eval_iters=2",
               "train.checkpoint_interval=3", "train.log_interval=1", "train.lr_decay_steps=6",
               "train.warmup_steps=2"]
LR2 = ["--set", "train.lr=2e-3", "--set", "train.min_lr=2e-4"]
LR3 = ["--set", "train.lr=3e-3", "--set", "train.min_lr=3e-4"]
LR5 = ["--set", "train.lr=5e-3", "--set", "train.min_lr=5e-4"]
LR8 = ["--set", "train.lr=8e-3", "--set", "train.min_lr=8e-4"]
CW1 = ("--set", "train.elastic.consistency_weight=1.0")


def _teacher(lr: str) -> tuple[str, ...]:
    """A distilled run's options: its teacher is ode_euler trained at ``lr`` on the run's seed."""
    return ("--set",
            f"train.distill.teacher={{runs}}/shakespeare_char-ode_euler-lr{lr}_seed{{seed}}",
            "--set", "train.distill.weight=1.0")


KD, KD5 = _teacher("3e-3"), _teacher("5e-3")
# a quarter of configs/ptb_std's 5,860 steps, with its schedule: the dropout sweep
PTB_QUARTER = ["--set", "train.max_steps=1465", "--set", "train.lr_decay_steps=1465",
               "--set", "train.checkpoint_interval=250"]
QUICK_MQAR = ["train.max_steps=6", "train.eval_interval=3", "train.log_interval=1",
              "mqar.train_examples=256", "mqar.test_examples=64", "train.warmup_steps=2"]


@dataclass
class Step:
    script: str                      # a file in bench/
    args: list[str] = field(default_factory=list)
    seeds: list[int] | None = None   # train_seeds.py: seeds (the first alone under --quick)
    quick: bool = True               # False: skipped under --quick (machine-wide benchmarks)
    output: str | None = None        # the JSON it writes (skipped when present, unless redo)


def _train(config: str, seeds: list[int], *extra: str) -> Step:
    return Step("train_seeds.py", [config, *extra], seeds=seeds)


def _mqar(name: str) -> Step:
    return Step("mqar_runs.py", [f"configs/mqar/{name}.toml"])


EXPERIMENTS: dict[str, tuple[str, list[Step]]] = {
    "shakespeare": ("Tiny Shakespeare at nanoGPT's baby-GPT budget: discrete, ODE (fields, "
                    "solvers, parameter-matched), DeltaNet, continuous attention", [
        _train(f"{SH}/transformer_baby.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_rk4.toml", [1337, 1, 2]),
        _train(f"{SH}/deltanet.toml", [1337, 1, 2]),
        _train(f"{SH}/deltanet_conv.toml", [1337, 1, 2]),
        *[_train(f"{SH}/{c}.toml", [1337]) for c in (
            "ode_euler", "ode_rk4x1", "ode_parallel_euler", "ode_parallel_rk4x1", "ode_parallel",
            "ode_wide_rk4x1", "ode_attention", "ode_attention_bitnet", "ode_attention_dyt",
            "ode_deltanet",
            "cat_fourier", "cat_cheb")],
    ]),
    "cat_protocol": ("CAT's context-length protocol: train at 256, evaluate at 128-5000", [
        _train(f"configs/cat_protocol/{c}.toml", [1337], "--contexts", "128,512,1024,5000")
        for c in ("cat_fourier", "cat_exact", "cat_composite", "cat_bias", "cat_bias_relative",
                  "softmax_rope", "softmax_nope")
    ]),
    "ptb": ("Penn Treebank word level: discrete vs ODE RK4x4 vs parameter-matched ODE, with "
            "unigram/bigram references and the test split reported once", [
        *[_train(f"configs/ptb/{c}.toml", [42, 1, 2], "--also-test")
          for c in ("transformer", "ode_rk4", "ode_rk4_wide")],
        Step("ngram_ref.py", output="ptb-ngram"),
    ]),
    "elasticity": ("Anytime depth: the trained ODE models re-integrated with other solvers and "
                   "step counts, no retraining, and per-token exit thresholds (needs the "
                   "shakespeare experiment's runs)", [
        # the fixed-NFE references at the elastic models' other seeds (ode_rk4's three seeds
        # are the shakespeare experiment's)
        _train(f"{SH}/ode_euler.toml", [1, 2]),
        _train(f"{SH}/ode_elastic.toml", [1337]),
        _train(f"{SH}/ode_elastic_consistency.toml", [1337]),
        _train(f"{SH}/ode_elastic_narrow.toml", [1337]),
        _train(f"{SH}/ode_elastic_upto16.toml", [1337]),
        _train(f"{SH}/ode_elastic_dial.toml", [1337]),
        _train(f"{SH}/ode_elastic_dial4.toml", [1337]),
        _train(f"{SH}/ode_elastic_dial_consistency.toml", [1337, 1]),
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1337, 1, 2], "--tag", "cw1.0",
               "--set", "train.elastic.consistency_weight=1.0"),
        # the same recipe and its fixed-NFE references at two and three times the learning
        # rate (bench/lr_sweep.py)
        # (seed 1 first: --quick trains the first seed alone, and the distilled runs below
        # read ode_euler's seed-1 run as their teacher)
        *[_train(f"{SH}/{c}.toml", [1, 1337, 2], "--tag", f"{pre}lr{lr}", *extra, *sets)
          for lr, sets in (("2e-3", LR2), ("3e-3", LR3))
          for c, pre, extra in (("ode_rk4", "", ()), ("ode_euler", "", ()),
                                ("ode_elastic_dial_capped", "cw1.0-", CW1),
                                ("transformer_baby", "", ()))],
        # ode_euler and the discrete baseline were still improving at 3e-3
        *[_train(f"{SH}/{c}.toml", [1337, 1, 2], "--tag", "lr5e-3", *LR5)
          for c in ("ode_euler", "transformer_baby")],
        _train(f"{SH}/ode_euler.toml", [1337, 1, 2], "--tag", "lr8e-3", *LR8),  # still at 5e-3
        # the recipe at lr 2e-3 distilled from ode_euler trained at lr 3e-3 on the same seed
        # (train.distill.teacher), with and without the consistency term
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1, 1337, 2], "--tag", "cw1.0-kd1.0-lr2e-3",
               *CW1, *KD, *LR2),
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1], "--tag", "kd1.0-lr2e-3",
               "--set", "train.elastic.consistency_weight=0.0", *KD, *LR2),
        # the same with ode_euler at 5e-3 as the teacher (within 0.001 of its best rate, 8e-3;
        # seed 1337 first: --quick has trained only that seed at 5e-3)
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1337, 1, 2], "--tag",
               "cw1.0-kd1.0t5e-3-lr2e-3", *CW1, *KD5, *LR2),
        # and at the teacher's rate (one seed)
        _train(f"{SH}/ode_elastic_dial_capped.toml", [1337], "--tag",
               "cw1.0-kd1.0t5e-3-lr5e-3", *CW1, *KD5, *LR5),
        # the recipe made elastic only from step 1000 or 1500 (RK4 x 4 before)
        *[_train(f"{SH}/ode_elastic_dial_capped.toml", [1], "--tag", f"cw1.0-from{s}", *CW1,
                 "--set", f"train.elastic.start={s}") for s in (1000, 1500)],
        _train(f"{SH}/ode_rk4_readout.toml", [1337]),
        _train(f"{SH}/ode_rk4_readout_light.toml", [1337]),
        Step("lr_sweep.py"),  # incremental: evaluates the newly trained elastic runs
        Step("depth_elasticity.py"),  # incremental: adds the rows of newly trained models
        Step("depth_exit.py"),  # incremental: adds the rows of newly trained models
        Step("elastic_cost.py", quick=False, output="elastic_cost"),
    ]),
    "regularizers": ("NFE regularizers on an adaptive solver: ode_rk4's model trained with "
                     "Tsit5, without and with RNODE's kinetic and Jacobian terms; adaptive "
                     "methods compared on the trained fields", [
        _train(f"{SH}/ode_tsit5.toml", [1337]),
        _train(f"{SH}/ode_tsit5_rnode.toml", [1337]),
        # lower regularizer weights: where the loss-for-NFE trade meets the target, if anywhere
        *[_train(f"{SH}/ode_tsit5_rnode.toml", [1337], "--tag", f"w{w}",
                 "--set", f"train.regularize.kinetic_weight={w}",
                 "--set", f"train.regularize.jacobian_weight={w}")
          for w in ("0.005", "0.0025")],
        # STEER's random end time (t1 in [0.5, 1.5]) on the weight that stays within 1%
        _train(f"{SH}/ode_tsit5_rnode.toml", [1337], "--tag", "w0.005-steer0.5",
               "--set", "train.regularize.kinetic_weight=0.005",
               "--set", "train.regularize.jacobian_weight=0.005",
               "--set", "train.regularize.steer=0.5"),
        # the trained fields (and ode_rk4's) under Tsit5, dopri5, bosh3 and dopri8
        Step("adaptive_solvers.py", quick=False),  # reruns: rows for newly trained fields
        # which part of the backsolve adjoint's state sets its steps on these fields (why the
        # seminorm saves little in training)
        Step("adjoint_norm_parts.py", quick=False),
    ]),
    "ptb_std": ("Penn Treebank in the standard setup (10k vocabulary, ~4.6 M parameters, "
                "Zaremba-small's 12 M tokens): dropout swept at a quarter of the budget on the "
                "validation split, the quarter's winner (0.0) checked at the full budget against "
                "the configs' 0.1, then three seeds per model, the test split scored once", [
        *[_train(f"configs/ptb_std/{c}.toml", [1], "--tag", f"sweep_dropout{d}",
                 "--set", f"model.dropout={d}", *PTB_QUARTER)
          for c in ("transformer", "ode_euler") for d in ("0.0", "0.1", "0.3", "0.5")],
        # at the full budget dropout 0.0 overfits (the reason the configs say 0.1)
        _train("configs/ptb_std/transformer.toml", [1], "--tag", "dropout0.0",
               "--set", "model.dropout=0.0", "--also-test", "--also-best"),
        *[_train(f"configs/ptb_std/{c}.toml", [1, 2, 3], "--also-test", "--also-best")
          for c in ("transformer", "ode_euler")],
    ]),
    "ode_kv": ("Decoding memory that does not grow with the solve (model.ode_kv): the "
               "mixers' memory per evaluation, per solver step or per block, RK4 x 4, softmax "
               "on Tiny Shakespeare and PTB and DeltaNet on Tiny Shakespeare and PTB, against the "
               "one-layer discrete model with the same parameters and cache (the evaluation "
               "rows of softmax are the shakespeare and ptb experiments' ode_rk4 runs)", [
        # one seed of each first, then the other seeds (an experiment resumes where it stopped)
        *[_train(f"{SH}/ode_rk4.toml", [1337], "--tag", f"kv-{kv}", "--set", f"model.ode_kv={kv}")
          for kv in ("block", "step")],
        *[_train("configs/ptb/ode_rk4.toml", [42], "--tag", f"kv-{kv}", "--also-test",
                 "--set", f"model.ode_kv={kv}") for kv in ("block", "step")],
        # the evaluation rows trained again by this version (ode_kv set to its default): that
        # the earlier records still hold, seed for seed
        _train(f"{SH}/ode_rk4.toml", [1337], "--tag", "kv-evaluation",
               "--set", "model.ode_kv=evaluation"),
        _train("configs/ptb/ode_rk4.toml", [42], "--tag", "kv-evaluation", "--also-test",
               "--set", "model.ode_kv=evaluation"),
        # the target's rows first (block against evaluation, both corpora), then the
        # parameter-matched discrete models, DeltaNet, and step at the other seeds
        _train(f"{SH}/ode_rk4.toml", [1, 2], "--tag", "kv-block", "--set", "model.ode_kv=block"),
        _train("configs/ptb/ode_rk4.toml", [1, 2], "--tag", "kv-block", "--also-test",
               "--set", "model.ode_kv=block"),
        _train(f"{SH}/transformer_baby.toml", [1337, 1, 2], "--tag", "1layer",
               "--set", "model.num_layers=1"),
        _train("configs/ptb/transformer.toml", [42, 1, 2], "--tag", "1layer", "--also-test",
               "--set", "model.num_layers=1"),
        *[_train(f"{SH}/ode_deltanet.toml", [1337], "--tag", f"rk4x4-kv-{kv}",
                 "--set", "model.ode_steps=4", "--set", f"model.ode_kv={kv}")
          for kv in ("evaluation", "block", "step")],
        _train(f"{SH}/deltanet.toml", [1337, 1, 2], "--tag", "1layer",
               "--set", "model.num_layers=1"),
        _train(f"{SH}/ode_rk4.toml", [1, 2], "--tag", "kv-step", "--set", "model.ode_kv=step"),
        _train("configs/ptb/ode_rk4.toml", [1, 2], "--tag", "kv-step", "--also-test",
               "--set", "model.ode_kv=step"),
        *[_train(f"{SH}/ode_deltanet.toml", [1, 2], "--tag", f"rk4x4-kv-{kv}",
                 "--set", "model.ode_steps=4", "--set", f"model.ode_kv={kv}")
          for kv in ("evaluation", "block", "step")],
        # DeltaNet on PTB: seed 42 of each option, the one-layer discrete model, the other seeds
        *[_train("configs/ptb/ode_deltanet.toml", [42], "--tag", f"kv-{kv}", "--also-test",
                 "--set", f"model.ode_kv={kv}") for kv in ("evaluation", "block", "step")],
        _train("configs/ptb/deltanet.toml", [42, 1, 2], "--tag", "1layer", "--also-test",
               "--set", "model.num_layers=1"),
        *[_train("configs/ptb/ode_deltanet.toml", [1, 2], "--tag", f"kv-{kv}", "--also-test",
                 "--set", f"model.ode_kv={kv}") for kv in ("evaluation", "block", "step")],
        Step("ode_kv.py", quick=False, output="ode_kv"),  # cache bytes, decoding, training speed
    ]),
    "mqar": ("Multi-query associative recall (Zoology): softmax, DeltaNet, ODE-DeltaNet at 16 "
             "and 64 key-value pairs; softmax and ODE-DeltaNet at 64 also trained on Zoology's mix of "
             "pair counts", [
        *[_mqar(f"{m}_kv{n}") for n in (16, 64) for m in ("softmax", "deltanet", "ode_deltanet")],
        *[_mqar(f"{m}_kv64_mixed") for m in ("softmax", "ode_deltanet")],
        # Zoology's four learning rates for every row below 99% at one rate (hours each on a
        # CPU; not run by --quick)
        *[Step("mqar_sweep.py", [f"configs/mqar/{n}.toml"], quick=False)
          for n in ("softmax_kv64", "ode_deltanet_kv64", "ode_deltanet_kv64_mixed")],
    ]),
    "any_depth": ("One model trained to be turned (train.any_depth): ode_rk4's model with its "
                  "coarse solves taught by its own solve in the same step, and the models its "
                  "agreement is compared with (ode_rk4's are the shakespeare experiment's)", [
        _train(f"{SH}/ode_any_depth.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_any_depth_tuned.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_any_depth_kvblock.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_any_depth_nfe4.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_any_depth_euler1.toml", [1337, 1, 2]),
        _train(f"{SH}/ode_any_depth.toml", [1337], "--tag", "top1-0.5",
               "--set", "train.any_depth.top1_weight=0.5"),
        _train(f"{SH}/ode_rk4.toml", [1337], "--tag", "bp1",
               "--set", "train.any_depth.backprop_steps=1"),
        # truncated backprop at RK4 x 8: through the last 2 steps, and through all of them
        _train(f"{SH}/ode_rk4.toml", [1337], "--tag", "rk4x8", "--set", "model.ode_steps=8"),
        _train(f"{SH}/ode_rk4.toml", [1337], "--tag", "rk4x8-bp2", "--set", "model.ode_steps=8",
               "--set", "train.any_depth.backprop_steps=2"),
        # a discrete stack trained to draft with its first layers (LayerSkip's recipe), and
        # the baby GPT it is compared with
        _train(f"{SH}/transformer_layerskip.toml", [1337, 1, 2]),
        _train(f"{SH}/transformer_layerskip_first.toml", [1337, 1, 2]),
        _train(f"{SH}/transformer_layerskip_kl.toml", [1337, 1, 2]),
    ]),
    "bench": ("Performance suite: ODE cost per NFE, memory vs steps, DeltaNet kernels, mixer "
              "steps, decoding, 1 vs 2 processes and compile, kept freed memory on CPU, threads "
              "quiet and loaded, MFU, corpora at scale, HF generate", [
        *[Step(f"{b}.py", quick=False, output=b) for b in (
            "ode_cost", "ode_memory", "deltanet_kernels", "mixer_step", "decode_speed", "scale",
            "keep_freed_memory", "threads", "mfu", "data_scale", "hf_generate",
            "adaptive_grads", "seminorm_run")],
    ]),
}
ORDER = ["shakespeare", "elasticity", "regularizers", "cat_protocol", "ptb", "ptb_std", "ode_kv",
         "any_depth", "mqar", "bench"]


def run_child(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run``, except on Ctrl-C. ``subprocess.run`` kills its child a quarter of a
    second after the interrupt, before a training run (which receives the same SIGINT from the
    terminal) has finished its step and saved; here the child is waited for, and the
    KeyboardInterrupt is raised once it has ended. (A signal sent to this process alone is not
    passed on: the child then runs to its end.)"""
    interrupted = False
    with subprocess.Popen(cmd, **kwargs) as p:
        while True:
            try:
                out, err = p.communicate()
                break
            except KeyboardInterrupt:
                interrupted = True  # a second Ctrl-C reaches the child too: it stops at once
    if interrupted:
        raise KeyboardInterrupt
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


REPO = Path(__file__).resolve().parents[1]  # the checkout this file is in


def commands(name: str, quick: bool, done: set[str] = frozenset()) -> list[list[str]]:
    """The bench/ commands of experiment ``name``; steps whose output JSON is in ``done`` are
    left out (training scripts skip their finished runs themselves)."""
    out = []
    for step in EXPERIMENTS[name][1]:
        if (quick and not step.quick) or (step.output and step.output in done):
            continue
        args = list(step.args)
        if step.seeds is not None:
            seeds = step.seeds[:1] if quick else step.seeds
            args += ["--seeds", *map(str, seeds)]
        if quick and step.script == "train_seeds.py":
            args += sum((["--set", s] for s in QUICK_TRAIN), []) + ["--max-windows", "16"]
            if "--contexts" in args:  # smoke size: one short extra context
                args[args.index("--contexts") + 1] = "128"
        if quick and step.script == "mqar_runs.py":
            args += sum((["--set", s] for s in QUICK_MQAR), [])
        out.append([step.script, *args])
    return out


def run_experiment(name: str, quick: bool = False, repo: Path | None = None,
                   render: bool = True, quick_dir: Path | None = None, redo: bool = False) -> Path:
    """Run experiment ``name`` ("all" for every one) and regenerate the results page; returns
    its path. Quick runs go to ``quick_dir`` (default runs/quick). Benchmarks whose JSON exists
    are skipped unless ``redo``."""
    names = ORDER if name == "all" else [name]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ContinuumLMError(f"unknown experiment {unknown[0]!r}; choose one of "
                               f"{', '.join(ORDER)} or 'all' (`continuumlm experiment --list`).")
    repo = repo or REPO
    env = dict(os.environ)
    if quick:
        base = Path(quick_dir) if quick_dir else repo / "runs" / "quick"
        env.update(CONTINUUMLM_RESULTS_DIR=str(base / "results"),
                   CONTINUUMLM_RUNS_DIR=str(base / "runs"), CONTINUUMLM_DOCS_DIR=str(base / "docs"))
    env.setdefault("CONTINUUMLM_DATA", str(repo.parent / "shared" / "data"))
    bench = repo / "bench"
    results = Path(env.get("CONTINUUMLM_RESULTS_DIR", repo / "bench" / "results"))
    done = set() if redo else {p.stem for p in results.glob("*.json")}
    for n in names:
        t0 = time.perf_counter()
        print(f"== experiment {n}{' (quick)' if quick else ''}: {EXPERIMENTS[n][0]}", flush=True)
        for cmd in commands(n, quick, done):
            print("$ python bench/" + " ".join(cmd), flush=True)
            r = run_child([sys.executable, str(bench / cmd[0]), *cmd[1:]], cwd=repo, env=env)
            if r.returncode != 0:
                raise ContinuumLMError(f"experiment {n}: `python bench/{' '.join(cmd)}` failed "
                                       f"with exit status {r.returncode} (its output is above); "
                                       f"fix the cause and run the experiment again: finished "
                                       f"runs are kept and skipped.")
        print(f"== experiment {n} done in {time.perf_counter() - t0:.0f} s", flush=True)
    page = Path(env.get("CONTINUUMLM_DOCS_DIR", repo / "docs")) / "results.md"
    if render:
        r = subprocess.run([sys.executable, str(bench / "render.py")], cwd=repo, env=env)
        if r.returncode != 0:
            raise ContinuumLMError(f"rendering {page} failed (exit status {r.returncode}).")
    return page


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python bench/experiment.py",
                                 description="run an experiment behind docs/results.md")
    ap.add_argument("name", nargs="?", help=f"{', '.join(ORDER)} or all")
    ap.add_argument("--quick", action="store_true", help="smoke-test size, into runs/quick/")
    ap.add_argument("--quick-dir", help="where --quick writes (default runs/quick)")
    ap.add_argument("--redo", action="store_true", help="run benchmarks whose JSON exists")
    ap.add_argument("--list", action="store_true", help="list the experiments and commands")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for n in ORDER:
            print(f"{n}: {EXPERIMENTS[n][0]}")
            for c in commands(n, args.quick):
                print("    python bench/" + " ".join(c))
        return 0
    if args.quick_dir and not args.quick:
        print("error: --quick-dir goes with --quick; full-size results always go to "
              "bench/results and docs/.", file=sys.stderr)
        return 2
    try:
        page = run_experiment(args.name, quick=args.quick, redo=args.redo,
                              quick_dir=Path(args.quick_dir).resolve() if args.quick_dir
                              else None)
    except ContinuumLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"results page: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
