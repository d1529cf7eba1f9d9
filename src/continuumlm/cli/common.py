"""What every command shares: the user-error type and argument parsers."""

from __future__ import annotations

import argparse

from ..errors import ContinuumLMError


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


def _threads(text: str) -> int | str:
    from ..threads import parse_threads

    try:
        return parse_threads(text, "--threads")
    except ContinuumLMError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _draft_tokens(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    return _positive_int(text)


def thread_policy(args, work: str):
    """The command's ThreadPolicy (--threads, default auto), made when the command starts so
    that its first look at the machine spans loading the model."""
    from ..threads import ThreadPolicy

    return ThreadPolicy(args.threads or "auto", work)


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


def _exit_arguments(parser) -> None:
    parser.add_argument("--exit-threshold", type=_threshold, metavar="TAU",
                        help="per-token adaptive depth (ODE models with a fixed-grid solver): "
                             "a token whose state has settled after a solver step (criterion "
                             "below TAU) stops integrating for the rest of its block")
    parser.add_argument("--exit-criterion", choices=("state", "kl", "gate"), default="state",
                        help="state: relative change of the token's state over the step; kl: "
                             "KL between the next-token distributions read out before and after "
                             "it; gate: 1 - the model's learned halting gate (model.exit_gate) "
                             "(default: state)")


def _apply_exit(model, args) -> None:
    if args.exit_threshold is None:
        return
    try:
        model.set_exit(args.exit_threshold, args.exit_criterion)
    except ValueError as e:
        raise UsageError(f"--exit-threshold: {e}") from None


