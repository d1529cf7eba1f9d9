"""eval, generate, export and harness: what is done with a trained checkpoint."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..errors import CheckpointError
from .common import UsageError, _apply_exit, exit_criterion, thread_policy


def ladder_text(args) -> str:
    """" across solves A, B, then the own" for a ladder, "" for per-step exit."""
    ladder = getattr(args, "exit_ladder", None)
    return f" across solves {', '.join(ladder)}, then the own" if ladder else ""

# ---------------------------------------------------------------------------- eval

def cmd_eval(args) -> int:
    from ..data import changed_splits, corpus_name, prepare_data
    from ..eval.perplexity import evaluate_contexts
    from ..runs import load_model_and_tokenizer
    from ..runs.checkpoint import STATE_FILE, load_run_config, load_trainer_state
    from ..train import pick_device

    threads = thread_policy(args, "evaluation")
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
    solves = _agreement_solves(model, args)
    chosen = threads.apply()
    rows = evaluate_contexts(model, data.splits[args.split], contexts, tok.kind == "char", device,
                             max_windows=args.max_windows)
    agreed = None
    if solves:
        from ..eval.agreement import agreement

        agreed = agreement(model, data.splits[args.split], contexts[0], solves, device,
                           max_windows=args.max_windows)
    if args.json:
        cfg = model.config
        print(json.dumps({"checkpoint": str(ckpt), "split": args.split, "depth": cfg.depth,
                          "ode_solver": cfg.ode_solver if cfg.depth == "ode" else None,
                          "ode_steps": cfg.ode_steps if cfg.depth == "ode" else None,
                          "trained_with": ({"ode_solver": run.model.ode_solver,
                                            "ode_steps": run.model.ode_steps}
                                           if cfg.depth == "ode" else None),
                          "threads": chosen.threads,
                          "nfe": model.last_nfe,
                          "ode_kv": cfg.ode_kv if cfg.depth == "ode" else None,
                          "cache": _cache_memory(model, as_dict=True),
                          "exit": ({"threshold": args.exit_threshold,
                                    "criterion": exit_criterion(args),
                                    **({"ladder": args.exit_ladder} if args.exit_ladder
                                       else {})}
                                   if args.exit_threshold is not None else None),
                          **({"agreement": {k: v["agreement"] for k, v in agreed.items()},
                              "agreement_kl": {k: v["kl"] for k, v in agreed.items()},
                              "agreement_context": contexts[0]} if agreed else {}),
                          "results": rows}, indent=2))
        return 0
    print(f"{ckpt} — {args.split} split, {len(data.splits[args.split]):,} tokens")
    print(f"{_depth_text(model, run.model)}; {chosen}")
    memory = _cache_memory(model)
    if memory:
        print(memory)
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
        print(f"per-token exit{ladder_text(args)}: {exit_criterion(args)} < "
              f"{args.exit_threshold:g}; full depth is "
              f"{_full_nfe(model)} field evaluations per token")
    if agreed:
        own = (f"{model.config.ode_solver}:{model.config.ode_steps}"
               if model.config.depth == "ode" else f"all {model.config.num_layers} layers")
        print(f"agreement with the own solve ({own}), teacher-forced at context {contexts[0]}, "
              f"{next(iter(agreed.values()))['positions']:,} positions:")
        print(f"{'draft':>10} {'NFE':>5} {'greedy same':>12} {'KL(own||draft)':>15}")
        for (solver, steps), (name, a) in zip(solves, agreed.items()):
            nfe = _solve_nfe(model, solver, steps)
            print(f"{name:>10} {nfe:>5} {a['agreement']:>12.4f} {a['kl']:>15.4f}")
    return 0


def _agreement_solves(model, args) -> list[tuple[str, int]]:
    """--agreement's solves, checked against the model before anything is evaluated."""
    if not args.agreement:
        return []
    from ..config.any_depth import parse_solve
    from ..errors import ConfigError

    if args.exit_threshold is not None:
        raise UsageError("--agreement compares whole solves; drop --exit-threshold (per-token "
                         "exit), or evaluate the two apart.")
    if model.config.depth not in ("ode", "discrete"):
        raise UsageError(f"--agreement compares an ODE model's coarse solves, or a discrete "
                         f"stack's first layers, with the whole model; this model has "
                         f"{model.config.depth} depth.")
    if model.config.depth == "discrete":
        from ..eval.agreement import check_draft_of

        drafts = []
        for text in args.agreement.split(","):
            try:
                draft = parse_solve(text, "--agreement")
                check_draft_of(model, draft)
            except (ConfigError, ValueError) as e:
                raise UsageError(f"--agreement {text.strip()!r}: {e}") from None
            drafts.append(draft)
        return drafts
    if not getattr(model.depth, "exact_cache", True):
        raise UsageError(f"--agreement compares fixed-grid solves; the model's own solve "
                         f"({model.config.ode_solver}) is adaptive.")
    solves = []
    own = (model.config.ode_solver, model.config.ode_steps, model.config.ode_grad)
    for text in args.agreement.split(","):
        try:
            solver, steps = parse_solve(text, "--agreement")
            model.set_solver(solver, steps, ode_grad="direct")
            if not getattr(model.depth, "exact_cache", True):
                raise ValueError(f"{solver} is adaptive; a draft is a fixed-grid solve "
                                 f"(euler, midpoint, heun, rk4, ...)")
        except (ConfigError, ValueError) as e:
            raise UsageError(f"--agreement {text.strip()!r}: {e}") from None
        finally:
            model.set_solver(*own)
        solves.append((solver, steps))
    return solves


def _solve_nfe(model, solver: str, steps: int) -> int:
    from ..config.elastic import solve_nfe

    if solver == "layers":  # a discrete stack's first layers: one evaluation each
        return steps
    return model.config.num_layers * solve_nfe(model.config, solver, steps)


def _depth_text(model, trained) -> str:
    """How the evaluated model integrates its depth: solver, steps and field evaluations per
    token, and the trained solve where --ode-solver/--ode-steps changed it."""
    cfg = model.config
    if cfg.depth != "ode":
        return f"{cfg.num_layers} discrete layer{'s' * (cfg.num_layers != 1)}"
    blocks = f"{cfg.num_layers} block{'s' * (cfg.num_layers != 1)}"
    if getattr(model.depth.blocks[0].solver, "fixed_grid", True):
        text = (f"ODE depth: {cfg.ode_solver} x {cfg.ode_steps} steps, {_full_nfe(model)} field "
                f"evaluations per token ({blocks})")
    else:
        text = (f"ODE depth: {cfg.ode_solver}, adaptive (rtol {cfg.ode_rtol:g}, atol "
                f"{cfg.ode_atol:g}), {model.last_nfe} field evaluations in the last batch "
                f"({blocks})")
    if (cfg.ode_solver, cfg.ode_steps) != (trained.ode_solver, trained.ode_steps):
        text += f"; trained with {trained.ode_solver} x {trained.ode_steps}"
    return text


def _cache_memory(model, as_dict: bool = False):
    """The decoding cache per sequence (``LanguageModel.cache_memory``) as a line, or a dict;
    None for a model that decodes without caches."""
    memory = model.cache_memory()
    cacheless = model.cacheless_mixers()
    if cacheless:
        names = ", ".join(map(repr, cacheless))
        return ({"none": f"the mixer {names} has no decoding cache"} if as_dict else
                f"decoding cache: none (the mixer {names} has no decoding cache)")
    if memory is None:
        return None
    blocks = model.config.num_layers
    return memory.as_dict(blocks) if as_dict else memory.describe(blocks)


def _full_nfe(model) -> int:
    cfg = model.config
    return cfg.num_layers * cfg.ode_steps * int(model.depth.blocks[0].solver.evals_per_step)


# ---------------------------------------------------------------------------- generate

def cmd_generate(args) -> int:
    from ..decoding.kernels import decoding_kernels
    from ..runs import load_model_and_tokenizer
    from ..train import pick_device

    threads = thread_policy(args, "decoding")
    device = pick_device(args.device, "--device")
    model, tok, _ = load_model_and_tokenizer(args.checkpoint, args.which, map_location=device)
    with decoding_kernels(model, args.onednn, compiled=args.compile) as kernels:
        return _generate(args, model, tok, device, threads, kernels)


def _generate(args, model, tok, device, threads, kernels: str) -> int:
    import torch

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
    draft = None
    if (args.draft_solver or args.draft_steps or args.draft_tokens or args.draft_layers
            or args.draft_confidence or args.draft_pipeline):
        from ..decoding import Draft

        draft = Draft(args.draft_solver or "euler", args.draft_steps or 1,
                      args.draft_tokens or 4, layers=args.draft_layers,
                      confidence=args.draft_confidence, pipeline=args.draft_pipeline)
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  greedy=args.greedy, use_cache=not args.no_cache, generator=gen,
                  eos_token_id=stop, compile=args.compile, threads=threads, draft=draft,
                  cuda_graph={"auto": None, "on": True, "off": False}[args.cuda_graph])
    clock = _DecodeClock()
    try:
        stream = model.generate_stream(idx, args.max_new_tokens, **kwargs)
        if args.num_samples == 1:
            _stream(tok, idx, stream, clock)
        else:
            out = torch.cat([idx] + [t[:, None] for t in clock.timed(stream)], dim=1)
            held = 0
            for i, row in enumerate(out.tolist()):
                new = row[len(ids):]
                if stop is not None and stop in new:  # rows that finished early are padded
                    new = new[:new.index(stop) + 1]  # with end-of-text: print it once
                if i:
                    print("\n---")
                text, cut = _whole_characters(tok, ids + new)
                held = max(held, cut)
                print(text, end="")
            print()
            _say_held(held)
    except ValueError as e:  # bad sampling arguments or a context the model cannot hold
        raise UsageError(str(e)) from None
    # compiled: the second token's step compiles (an adaptive solver recomputes instead)
    compiled = args.compile and getattr(model.depth, "exact_cache", True)
    print(f"{clock.report(len(ids), compiled)}; {threads.choice}"
          + (f", changed {threads.changes} times" if threads.changes else "")
          + f"; {kernels}", file=sys.stderr)
    if draft is not None and draft.layers is not None:
        print(f"{stream.stats.report()} (draft: the first {draft.layers} of "
              f"{model.config.num_layers} layers)", file=sys.stderr)
    elif draft is not None:
        print(f"{stream.stats.report()} (draft {draft.solver} x {draft.steps}, model "
              f"{model.config.ode_solver} x {model.config.ode_steps}: {_full_nfe(model)} per "
              f"token without drafting)", file=sys.stderr)
    if args.exit_threshold is not None:
        done, tokens = model.depth.exit_totals
        print(f"per-token exit{ladder_text(args)} ({exit_criterion(args)} < "
              f"{args.exit_threshold:g}): "
              f"{done / max(tokens, 1):.2f} field evaluations per token on average "
              f"(prompt included), "
              f"of {_full_nfe(model)} at full depth", file=sys.stderr)
    memory = _cache_memory(model)  # after the exit totals: it steps the model once
    if memory:
        print(memory, file=sys.stderr)
    return 0


class _DecodeClock:
    """When each new token came: the set-up apart from the rest (decoding proper), so that
    tokens/s says what decoding costs and the set-up is reported on its own. The set-up is
    the first token (the prompt's forward) and, with --compile, the second: the first token
    is sampled from the prompt's logits, and the one-token step that makes the next is
    compiled at its first call."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []

    def timed(self, stream):
        for token in stream:
            self.times.append(time.perf_counter())
            yield token

    def report(self, prompt_tokens: int, compiled: bool) -> str:
        if not self.times:
            return "generated no tokens"
        stamps = [self.start, *self.times]
        setup = f"first token {stamps[1] - stamps[0]:.2f} s (the {prompt_tokens}-token prompt)"
        k = 1  # tokens of set-up
        if compiled and len(self.times) >= 2:
            setup += (f", second {stamps[2] - stamps[1]:.2f} s (the one-token step's first "
                      f"call, which compiles it)")
            k = 2
        if len(self.times) <= k:
            return f"generated {len(self.times)} token{'s' * (len(self.times) != 1)}: {setup}"
        rest = self.times[-1] - self.times[k - 1]
        n = len(self.times) - k
        return (f"generated {len(self.times)} tokens: {setup}; then {n} tokens in {rest:.2f} s, "
                f"{n / max(rest, 1e-9):.1f} tokens/s")


def _stream(tok, idx, stream, clock: _DecodeClock) -> None:
    stream = clock.timed(stream)
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
    text, held = _whole_characters(tok, ids)
    if text != printed:
        sys.stdout.write(text[len(printed):] if text.startswith(printed) else "\n" + text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    _say_held(held)


def _whole_characters(tok, ids: list[int]) -> tuple[str, int]:
    """The text of ``ids`` without a last character whose bytes have not all come (byte-level
    BPE splits a character's bytes over tokens; decoding them alone gives U+FFFD), and how many
    tokens were held back for it. Bytes that no later byte could complete stay as U+FFFD."""
    text = tok.decode(ids)
    for k in range(1, min(4, len(ids))):  # a UTF-8 character has at most 4 bytes
        if not text.endswith("\ufffd"):
            return text, k - 1
        shorter = tok.decode(ids[:-k])
        if not shorter.endswith("\ufffd"):
            return shorter, k
    return text, 0


def _say_held(held: int) -> None:
    if held:
        print(f"(the last {held} token{'s' * (held != 1)} stopped inside a multi-byte "
              f"character, not printed; ask for more tokens to complete it)", file=sys.stderr)



# ---------------------------------------------------------------------------- export

def cmd_export(args) -> int:
    from ..runs.checkpoint import export_sharded, resolve_checkpoint

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
    from ..hf.export import export_hf
    from ..runs import load_model_and_tokenizer

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
    threads = thread_policy(args, "scoring")
    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("harness needs lm-evaluation-harness and transformers: pip install "
                         "'continuumlm[eval]'.") from None
    from ..hf.harness import run_harness

    if args.keep and Path(args.keep).exists():
        raise UsageError(f"--keep {args.keep} exists; name a new folder.")
    print(f"threads: {threads.apply()}", file=sys.stderr)
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
          f"nats/token (ratio {r['bits_per_byte_ratio']:.4f}; other windows)")
    print(f"the model on lm-eval's windows: bits/byte "
          f"{r['ours_on_harness_windows']['bits_per_byte']:.4f} (ratio "
          f"{r['harness_windows_ratio']:.6f}; 1 up to float rounding)")
    if args.keep:
        print(f"kept in {args.keep}; lm-eval's own command:\n  {r['lm_eval_command']}")
    return 0


