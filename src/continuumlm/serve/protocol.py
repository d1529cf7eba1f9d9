"""The request bodies the server accepts (OpenAI's completion API, and the fields that choose
a request's depth), their checks, and the engine :class:`~.engine.Request` each becomes.

Every refusal is an :class:`APIError`: an HTTP status and a message naming the field, sent in
OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ContinuumLMError
from .request import Depth, Sampling

MAX_LOGPROBS = 20  # as vLLM: the most alternatives a position reports
MAX_N = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                       type, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    # unknown fields refused; no silent coercion of "16" into 16
    model_config = ConfigDict(extra="forbid", strict=True)


class DraftSpec(_Body):
    """``draft``: self-speculative decoding of this request (ODE models: ``solver`` x
    ``steps`` drafts ``tokens`` per verification; discrete models: the first ``layers``;
    ``confidence``: a round stops drafting below it, as ``Draft.confidence``; ``pipeline``:
    the drafts made ahead by a drafting process of their own, as ``Draft.pipeline``)."""

    solver: str = "euler"
    steps: int = Field(1, ge=1, le=1024)
    tokens: int | Literal["auto"] = 4
    layers: int | None = Field(None, ge=1)
    confidence: float | None = Field(None, gt=0, lt=1)
    pipeline: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionBody(_Body):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's: -1 or 0 mean every token
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    best_of: int | None = Field(None, ge=1)
    # the depth of this request (OpenAI clients send them through extra_body)
    ode_solver: str | None = None
    ode_steps: int | None = Field(None, ge=1, le=1024)
    exit_threshold: float | None = Field(None, ge=0)
    exit_criterion: Literal["state", "kl", "gate", "confidence"] | None = None
    draft: DraftSpec | None = None


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    messages: list


def parse(body_cls, data) -> BaseModel:
    """The body, or an APIError (400) naming the first field that is wrong and why."""
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object.")
    try:
        return body_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        # a union reports each branch it tried: name the field, not the branch
        field = next((p for p in loc if p in body_cls.model_fields), ".".join(loc)) if loc \
            else None
        where = ".".join(loc)
        if err["type"] == "extra_forbidden":
            message = (f"unknown field '{where}': this server takes OpenAI's completion fields "
                       f"and the depth fields ode_solver, ode_steps, exit_threshold, "
                       f"exit_criterion and draft (docs/serving.md).")
        elif err["type"] == "missing":
            message = f"the field '{where}' is required."
        else:
            message = f"'{where}': {err['msg']} (got {err.get('input')!r})."
        raise APIError(400, message, param=field) from None


@dataclasses.dataclass
class Limits:
    """What the server takes: ``max_context`` tokens of prompt and completion together,
    ``max_tokens`` new tokens at most (the default when a request says none is 16, as
    OpenAI's)."""

    max_context: int
    max_tokens: int


def encode(tokenizer, text: str, field: str = "prompt") -> list[int]:
    try:
        return tokenizer.encode(text)
    except ContinuumLMError as e:
        raise APIError(400, f"'{field}': {e}", field) from None


def prompts_of(body: CompletionBody, tokenizer, vocab_size: int) -> list[list[int]]:
    """The request's prompts as token ids (a string, strings, ids, or lists of ids)."""
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise APIError(400, "'prompt' is an empty list: give at least one prompt.", "prompt")
    out = []
    for item in p:
        if isinstance(item, str):
            ids = encode(tokenizer, item)
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"'prompt' holds token ids outside this model's vocabulary "
                                    f"of {vocab_size}: {bad[:5]}.", "prompt")
        if not ids:
            raise APIError(400, "'prompt' is empty: give at least one token of prompt (an "
                                "empty string encodes to no tokens).", "prompt")
        out.append(ids)
    return out


def check_depth(model, body: CompletionBody, default: Depth) -> Depth:
    """The request's depth (its fields over the server's default), refused with a 400 naming
    the field where the model cannot decode it with exact caches. Nothing on the model is
    changed (the engine's thread owns it)."""
    from ..model.exit import check_exit_solver
    from ..registry import SOLVERS

    cfg = model.config
    solver = body.ode_solver or default.solver
    steps = body.ode_steps or default.steps
    if cfg.depth != "ode":
        for name in ("ode_solver", "ode_steps", "exit_threshold", "exit_criterion"):
            if getattr(body, name) is not None:
                raise APIError(400, f"'{name}': this model is a discrete stack of "
                                    f"{cfg.num_layers} layers, with no solve to choose; drop "
                                    f"the field.", name)
        return Depth()
    if body.ode_solver is not None:
        if body.ode_solver not in SOLVERS:
            raise APIError(400, f"'ode_solver': unknown solver {body.ode_solver!r}; one of "
                                f"{', '.join(sorted(SOLVERS))}.", "ode_solver")
        if not _fixed_grid(body.ode_solver, cfg):
            raise APIError(400, f"'ode_solver': {body.ode_solver!r} chooses its own steps, "
                                f"and an adaptive solve cannot decode with exact caches; use "
                                f"a fixed-grid solver (euler, midpoint, heun, rk4, ...).",
                           "ode_solver")
        if (body.ode_solver == "rk2_gated") != (cfg.ode_solver == "rk2_gated"):
            raise APIError(400, f"'ode_solver': this model integrates with {cfg.ode_solver}, "
                                f"and rk2_gated has trained weights of its own: it can be "
                                f"neither swapped in nor out (ode_steps can change).",
                           "ode_solver")
    try:
        new = dataclasses.replace(cfg, ode_solver=solver, ode_steps=steps)
    except ContinuumLMError as e:
        raise APIError(400, f"'ode_steps': {e}", "ode_steps") from None
    exit_ = None
    if body.exit_threshold is not None or body.exit_criterion is not None:
        if body.exit_threshold is None:
            raise APIError(400, "'exit_criterion' needs 'exit_threshold' (per-token exit "
                                "stops a token's solve when its criterion falls below it).",
                           "exit_threshold")
        criterion = body.exit_criterion or "state"
        try:
            check_exit_solver(SOLVERS[solver](new), solver)
        except ValueError as e:
            raise APIError(400, f"'exit_threshold': {e}", "exit_threshold") from None
        if criterion == "gate" and getattr(model, "exit_gate", None) is None:
            raise APIError(400, "'exit_criterion': 'gate' reads the model's halting gate, and "
                                "this model has none (train one with model.exit_gate = true); "
                                "use 'state', 'kl' or 'confidence'.", "exit_criterion")
        exit_ = (criterion, float(body.exit_threshold))
    else:  # the server's (serve --exit-threshold), which suits every fixed-grid solve
        exit_ = default.exit
    return Depth(solver, steps, exit_)


def _fixed_grid(name: str, cfg) -> bool:
    """Whether the solver ``name`` steps on a fixed grid (what exact caches need); asked of
    a solver built for the config (a registered name may be a factory)."""
    from ..registry import SOLVERS

    try:
        solver = SOLVERS[name](dataclasses.replace(cfg, ode_solver=name))
    except (ContinuumLMError, ValueError):
        return False
    return bool(getattr(solver, "fixed_grid", True))


def draft_of(model, body: CompletionBody, prompts: list[list[int]]):
    """The request's :class:`~continuumlm.decoding.Draft`, or None; refused with a 400 where
    self-speculative decoding does not apply."""
    if body.draft is None:
        return None
    from ..decoding import Draft
    from ..registry import SOLVERS

    d = body.draft
    why = None
    if body.n != 1 or len(prompts) != 1:
        why = "self-speculative decoding serves one sequence per request: n = 1, one prompt"
    elif body.logprobs is not None:
        why = "a drafted stream has no per-token log-probabilities: drop 'logprobs'"
    elif body.exit_threshold is not None:
        why = "per-token exit and drafting do not combine: drop 'exit_threshold'"
    elif model.config.depth != "ode" and d.layers is None:
        why = (f"a discrete model drafts with its first layers: give draft.layers from 1 to "
               f"{model.config.num_layers - 1}")
    elif model.config.depth == "ode" and d.layers is not None:
        why = "an ODE model drafts with a coarser solve (draft.solver, draft.steps), not layers"
    elif model.config.depth != "ode" and not d.layers < model.config.num_layers:
        why = f"draft.layers must be below the model's {model.config.num_layers} layers"
    elif model.config.depth == "ode" and d.solver not in SOLVERS:
        why = f"unknown draft solver {d.solver!r}; one of {', '.join(sorted(SOLVERS))}"
    elif model.config.depth == "ode" and not _fixed_grid(d.solver, model.config):
        why = f"the draft solver {d.solver!r} is adaptive; a draft needs a fixed-grid solver"
    if why:
        raise APIError(400, f"'draft': {why}.", "draft")
    if model.config.depth == "ode":
        draft = Draft(d.solver, d.steps, d.tokens, confidence=d.confidence, pipeline=d.pipeline)
    else:
        draft = Draft(tokens=d.tokens, layers=d.layers, confidence=d.confidence,
                      pipeline=d.pipeline)
    if d.pipeline:
        import torch

        from ..decoding.pipeline import pipeline_refusal

        where = next(model.parameters()).device
        why = pipeline_refusal(model, draft, torch.tensor(prompts, device=where))
        if why:
            raise APIError(400, f"'draft.pipeline': {why}.", "draft")
    return draft


def sampling_of(body: CompletionBody) -> Sampling:
    if body.presence_penalty or body.frequency_penalty:
        name = "presence_penalty" if body.presence_penalty else "frequency_penalty"
        raise APIError(400, f"'{name}': penalties are not implemented; send 0 or leave it out.",
                       name)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "'best_of': only best_of = n (every sample returned) is served.",
                       "best_of")
    if not math.isfinite(body.temperature):
        raise APIError(400, "'temperature' must be a finite number >= 0.", "temperature")
    top_k = body.top_k if body.top_k and body.top_k > 0 else None
    top_p = body.top_p if body.top_p < 1 else None
    greedy = body.temperature == 0
    return Sampling(greedy=greedy, temperature=body.temperature if not greedy else 1.0,
                    top_k=top_k, top_p=top_p, seed=body.seed)


def stops_of(body: CompletionBody) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "'stop': up to 4 non-empty strings.", "stop")
    return stop


def check_lengths(prompts: list[list[int]], body: CompletionBody, limits: Limits) -> int:
    """The request's max_tokens, refused where prompt and completion exceed the context."""
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"'max_tokens' is {max_tokens}; this server generates at most "
                            f"{limits.max_tokens} tokens per request (serve --max-tokens).",
                       "max_tokens")
    longest = max(map(len, prompts))
    if longest > limits.max_context:
        raise APIError(400, f"'prompt' has {longest} tokens, more than this model's context "
                            f"of {limits.max_context}; shorten it (keep its last tokens).",
                       "prompt")
    if longest + max_tokens - 1 > limits.max_context:
        raise APIError(400, f"'max_tokens': the prompt ({longest} tokens) and {max_tokens} new "
                            f"tokens exceed this model's context of {limits.max_context}; ask "
                            f"for at most {limits.max_context - longest + 1}.", "max_tokens")
    return max_tokens
