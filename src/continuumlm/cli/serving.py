"""``continuumlm serve``: a trained model behind OpenAI's completion API (docs/serving.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import UsageError, thread_policy


def add_serve_parser(sub, parents) -> None:
    from .common import _exit_arguments, _positive_int

    s = sub.add_parser("serve", parents=parents,
                       help="serve a checkpoint over HTTP (OpenAI's completion API, "
                            "streaming, many clients decoded together; docs/serving.md)")
    s.add_argument("--checkpoint", required=True, help="run folder or checkpoint folder")
    s.add_argument("--which", choices=("best", "last"), default="best")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    s.add_argument("--model-name", help="the model's name in the API (default: the run "
                                        "folder's name)")
    s.add_argument("--max-batch", type=_positive_int, default=32,
                   help="rows decoded together at most (default 32)")
    s.add_argument("--max-queue", type=_positive_int, default=256,
                   help="rows waiting for a place in the batch at most; more are refused "
                        "with 429 (default 256)")
    s.add_argument("--max-prefill-tokens", type=_positive_int, default=256,
                   help="prompt tokens read per decoding turn at most (at least one request "
                        "a turn): joining requests lengthen the running rows' turn by their "
                        "prompts' pass; smaller evens out the time between tokens, larger "
                        "gives new requests their first token sooner (default 256)")
    s.add_argument("--no-lean", dest="lean", action="store_false",
                   help="decode every request through the batched decoding pass; by default a "
                        "request that comes to an idle server decodes alone through the lean "
                        "step, as generate does, until another request joins its depth")
    s.add_argument("--max-tokens", type=_positive_int, default=4096,
                   help="new tokens per request at most (default 4096)")
    s.add_argument("--max-context", type=_positive_int,
                   help="prompt and completion tokens together at most (default: the model's "
                        "max_seq_len; a learned-position model cannot exceed it)")
    s.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20,
                   help="request bodies larger than this are refused with 413 (default 1 MiB)")
    s.add_argument("--ode-solver", metavar="SOLVER", help="the depth of requests that name "
                   "none (default: the checkpoint's own solve)")
    s.add_argument("--ode-steps", type=_positive_int, metavar="N")
    s.add_argument("--device", default="cpu")
    _exit_arguments(s)


def cmd_serve(args) -> int:
    from ..serve.server import check_servable, missing_extra, serve

    why = missing_extra()
    if why:
        raise UsageError(why)
    from ..runs import load_model_and_tokenizer
    from ..train import pick_device
    from .common import _apply_exit, exit_criterion

    threads = thread_policy(args, "serving")
    device = pick_device(args.device, "--device")
    model, tok, ckpt = load_model_and_tokenizer(args.checkpoint, args.which,
                                                map_location=device)
    cfg = model.config
    if cfg.depth == "ode":
        try:
            model.set_solver(args.ode_solver, args.ode_steps, ode_grad="direct")
        except ValueError as e:
            raise UsageError(f"--ode-solver/--ode-steps: {e}") from None
    elif args.ode_solver or args.ode_steps:
        raise UsageError("--ode-solver/--ode-steps: this model is a discrete stack, with no "
                         "solve to choose.")
    check_servable(model)
    if args.exit_ladder:
        raise UsageError("--exit-ladder: the server batches requests through one decoding "
                         "state, and a ladder cuts its memory back token by token; this "
                         "version decodes a ladder with `continuumlm generate` and evaluates "
                         "it with `continuumlm eval`, not in the server. Drop --exit-ladder.")
    _apply_exit(model, args)
    max_context = args.max_context or cfg.max_seq_len
    if cfg.position == "learned" and max_context > cfg.max_seq_len:
        raise UsageError(f"--max-context {max_context}: this model's learned positions end at "
                         f"max_seq_len = {cfg.max_seq_len}; give at most that.")
    name = args.model_name or _run_name(Path(args.checkpoint), ckpt)
    from ..decoding.kernels import decoding_kernels

    with decoding_kernels(model, args.onednn) as kernels:
        print(f"decoding with {kernels}", file=sys.stderr)
        return serve(model, tok, model_name=name, host=args.host, port=args.port,
                     max_batch=args.max_batch, max_queue=args.max_queue,
                     max_context=max_context, max_prefill_tokens=args.max_prefill_tokens,
                     max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes,
                     threads=threads, lean=args.lean,
                     exit_rule=(exit_criterion(args), args.exit_threshold)
                     if args.exit_threshold is not None else None)


def _run_name(given: Path, ckpt: Path) -> str:
    """The run folder's name (a checkpoint folder's run, two levels up)."""
    path = given.resolve()
    if path == ckpt.resolve() and ckpt.parent.name == "checkpoints":
        path = ckpt.parent.parent
    return path.name
