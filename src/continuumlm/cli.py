"""ContinuumLM command line: train, eval, generate, mqar, inspect, export, experiment.

Every user error (bad config, missing file, bad flag) exits with status 2 and a one-paragraph
message on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from .errors import DISK_STATUS, REQUEUE_STATUS, CheckpointError, ContinuumLMError


class UsageError(ContinuumLMError):
    pass


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _seed(text: str) -> int:
    if not 0 <= (v := _int(text)) < 2**64:  # what torch.Generator.manual_seed takes
        raise argparse.ArgumentTypeError(f"{text} is outside 0 .. 2**64-1")
    return v


def _positive_int(text: str) -> int:
    if (v := _int(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return v


def _threshold(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a number") from None
    if not v >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0 (0: never exit, inf: "
                                         f"every token after its first step)")
    return v


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers, e.g. 128,512")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="continuumlm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    plugin = argparse.ArgumentParser(add_help=False)
    plugin.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import this module first, so the mixers, fields and solvers it "
                             "registers can be named in a config (repeatable; a trained run "
                             "remembers its plugins)")

    t = sub.add_parser("train", parents=[plugin], help="train a model from a TOML config")
    t.add_argument("--config", help="TOML file with [model], [data] and [train] sections")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. --set train.max_steps=100")
    t.add_argument("--out", help="run folder (default: runs/<config name>)")
    t.add_argument("--resume", nargs="?", const="yes", metavar="auto",
                   help="continue the run in --out from checkpoints/last; '--resume auto' "
                        "continues it when it has a checkpoint and starts it (from --config) "
                        "when it has none: one command for a job's first start and every requeue")
    t.add_argument("--quiet", action="store_true", help="print only the final summary")
    t.add_argument("--nproc", type=_positive_int, help="train with N processes on this machine "
                   "(runs torchrun --standalone --nproc_per_node=N for you; DDP, or FSDP with "
                   "train.strategy = 'fsdp')")

    pp = sub.add_parser("prepare", parents=[plugin], help="tokenize a corpus once into memory-"
                        "mapped token files (a config's [data] corpus, or any --input)")
    pp.add_argument("--config", help="prepare this config's [data] corpus (into the cache, or "
                    "--out)")
    pp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    pp.add_argument("--input", nargs="+", metavar="SRC", help="text files, folders (recursive, "
                    "sorted), glob patterns, .gz files, JSON Lines / Parquet / Arrow files")
    pp.add_argument("--tokenizer", default="bpe", metavar="{char,word,bpe,tiktoken:NAME,PATH}",
                    help="train a char, word or bpe tokenizer, encode with a tiktoken encoding "
                         "whose files tiktoken has locally (tiktoken:gpt2), or with an existing "
                         "tokenizer.json (a path; default: bpe)")
    pp.add_argument("--vocab-size", type=_positive_int, help="word/bpe vocabulary (bpe default "
                    "4096)")
    pp.add_argument("--val-fraction", type=float, default=0.1, help="share of the text, after "
                    "the training part, that validates (default 0.1)")
    pp.add_argument("--test-fraction", type=float, default=0.0, help="share of the text, at the "
                    "end, kept for test (default 0)")
    pp.add_argument("--text-field", default="text", help="text field of JSON Lines records and "
                    "Parquet/Arrow tables (default: text)")
    pp.add_argument("--errors", choices=("strict", "replace"), default="strict",
                    help="non-UTF-8 bytes: stop naming the offset (strict), or replace them")
    pp.add_argument("--vocab-source", choices=("train", "all"), default="train")
    pp.add_argument("--unknown-chars", choices=("unk", "error"), default="unk")
    pp.add_argument("--sample-chars", type=_positive_int, default=64_000_000,
                    help="word/bpe tokenizers train on at most this many characters (a seeded "
                         "sample of a larger training text)")
    pp.add_argument("--seed", type=_seed, default=0, help="seed of the tokenizer's sample")
    pp.add_argument("--workers", type=_positive_int, help="processes that encode with the word "
                    "tokenizer, threads of the bpe tokenizer's batch encoding (default: every "
                    "core)")
    pp.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto",
                    help="token file dtype (auto: uint16 for vocabularies up to 65,536)")
    pp.add_argument("--out", help="folder to write (new or empty; --config without --out "
                    "prepares into the cache that train reads)")
    pp.add_argument("--force", action="store_true", help="prepare again, replacing what --out "
                    "holds (a prepared corpus of these or other inputs)")
    pp.add_argument("--quiet", action="store_true")

    r = sub.add_parser("experiment", parents=[plugin], help="run an experiment behind docs/results.md (in a "
                       "repository checkout) and regenerate the page")
    r.add_argument("name", nargs="?", help="shakespeare, elasticity, regularizers, "
                   "cat_protocol, ptb, ptb_std, mqar, bench, or all (--list describes them)")
    r.add_argument("--quick", action="store_true", help="smoke-test size, into runs/quick/")
    r.add_argument("--quick-dir", help="where --quick writes (default runs/quick)")
    r.add_argument("--list", action="store_true", help="list the experiments and their commands")
    r.add_argument("--redo", action="store_true", help="re-run benchmarks whose JSON exists "
                   "(a training run is redone by deleting its JSON and its run folder, "
                   "runs/bench/<config folder>-<config>_seed<N>, or "
                   "runs/bench/mqar-<config>)")

    x = sub.add_parser("export", parents=[plugin], help="consolidate an FSDP run's sharded checkpoint into "
                       "model.safetensors")
    x.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    x.add_argument("--which", choices=("best", "last"),
                   help="only this checkpoint of a run folder (default: last and best; with "
                        "--format hf: best)")
    x.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                   help="safetensors (default): consolidate an FSDP run's shards in place; hf: "
                        "write --out as a Hugging Face folder (config.json with auto_map, "
                        "weights, generation_config.json, tokenizer.json, tokenizer_config.json) "
                        "that AutoModelForCausalLM, AutoTokenizer and lm-evaluation-harness "
                        "read (needs transformers: pip install 'continuumlm[hf]')")
    x.add_argument("--out", help="the folder --format hf writes (new or empty)")

    e = sub.add_parser("eval", parents=[plugin], help="cross-entropy, perplexity and bits/char of a checkpoint")
    e.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    e.add_argument("--which", choices=("best", "last"), default="best",
                   help="checkpoint of a run folder to use (default: best)")
    e.add_argument("--split", default="val", help="val or test (test exists for PTB)")
    e.add_argument("--context-lengths", type=_int_list, help="e.g. 128,512,1024,5000 "
                   "(default: the training context)")
    e.add_argument("--max-windows", type=_positive_int, help="evaluate at most this many windows "
                   "per context length, evenly spread over the split")
    e.add_argument("--device", default="auto")
    e.add_argument("--ode-solver", help="integrate an ODE model's trained fields with this "
                   "solver instead (no retraining)")
    e.add_argument("--ode-steps", type=_positive_int, help="... and/or this many steps")
    _exit_arguments(e)
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")

    h = sub.add_parser("harness", parents=[plugin], help="score a checkpoint with "
                       "lm-evaluation-harness (a rolling-loglikelihood task over its own split) "
                       "beside continuumlm eval")
    h.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    h.add_argument("--which", choices=("best", "last"), default="best")
    h.add_argument("--split", default="val")
    h.add_argument("--context", type=_positive_int, help="window length (default: the "
                   "training context)")
    h.add_argument("--ode-solver", help="score the ODE model's fields with this solver")
    h.add_argument("--ode-steps", type=_positive_int, help="... and/or this many steps")
    h.add_argument("--max-tokens", type=_positive_int, help="score only the split's first N "
                   "tokens")
    h.add_argument("--device", default="cpu")
    h.add_argument("--keep", metavar="DIR", help="write the exported model, the split's text and "
                   "the task YAML into DIR (new) and print the lm_eval command that scores them")
    h.add_argument("--json", action="store_true")

    q = sub.add_parser("mqar", parents=[plugin], help="train and score multi-query associative recall")
    q.add_argument("--config", required=True, help="TOML file with [model], [mqar], [train]")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    q.add_argument("--out", help="run folder (default: runs/mqar/<config name>)")
    q.add_argument("--quiet", action="store_true")
    q.add_argument("--nproc", type=_positive_int, help="train with N processes on this machine "
                   "(torchrun --standalone --nproc_per_node=N, as for train)")

    i = sub.add_parser("inspect", parents=[plugin], help="parameter count and NFE of a config's model")
    i.add_argument("--config", required=True)
    i.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    i.add_argument("--json", action="store_true")
    i.add_argument("--explain", action="store_true", help="print every setting of the config "
                   "with its value, type, default and documentation (component tables too)")

    g = sub.add_parser("generate", parents=[plugin], help="sample text from a checkpoint")
    g.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    g.add_argument("--which", choices=("best", "last"), default="best")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=_positive_int, default=200)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=_positive_int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--greedy", action="store_true")
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--num-samples", type=_positive_int, default=1)
    g.add_argument("--no-cache", action="store_true", help="recompute the whole context each step")
    g.add_argument("--compile", action="store_true",
                   help="decode through torch.compile graphs, one per power-of-two buffer "
                        "capacity (faster per token after a one-off compilation: up to about 5 "
                        "minutes on a 2-core CPU, 9-20 s with a warm compiler cache)")
    g.add_argument("--device", default="cpu")
    _exit_arguments(g)
    return p


def _exit_arguments(parser) -> None:
    parser.add_argument("--exit-threshold", type=_threshold, metavar="TAU",
                        help="per-token adaptive depth (ODE models with a fixed-grid solver): "
                             "a token whose state has settled after a solver step (criterion "
                             "below TAU) stops integrating for the rest of its block")
    parser.add_argument("--exit-criterion", choices=("state", "kl"), default="state",
                        help="state: relative change of the token's state over the step; kl: "
                             "KL between the next-token distributions read out before and after "
                             "it (default: state)")


def _apply_exit(model, args) -> None:
    if args.exit_threshold is None:
        return
    try:
        model.set_exit(args.exit_threshold, args.exit_criterion)
    except ValueError as e:
        raise UsageError(f"--exit-threshold: {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        if args.plugin:
            from .registry import export_plugins, load_plugins

            load_plugins(args.plugin)
            export_plugins(args.plugin)  # torchrun ranks and benchmark children load them too
        commands = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate,
                    "mqar": cmd_mqar, "inspect": cmd_inspect, "export": cmd_export,
                    "prepare": cmd_prepare, "harness": cmd_harness,
                    "experiment": cmd_experiment}
        return commands[args.command](args)
    except ContinuumLMError as e:
        from .train.distributed import env_from_environment

        if e.collective and not env_from_environment().is_main:
            # every rank meets this error; rank 0 prints it and its exit makes the launcher
            # end this rank. Should that not come, print it here after all.
            time.sleep(10)
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------- train

def launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Run this command under torchrun's launcher with ``nproc`` processes (in this process,
    as ``torchrun`` would). Exit status: 0; 2 when the ranks stopped on a user error (bad
    input, divergence), which they printed; 74 on a disk fault and 75 on a requeue signal
    (every rank alike); 130 on Ctrl-C (the ranks save a checkpoint first); 1 when a rank
    crashed, with its error printed above this summary."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = ["--standalone", f"--nproc_per_node={nproc}", "-m", "continuumlm", *rest]
    print("launching: torchrun " + " ".join(cmd), flush=True)
    # a scheduler's warning signal reaches this launcher only: pass it on to the ranks, which
    # save and exit with REQUEUE_STATUS
    previous = {sig: signal.signal(sig, _forward_to_children)
                for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        run(parse_args(cmd))
    except ChildFailedError as e:
        # -15: a rank the launcher terminated (SIGTERM) because another one had ended
        codes = {f.exitcode for f in e.failures.values()} - {-15}
        if len(codes) == 1 and codes <= {2, DISK_STATUS, REQUEUE_STATUS}:
            return codes.pop()  # every rank ended alike: a user error, a disk, a requeue
        ranks = ", ".join(f"rank {r} exited with {f.exitcode}"
                          for r, f in sorted(e.failures.items()))
        print(f"error: the {nproc}-process job failed ({ranks}); the failing rank's error is "
              f"printed above.", file=sys.stderr)
        return 1
    except SignalException as e:  # Ctrl-C or SIGTERM: the launcher passed it on to the ranks
        print(f"launcher stopped by signal {e.sigval}", file=sys.stderr)
        return 130 if e.sigval == 2 else 128 + int(e.sigval)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _forward_to_children(signum, frame) -> None:
    """Send the signal on to this process's children, the ranks (Linux /proc): not to their
    own children (compile workers), which the signal would kill."""
    import os

    me, children = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    for pid in children:
        try:
            os.kill(pid, signum)
        except OSError:
            pass


def _without_resume(argv: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--resume":
            skip = i + 1 < len(argv) and argv[i + 1] == "auto"
        elif not a.startswith("--resume="):
            out.append(a)
    return out


def _resume_mode(args, out: Path, clear: bool = True) -> bool:
    """--resume (must resume), --resume auto (resume when the folder has a checkpoint, else
    start afresh: with ``clear``, a run that died before its first checkpoint is cleared when it
    is this same run), or neither."""
    if args.resume is None:
        return False
    if args.resume == "yes":
        return True
    if args.resume != "auto":
        raise UsageError(f"--resume takes no value or 'auto', got {args.resume!r}.")
    root = out / "checkpoints"
    # what the trainer counts as a run's checkpoints (a dangling `last` too: --resume says
    # what is wrong with it)
    if (root / "last").is_symlink() or any(root.glob("step-*")) or any(root.glob(".old-step-*")):
        return True
    if args.config is None:
        raise UsageError(f"--resume auto: {out} holds no checkpoint to continue and there is no "
                         f"--config to start the run from; pass --config FILE.")
    if clear:
        _clear_unstarted_run(args, out)
    return False


def _clear_unstarted_run(args, out: Path) -> None:
    """The files a run leaves before its first checkpoint (config.toml, metrics.jsonl, tb/)
    are removed when they are this run's (its config.toml describes the same run), so a
    requeued job starts again; anyone else's files are left for the trainer to refuse."""
    import dataclasses
    import shutil

    from .config import load_config

    saved_toml = out / "config.toml"
    if not saved_toml.is_file() or (out / "state.pt").exists() or (out / "result.json").exists():
        return
    try:
        saved = load_config(saved_toml)
    except ContinuumLMError:
        return
    from .train.resume import absolute_data_path

    cfg = load_config(args.config, args.set, plugins=args.plugin)
    cfg.data = absolute_data_path(cfg.data)  # as the trainer wrote it
    cfg.model = dataclasses.replace(cfg.model, vocab_size=saved.model.vocab_size)
    if cfg != saved:
        return
    # only a run that died before it could have saved: one that logged a step at or past its
    # first save (its checkpoints since removed, say) is left for the trainer to refuse
    t = cfg.train
    first_save = min(t.checkpoint_interval, t.eval_interval, t.max_steps)
    try:
        from .train.logging import read_metrics

        steps = [e.get("step", 0) for e in read_metrics(out)] if (out / "metrics.jsonl").exists() \
            else []
    except (OSError, ValueError):
        return
    if any(isinstance(s, (int, float)) and s >= first_save for s in steps):
        return
    print(f"--resume auto: {out} holds no checkpoint; starting the run again", flush=True)
    saved_toml.unlink()
    for name in ("metrics.jsonl",):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "tb", ignore_errors=True)


def cmd_train(args) -> int:
    import gc

    from .config import load_config
    from .train import Trainer, distributed
    from .train.trainer import find_resumable

    if args.out is None and args.config is None:
        raise UsageError("pass --config FILE (and optionally --out DIR), or --out DIR --resume.")
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    # decided once by this process, or (under a torchrun started elsewhere) by every rank
    # alike from the folder, without clearing anything (ranks would race)
    under_torchrun = distributed.env_from_environment().enabled
    args.resume = "yes" if _resume_mode(args, out, clear=not under_torchrun) else None
    if args.nproc and args.nproc > 1:
        if distributed.env_from_environment().enabled:
            raise UsageError("--nproc was given inside a torchrun job; drop --nproc (torchrun "
                             "already sets the number of processes).")
        if args.config or not args.resume:  # a bad config is reported here, once, status 2
            load_config(args.config, args.set, plugins=args.plugin).check_trainable()
        argv = _without_resume(args.argv) + (["--resume"] if args.resume else [])
        return launch_torchrun(args.nproc, argv)
    resume = args.resume == "yes"
    if resume:
        if args.config:
            cfg = load_config(args.config, args.set, plugins=args.plugin)
        else:  # the run's own settings, with --set applied on top
            ckpt, saved, _ = find_resumable(out, announce=False)
            cfg = load_config(None, args.set, base=saved.to_dict(), where=str(ckpt),
                              plugins=args.plugin)
    else:
        cfg = load_config(args.config, args.set, plugins=args.plugin)
    try:
        trainer = Trainer(cfg, out, resume=resume, quiet=args.quiet)
        result = trainer.run()
        # the model, its FSDP/DDP state and the device mesh go while the process group still
        # exists, not at interpreter exit (where FSDP's teardown aborted now and then)
        del trainer
        gc.collect()
        distributed.teardown(wait=True)  # every rank done before the group goes
    finally:
        distributed.teardown()
    requeue = result["interrupted"] in cfg.train.requeue_signals
    if not distributed.env_from_environment().is_main:
        return REQUEUE_STATUS if requeue else 0
    if result["interrupted"]:
        print(f"stopped by {result['interrupted']} at step {result['step']} (checkpoint saved); "
              f"resume with: continuumlm train --out {out} --resume auto")
        if requeue:  # every rank alike, so that the launcher reports it (launch_torchrun)
            return REQUEUE_STATUS
        if distributed.env_from_environment().enabled:
            return 0  # under torchrun the launcher reports the signal (launch_torchrun)
        # not a finished run: a script that waits for it must not take it for one
        return 130 if result["interrupted"] == "SIGINT" else 128 + signal.SIGTERM
    print(f"done: step {result['step']}, val loss {result['val_loss']:.4f}, best "
          f"{result['best_val_loss']:.4f}, {result['parameters']:,} parameters, "
          f"{result['tokens_per_s']:.0f} tokens/s, {result['train_seconds']:.1f} s training; "
          f"run folder {out}")
    return 0


# ---------------------------------------------------------------------------- mqar

def cmd_mqar(args) -> int:
    from .config import load_config
    from .train import distributed
    from .train.mqar import run_mqar

    cfg = load_config(args.config, args.set, plugins=args.plugin)
    out = Path(args.out) if args.out else Path("runs") / "mqar" / Path(args.config).stem
    if args.nproc and args.nproc > 1:
        if distributed.env_from_environment().enabled:
            raise UsageError("--nproc was given inside a torchrun job; drop --nproc (torchrun "
                             "already sets the number of processes).")
        from .train.mqar import prepare_run_folder

        try:  # a bad config is reported here, once; an earlier version's run folder adopted
            prepare_run_folder(cfg, out)
        except ValueError as e:
            raise UsageError(f"[mqar]: {e}") from None
        return launch_torchrun(args.nproc, args.argv)
    try:
        r = run_mqar(cfg, out, quiet=args.quiet)
    except ValueError as e:  # task sizes that do not fit together
        raise UsageError(f"[mqar]: {e}") from None
    # exit statuses as for train: a requeue signal gives REQUEUE_STATUS on every rank
    requeue = r.get("interrupted") in cfg.train.requeue_signals
    if not distributed.env_from_environment().is_main:
        return REQUEUE_STATUS if requeue else 0
    if r.get("interrupted"):
        where = (f"last evaluation at step {r['steps']}" if "accuracy" in r
                 else "before its first evaluation")
        print(f"stopped by {r['interrupted']} (checkpoint saved; {where}); the same command "
              f"continues the run")
        if requeue:
            return REQUEUE_STATUS
        if distributed.env_from_environment().enabled:
            return 0  # under torchrun the launcher reports the signal
        return 130 if r["interrupted"] == "SIGINT" else 128 + signal.SIGTERM
    print(f"done: {r['mixer']}/{r['depth']}, {r['num_kv_pairs']} pairs at length {r['seq_len']}: "
          f"recall accuracy {r['accuracy']:.4f} (best {r['best_accuracy']:.4f}) after "
          f"{r['steps']} steps, {r['seconds']:.0f} s; run folder {out}")
    return 0


# ---------------------------------------------------------------------------- inspect

def cmd_inspect(args) -> int:
    import dataclasses

    import tomllib
    import torch

    from .config import load_config
    from .model import LanguageModel
    from .model.lm import check_memory
    from .ode import ADAPTIVE_METHODS

    cfg = load_config(args.config, args.set, plugins=args.plugin)
    if args.explain:
        from .config import explain

        print(explain(cfg))
        return 0
    raw = tomllib.loads(Path(args.config).read_text(encoding="utf-8-sig"))
    if "mqar" in raw or any(s.startswith("mqar.") for s in args.set):
        # the model `continuumlm mqar` trains: the task's vocabulary and sequence length
        from .train.mqar import _task_model

        model_cfg, source = _task_model(cfg), "mqar.vocab_size"
    else:
        vocab, source = cfg.model.vocab_size, "model.vocab_size"
        if vocab == 0:
            from .data import prepare_data

            vocab, source = prepare_data(cfg.data).tokenizer.vocab_size, "the tokenizer"
        model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab)
    vocab = model_cfg.vocab_size
    check_memory(model_cfg, "cpu", training=False)
    model = LanguageModel(model_cfg)
    with torch.no_grad():
        model(torch.zeros(1, 2, dtype=torch.long))
    info = {"config": args.config, "vocab_size": vocab, "vocab_from": source,
            "parameters": model.num_parameters(), "nfe_per_forward": model.last_nfe,
            "exact_cached_decoding": bool(getattr(model.depth, "exact_cache", True))}
    if model_cfg.depth == "ode" and model_cfg.ode_solver in ADAPTIVE_METHODS:
        # an adaptive solver's step count depends on the weights and the input
        info["nfe_per_forward"] = None
        info["nfe_note"] = (f"{model_cfg.ode_solver} is adaptive: its NFE depends on the trained "
                            f"weights and the input ({model.last_nfe} for this untrained model on "
                            f"a 2-token input); `continuumlm eval --json` reports it for a checkpoint")
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k}: {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k}: {v}")
    return 0


# ---------------------------------------------------------------------------- prepare

def cmd_prepare(args) -> int:
    if args.workers:  # read by the tokenizers library when its thread pool starts, and by
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)  # the word tokenizer's processes
        os.environ["CONTINUUMLM_PREPARE_WORKERS"] = str(args.workers)
    from .data import _plan, tokenizer_spec
    from .data.prepare import Plan, TokenizerSpec, prepare_cached, prepare_folder
    from .data.sources import expand
    from .data.tokenizers import KINDS, load_tokenizer

    say = (lambda m: None) if args.quiet else (lambda m: print(f"prepare: {m}", file=sys.stderr))
    if bool(args.config) == bool(args.input):
        raise UsageError("name what to prepare: --config FILE (its [data] corpus) or --input "
                         "SRC [SRC ...] with --out DIR.")
    t0 = time.time()
    if args.config:
        from .config import load_config

        cfg = load_config(args.config, args.set, plugins=args.plugin)
        if cfg.data.dataset == "prepared":
            raise UsageError(f"{args.config} reads the prepared folder {cfg.data.path}: it is "
                             f"prepared already.")
        plan, spec = _plan(cfg.data), tokenizer_spec(cfg.data)
    else:
        if not args.out:
            raise UsageError("--input needs --out DIR, the folder to write the prepared corpus to.")
        for name, v in (("--val-fraction", args.val_fraction),
                        ("--test-fraction", args.test_fraction)):
            if not 0 <= v < 1:
                raise UsageError(f"{name} {v} must be in [0, 1).")
        if args.val_fraction <= 0 or args.val_fraction + args.test_fraction >= 1:
            raise UsageError(f"--val-fraction {args.val_fraction} and --test-fraction "
                             f"{args.test_fraction} must leave a training and a validation part "
                             f"(val > 0, val + test < 1).")
        plan = Plan({"all": expand(args.input)}, 1 - args.val_fraction - args.test_fraction,
                    args.test_fraction, text_field=args.text_field, errors=args.errors)
        if args.tokenizer in KINDS:
            if args.tokenizer == "char" and args.vocab_size:
                raise UsageError("--vocab-size has no effect with --tokenizer char (every "
                                 "character is a token); leave it out.")
            if args.tokenizer == "bpe" and args.vocab_size and args.vocab_size < 257:
                raise UsageError(f"--vocab-size {args.vocab_size} is too small for bpe: its "
                                 f"vocabulary holds 256 bytes and <|endoftext|> before any merge.")
            spec = TokenizerSpec(args.tokenizer, args.vocab_size, args.vocab_source,
                                 args.unknown_chars, args.sample_chars, args.seed)
        elif args.tokenizer.startswith("tiktoken:"):
            from .data.tiktoken_bpe import from_tiktoken

            if args.vocab_size:
                raise UsageError("--vocab-size has no effect with a tiktoken encoding (its "
                                 "vocabulary is fixed); leave it out.")
            spec = TokenizerSpec(given=from_tiktoken(args.tokenizer.partition(":")[2]))
        else:
            path = Path(args.tokenizer)
            if not path.exists():
                raise UsageError(f"--tokenizer {args.tokenizer}: not char, word, bpe or "
                                 f"tiktoken:NAME, and no such file; name a kind, a tiktoken "
                                 f"encoding, or a tokenizer.json (a Hugging Face tokenizers "
                                 f"file or one a ContinuumLM run saved).")
            given = load_tokenizer(path)
            why = given.cuttable() if hasattr(given, "cuttable") else None
            if why:
                raise UsageError(
                    f"--tokenizer {args.tokenizer}: {why} makes its encoding depend on where a "
                    f"long text is cut, so prepare (which streams text in pieces) cannot "
                    f"promise the ids it would give the whole text. prepare reads byte-level "
                    f"BPE tokenizers with GPT-2's pre-tokenizer (as bpe trains, and GPT-2's own "
                    f"tokenizer.json); train one with --tokenizer bpe.")
            spec = TokenizerSpec(given=given)
    if args.out:
        out = Path(args.out)
        for named in args.input or []:
            folder = Path(named).expanduser()
            if folder.is_dir() and (out.resolve() == folder.resolve()
                                    or folder.resolve() in out.resolve().parents):
                raise UsageError(f"--out {out} lies inside the input folder {named}: a later "
                                 f"prepare of that folder would read these token files as "
                                 f"text. Prepare into a folder outside the inputs.")
        meta, fresh = prepare_folder(out, plan, spec, args.dtype, args.force, args.quiet, say)
    else:
        from .data.corpora import cache_dir
        from .data.shards import read_meta

        if args.dtype != "auto" or args.force:
            raise UsageError("--dtype and --force apply to --out; the cache that train reads "
                             "keeps each preparation once, in the dtype its vocabulary needs.")
        out = prepare_cached(cache_dir() / "prepared", plan, spec, quiet=args.quiet, log=say)
        meta, fresh = read_meta(out), True
    from .data.prepare import warn_unknown

    warn_unknown(meta)
    if not fresh:
        print(f"{out} already holds this preparation (same inputs and settings); nothing to do.")
        return 0
    splits = ", ".join(f"{k} {v['tokens']:,}" for k, v in meta["splits"].items())
    print(f"prepared {out}: {meta['tokenizer']['kind']} tokenizer, {meta['vocab_size']:,} tokens "
          f"in the vocabulary, {meta['dtype']}; tokens: {splits} ({time.time() - t0:.1f} s)")
    if args.config:
        print(f"train with: continuumlm train --config {args.config} (it finds this preparation "
              f"in the cache), or --set data.dataset=prepared --set data.path={out}")
    else:
        print(f"train with: [data] dataset = \"prepared\", path = \"{out}\"")
    return 0


# ---------------------------------------------------------------------------- eval

def cmd_eval(args) -> int:
    from .data import changed_splits, corpus_name, prepare_data
    from .eval.perplexity import evaluate_contexts
    from .train import load_model_and_tokenizer, pick_device
    from .train.checkpoint import STATE_FILE, load_run_config, load_trainer_state

    device = pick_device(args.device, "--device")
    model, tok, ckpt = load_model_and_tokenizer(args.checkpoint, args.which, map_location=device)
    run = load_run_config(ckpt)
    if args.ode_solver or args.ode_steps:
        try:
            model.set_solver(args.ode_solver, args.ode_steps, ode_grad="direct")  # no gradients
        except ValueError as e:
            raise UsageError(str(e)) from None
    _apply_exit(model, args)
    data = prepare_data(run.data, tok)
    recorded = (load_trainer_state(ckpt).get("data")
                if (ckpt / STATE_FILE).is_file() else None)
    if args.split in changed_splits(recorded, data):
        print(f"warning: the {args.split} split's text differs from the one recorded when this "
              f"run was trained ({corpus_name(run.data)} was changed since); these figures "
              f"are not comparable with those of the same split made then.", file=sys.stderr)
    if args.split not in data.splits:
        raise UsageError(f"--split {args.split}: this corpus has the splits "
                         f"{', '.join(s for s in data.splits if s != 'train')}.")
    contexts = args.context_lengths or [run.train.seq_len]
    rows = evaluate_contexts(model, data.splits[args.split], contexts, tok.kind == "char", device,
                             max_windows=args.max_windows)
    if args.json:
        cfg = model.config
        print(json.dumps({"checkpoint": str(ckpt), "split": args.split, "depth": cfg.depth,
                          "ode_solver": cfg.ode_solver if cfg.depth == "ode" else None,
                          "ode_steps": cfg.ode_steps if cfg.depth == "ode" else None,
                          "nfe": model.last_nfe,
                          "exit": ({"threshold": args.exit_threshold,
                                    "criterion": args.exit_criterion}
                                   if args.exit_threshold is not None else None),
                          "results": rows}, indent=2))
        return 0
    print(f"{ckpt} — {args.split} split, {len(data.splits[args.split]):,} tokens")
    exiting = args.exit_threshold is not None
    print(f"{'context':>8} {'loss':>8} {'ppl':>10} {'bpc':>7} {'windows':>8}"
          + (f" {'NFE/token':>10}" if exiting else ""))
    for r in rows:
        if "unsupported" in r:
            print(f"{r['context']:>8}  unsupported: {r['unsupported']}")
        else:
            bpc = f"{r['bpc']:.4f}" if "bpc" in r else "-"
            print(f"{r['context']:>8} {r['loss']:>8.4f} {r['ppl']:>10.3f} {bpc:>7} {r['windows']:>8}"
                  + (f" {r['nfe_per_token']:>10.2f}" if exiting else ""))
    if exiting:
        print(f"per-token exit: {args.exit_criterion} < {args.exit_threshold:g}; full depth is "
              f"{_full_nfe(model)} field evaluations per token")
    return 0


def _full_nfe(model) -> int:
    cfg = model.config
    return cfg.num_layers * cfg.ode_steps * int(model.depth.blocks[0].solver.evals_per_step)


# ---------------------------------------------------------------------------- generate

def cmd_generate(args) -> int:
    import torch

    from .train import load_model_and_tokenizer, pick_device

    device = pick_device(args.device, "--device")
    model, tok, _ = load_model_and_tokenizer(args.checkpoint, args.which, map_location=device)
    _apply_exit(model, args)
    ids = tok.encode(args.prompt)
    if not ids:
        start = getattr(tok, "eos_id", None)
        if start is None:
            raise UsageError("--prompt is empty and this tokenizer has no start token; give at "
                             "least one character of prompt.")
        ids = [start]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    stop = tok.eos_id if tok.kind == "bpe" else None
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  greedy=args.greedy, use_cache=not args.no_cache, generator=gen,
                  eos_token_id=stop, compile=args.compile)
    try:
        if args.num_samples == 1:
            _stream(model, tok, idx, args, kwargs)
        else:
            out = model.generate(idx, args.max_new_tokens, **kwargs)
            for i, row in enumerate(out.tolist()):
                new = row[len(ids):]
                if stop is not None and stop in new:  # rows that finished early are padded
                    new = new[:new.index(stop) + 1]  # with end-of-text: print it once
                if i:
                    print("\n---")
                print(tok.decode(ids + new), end="")
            print()
    except ValueError as e:  # bad sampling arguments or a context the model cannot hold
        raise UsageError(str(e)) from None
    if args.exit_threshold is not None:
        done, tokens = model.depth.exit_totals
        print(f"per-token exit ({args.exit_criterion} < {args.exit_threshold:g}): "
              f"{done / max(tokens, 1):.2f} field evaluations per token on average (prompt "
              f"included), of {_full_nfe(model)} at full depth", file=sys.stderr)
    return 0


def _stream(model, tok, idx, args, kwargs) -> None:
    stream = model.generate_stream(idx, args.max_new_tokens, **kwargs)  # bad arguments raise here
    ids = idx[0].tolist()
    printed = tok.decode(ids)
    sys.stdout.write(printed)
    for nxt in stream:
        ids.append(int(nxt[0]))
        text = tok.decode(ids)
        if text.endswith("\ufffd"):
            continue  # an incomplete multi-byte character: wait for the rest
        sys.stdout.write(text[len(printed):] if text.startswith(printed) else "\n" + text)
        sys.stdout.flush()
        printed = text
    text = tok.decode(ids)
    if text != printed:  # generation stopped inside a multi-byte character: show what came
        sys.stdout.write(text[len(printed):] if text.startswith(printed) else "\n" + text)
    sys.stdout.write("\n")
    sys.stdout.flush()



# ---------------------------------------------------------------------------- export

def cmd_export(args) -> int:
    from .train.checkpoint import export_sharded, resolve_checkpoint

    if args.format == "hf":
        return _export_hf(args)
    if args.out:
        raise UsageError("--out is the folder of --format hf; the safetensors export writes "
                         "into the checkpoint folder itself.")
    done = set()
    for which in [args.which] if args.which else ["last", "best"]:
        try:
            ckpt = resolve_checkpoint(args.checkpoint, which).resolve()
        except CheckpointError:
            if which == "best" and not args.which:  # a run that never improved has no best
                continue
            raise
        if ckpt not in done:  # last and best are often the same step
            done.add(export_sharded(ckpt))
            print(f"wrote {ckpt / 'model.safetensors'} (consolidated from {ckpt / 'sharded'})")
    return 0


def _export_hf(args) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("export --hf needs transformers: pip install 'continuumlm[hf]'.") from None
    from .hf.export import export_hf
    from .train import load_model_and_tokenizer

    if not args.out:
        raise UsageError("--format hf needs --out DIR, the folder to write.")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not an empty folder; export into a new one.")
    model, tok, ckpt = load_model_and_tokenizer(args.checkpoint, args.which or "best")
    export_hf(model, tok, out)
    print(f"wrote {out} from {ckpt}: load it with AutoModelForCausalLM.from_pretrained("
          f"{str(out)!r}) after `import continuumlm.hf`, or with trust_remote_code=True")
    return 0


def cmd_harness(args) -> int:
    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("harness needs lm-evaluation-harness and transformers: pip install "
                         "'continuumlm[eval]'.") from None
    from .hf.harness import run_harness

    if args.keep and Path(args.keep).exists():
        raise UsageError(f"--keep {args.keep} exists; name a new folder.")
    try:
        r = run_harness(args.checkpoint, args.which, args.split, args.context, args.ode_solver,
                        args.ode_steps, args.max_tokens, args.device, args.keep)
    except ValueError as e:  # a solver the checkpoint cannot take
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    h, o = r["harness"], r["ours"]
    print(f"{r['checkpoint']} — {r['split']} split, {r['tokens']:,} tokens, context "
          f"{r['context']}, NFE {r['nfe']}")
    print(f"lm-eval:          bits/byte {h['bits_per_byte']:.4f}  byte ppl "
          f"{h['byte_perplexity']:.4f}  word ppl {h['word_perplexity']:.3f}")
    print(f"continuumlm eval: bits/byte {o['bits_per_byte']:.4f}  loss {o['loss']:.4f} "
          f"nats/token (ratio {r['bits_per_byte_ratio']:.4f})")
    if args.keep:
        print(f"kept in {args.keep}; lm-eval's own command:\n  {r['lm_eval_command']}")
    return 0


# ---------------------------------------------------------------------------- experiment

def cmd_experiment(args) -> int:
    from .experiments import EXPERIMENTS, ORDER, commands, run_experiment

    if args.list or not args.name:
        for n in ORDER:
            print(f"{n}: {EXPERIMENTS[n][0]}")
            for c in commands(n, args.quick):
                print("    python bench/" + " ".join(c))
        return 0
    if args.quick_dir and not args.quick:
        raise UsageError("--quick-dir goes with --quick; full-size results always go to "
                         "bench/results and docs/.")
    page = run_experiment(args.name, quick=args.quick, redo=args.redo,
                          quick_dir=Path(args.quick_dir).resolve() if args.quick_dir else None)
    print(f"results page: {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
