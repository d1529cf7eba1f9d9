"""ContinuumLM command line: train, eval, generate, serve, mqar, inspect, export, experiment.

Every user error (bad config, missing file, bad flag) exits with status 2 and a one-paragraph
message on stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

from ..errors import ContinuumLMError
from .common import (
    UsageError,
    _draft_tokens,
    _exit_arguments,
    _int_list,
    _positive_int,
    _probability,
    _seed,
    _threads,
)
from .data import cmd_inspect, cmd_prepare
from .experiment import cmd_experiment
from .models import cmd_eval, cmd_export, cmd_generate, cmd_harness
from .serving import add_serve_parser, cmd_serve
from .training import cmd_mqar, cmd_train, launch_torchrun

__all__ = ["main", "build_parser", "launch_torchrun", "UsageError"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="continuumlm", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    plugin = argparse.ArgumentParser(add_help=False)
    plugin.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import this module first, so the mixers, fields and solvers it "
                             "registers can be named in a config (repeatable; a trained run "
                             "remembers its plugins)")

    threads = argparse.ArgumentParser(add_help=False)
    threads.add_argument("--threads", type=_threads, metavar="{auto,N}",
                         help="torch's intra-op threads: auto (the default) takes the cores "
                              "that other processes leave idle, looked at again every few "
                              "seconds; N fixes the count. OMP_NUM_THREADS is kept under auto. "
                              "For train and mqar the same as --set train.threads=N")

    kernels = argparse.ArgumentParser(add_help=False)
    kernels.add_argument("--onednn", choices=("auto", "on", "off"), default="auto",
                         help="whether torch runs oneDNN's CPU kernels in this process: auto "
                              "(the default) turns it off for a float32 model on the CPU, not "
                              "compiled, where torch's own kernels decode 1.12-1.24x as fast "
                              "at batch 1 (oneDNN's GELU costs more than it saves at a few "
                              "rows)")

    # no abbreviated options: the launcher strips its own (--nproc, --nnodes, ...) by name
    t = sub.add_parser("train", parents=[plugin, threads], allow_abbrev=False,
                       help="train a model from a TOML config")
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
                   "train.strategy = 'fsdp'); per node with --nnodes")
    _launcher_options(t)

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
                   "cat_protocol, ptb, ptb_std, ode_kv, any_depth, mqar, bench, or all (--list "
                   "describes them; the table is the checkout's bench/experiment.py)")
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

    e = sub.add_parser("eval", parents=[plugin, threads], help="cross-entropy, perplexity and bits/char of a checkpoint")
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
    e.add_argument("--agreement", metavar="SOLVES", help="ODE models: for each coarse solve "
                   "(comma-separated SOLVER:STEPS, e.g. euler:1,euler:2,rk4:1), the fraction "
                   "of the split's positions where its greedy token equals the model's own "
                   "solve's (teacher-forced) and the mean KL between them, at the first "
                   "context length; discrete models: for each first-N-layers draft "
                   "(layers:N, as --draft-layers N drafts), the same against all layers")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")

    h = sub.add_parser("harness", parents=[plugin, threads], help="score a checkpoint with "
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

    q = sub.add_parser("mqar", parents=[plugin, threads], allow_abbrev=False,
                       help="train and score multi-query associative recall")
    q.add_argument("--config", required=True, help="TOML file with [model], [mqar], [train]")
    q.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    q.add_argument("--out", help="run folder (default: runs/mqar/<config name>)")
    q.add_argument("--quiet", action="store_true")
    q.add_argument("--nproc", type=_positive_int, help="train with N processes on this machine "
                   "(torchrun --standalone --nproc_per_node=N, as for train)")
    _launcher_options(q)

    i = sub.add_parser("inspect", parents=[plugin], help="parameter count and NFE of a config's model")
    i.add_argument("--config", required=True)
    i.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    i.add_argument("--json", action="store_true")
    i.add_argument("--explain", action="store_true", help="print every setting of the config "
                   "with its value, type, default and documentation (component tables too)")

    g = sub.add_parser("generate", parents=[plugin, threads, kernels], help="sample text from a checkpoint")
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
                   help="decode through one torch.compile graph of a solver step (a layer "
                        "of a discrete model), serving every step, block and buffer size: "
                        "1.9-4.0x the eager tokens/s on a 2-core CPU after about 10-15 s of "
                        "compiling (about 4 s of imports and tracing with a warm compiler "
                        "cache), so it pays for long generations; needs the cache (not with "
                        "--no-cache)")
    g.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="on a CUDA device, decode by replaying one recorded CUDA graph of a "
                        "whole token step per buffer size (recorded at the second token "
                        "after the prompt and at each doubling): auto (the default) with "
                        "--compile; on also without it; off never")
    g.add_argument("--device", default="cpu")
    g.add_argument("--draft-solver", metavar="SOLVER", help="self-speculative decoding (ODE "
                   "models, one sample): the same weights integrated with this fixed-grid "
                   "solver draft tokens that the model's own solve verifies in one pass; with "
                   "--greedy the same tokens as without it, sampling distributed as without "
                   "it (speculative sampling) (default euler when --draft-steps or "
                   "--draft-tokens is given)")
    g.add_argument("--draft-steps", type=_positive_int, help="... with this many steps "
                   "(default 1)")
    g.add_argument("--draft-tokens", type=_draft_tokens, metavar="{N,auto}",
                   help="... proposing N tokens per verification, or auto: adapted to how "
                        "many were kept (default 4)")
    g.add_argument("--draft-confidence", type=_probability, metavar="P",
                   help="... a round stops drafting after the first draft the draft gives "
                        "less than this probability, so --draft-tokens is the most per round "
                        "(default: always --draft-tokens)")
    g.add_argument("--draft-layers", type=_positive_int, metavar="N",
                   help="self-speculative decoding of a discrete model: its first N layers "
                        "(through its own final norm and head) draft, all of them verify")
    g.add_argument("--draft-pipeline", action="store_true",
                   help="... the drafts made ahead by a process of their own, on a second "
                        "core, while the model verifies (Linux, CPU, a fixed --draft-tokens; "
                        "the same greedy tokens, sampling distributed as without it)")
    _exit_arguments(g)
    add_serve_parser(sub, [plugin, threads, kernels])
    return p


def _launcher_options(p: argparse.ArgumentParser) -> None:
    """Several nodes: one launcher per node (srun --ntasks-per-node 1), meeting at a c10d
    rendezvous; see docs/cluster.md."""
    p.add_argument("--nnodes", type=_positive_int, help="the job spans N nodes, one such command "
                   "on each (e.g. srun --ntasks-per-node 1), each launching --nproc ranks; they "
                   "meet at a c10d rendezvous (torchrun --nnodes N --rdzv-backend c10d)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="with --nnodes: where the nodes "
                   "meet (default in a SLURM job: its first node, a port from the job id)")
    p.add_argument("--rdzv-id", metavar="ID", help="with --nnodes: the job's id, the same on "
                   "every node (default in a SLURM job: the job id and restart count)")


def _one_line_notes() -> None:
    """Old config spellings (``errors.OldSpelling``) print as one line, ``note: ...``; every
    other warning as Python prints it."""
    import warnings

    from ..errors import OldSpelling

    if getattr(warnings.showwarning, "continuumlm", False):
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, OldSpelling):
            print(f"note: {message}", file=file or sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    show.continuumlm = True
    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    in_process = argv is not None  # the Python API or a test, not the console command
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.in_process = in_process
    if getattr(args, "threads", None) is not None and args.command in ("train", "mqar"):
        args.set = [*args.set, f"train.threads={args.threads}"]
    _one_line_notes()
    try:
        if args.plugin:
            from ..registry import export_plugins, load_plugins

            load_plugins(args.plugin)
            export_plugins(args.plugin)  # torchrun ranks and benchmark children load them too
        commands = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate,
                    "mqar": cmd_mqar, "inspect": cmd_inspect, "export": cmd_export,
                    "prepare": cmd_prepare, "harness": cmd_harness,
                    "experiment": cmd_experiment, "serve": cmd_serve}
        return commands[args.command](args)
    except ContinuumLMError as e:
        from ..train.distributed import env_from_environment

        if e.collective and not env_from_environment().is_main:
            # every rank meets this error; rank 0 prints it and its exit makes the launcher
            # end this rank (SIGTERM, by its default action here). Should that not come,
            # print it here after all.
            import signal

            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(10)
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


