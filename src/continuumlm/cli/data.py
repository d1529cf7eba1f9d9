"""inspect (a config's model) and prepare (a corpus into token files)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .common import UsageError

# ---------------------------------------------------------------------------- inspect

def cmd_inspect(args) -> int:
    import dataclasses

    import tomllib
    import torch

    from ..config import load_config
    from ..model import LanguageModel
    from ..model.lm import check_memory
    from ..ode import ADAPTIVE_METHODS

    cfg = load_config(args.config, args.set, plugins=args.plugin)
    if args.explain:
        from ..config import explain

        print(explain(cfg))
        return 0
    raw = tomllib.loads(Path(args.config).read_text(encoding="utf-8-sig"))
    if "mqar" in raw or any(s.startswith("mqar.") for s in args.set):
        # the model `continuumlm mqar` trains: the task's vocabulary and sequence length
        from ..train.mqar import _task_model

        model_cfg, source = _task_model(cfg), "mqar.vocab_size"
    else:
        vocab, source = cfg.model.vocab_size, "model.vocab_size"
        if vocab == 0:
            from ..data import prepare_data

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
    from ..data import _plan, tokenizer_spec
    from ..data.prepare import Plan, TokenizerSpec, prepare_cached, prepare_folder
    from ..data.sources import expand
    from ..data.tokenizers import KINDS, load_tokenizer

    say = (lambda m: None) if args.quiet else (lambda m: print(f"prepare: {m}", file=sys.stderr))
    if bool(args.config) == bool(args.input):
        raise UsageError("name what to prepare: --config FILE (its [data] corpus) or --input "
                         "SRC [SRC ...] with --out DIR.")
    t0 = time.time()
    if args.config:
        from ..config import load_config

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
            from ..data.tiktoken_bpe import from_tiktoken

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
        from ..data.corpora import cache_dir
        from ..data.shards import read_meta

        if args.dtype != "auto" or args.force:
            raise UsageError("--dtype and --force apply to --out; the cache that train reads "
                             "keeps each preparation once, in the dtype its vocabulary needs.")
        out = prepare_cached(cache_dir() / "prepared", plan, spec, quiet=args.quiet, log=say)
        meta, fresh = read_meta(out), True
    from ..data.prepare import warn_unknown

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


