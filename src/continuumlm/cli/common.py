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


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < 1:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} must be a probability between 0 and 1, "
                                         f"exclusive, e.g. 0.1")
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
    parser.add_argument("--exit-criterion", choices=("state", "kl", "gate", "confidence"),
                        default=None,
                        help="state: relative change of the token's state over the step; kl: "
                             "KL between the next-token distributions read out before and after "
                             "it; gate: 1 - the model's learned halting gate (model.exit_gate); "
                             "confidence: 1 - the largest next-token probability read out "
                             "(default: state; with --exit-ladder, confidence)")
    parser.add_argument("--exit-ladder", type=_solves, metavar="SOLVES",
                        help="exit across whole solves instead of solver steps: each token "
                             "tries these coarser solves in order (e.g. euler:1,rk4:1), then "
                             "the model's own, and stops at the first whose criterion is below "
                             "TAU (one-block ODE models with model.ode_kv = 'block')")


def _solves(text: str) -> list[str]:
    from ..model.ladder import parse_rung

    out = [s.strip() for s in text.split(",") if s.strip()]
    try:
        for s in out:
            parse_rung(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not out:
        raise argparse.ArgumentTypeError("give at least one SOLVER:STEPS (e.g. euler:1).")
    return out


def exit_criterion(args) -> str:
    """The criterion asked for, or the default: confidence with a ladder, state without."""
    if args.exit_criterion is not None:
        return args.exit_criterion
    return "confidence" if getattr(args, "exit_ladder", None) else "state"


def _apply_exit(model, args) -> None:
    if args.exit_threshold is None:
        if getattr(args, "exit_ladder", None):
            raise UsageError("--exit-ladder needs --exit-threshold TAU (the criterion below "
                             "which a token stops at a rung).")
        return
    try:
        model.set_exit(args.exit_threshold, exit_criterion(args),
                       ladder=getattr(args, "exit_ladder", None))
    except ValueError as e:
        flag = "--exit-ladder" if getattr(args, "exit_ladder", None) else "--exit-threshold"
        raise UsageError(f"{flag}: {e}") from None


