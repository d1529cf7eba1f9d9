"""A request as the engine serves it: its depth and sampling, the events its sink receives,
and each of its rows (one sequence being generated: its choice, its generator, its text)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..decoding.sampling import sample_next
from .text import TextOut


@dataclass(frozen=True)
class Depth:
    """How a row's tokens are solved; rows of one depth share a batch. ``solver``/``steps``:
    the ODE solve (None for a discrete model); ``exit``: (criterion, threshold) of per-token
    exit, or None."""

    solver: str | None = None
    steps: int | None = None
    exit: tuple[str, float] | None = None

    def describe(self) -> str:
        text = f"{self.solver} x {self.steps}" if self.solver else "discrete"
        if self.exit:
            text += f", exit {self.exit[0]} < {self.exit[1]:g}"
        return text


@dataclass
class Sampling:
    """A row's token choice: greedy (argmax), or a draw from its own generator."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def generator(self, index: int, device) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:  # choice i of a request draws as a request with seed + i alone
            g.manual_seed((self.seed + index) % 2**64)
        return g


@dataclass
class Event:
    """What a request's sink receives. ``kind``: "token" (a generated token: ``token``, its
    ``text`` delta, ``logprob`` and ``top`` when asked), "prompt" (echo: the prompt's tokens,
    their log-probabilities when asked), "done" (``finish_reason``, ``nfe``: field
    evaluations the row's tokens took), or "error" (``message``)."""

    kind: str
    index: int = 0
    token: int | None = None
    text: str = ""
    logprob: float | None = None
    top: dict | None = None
    finish_reason: str | None = None
    nfe: int = 0
    tokens: list | None = None
    logprobs: list | None = None
    message: str = ""
    count: int = 0  # "done": the tokens the row produced (an end-of-text token included)


@dataclass
class Request:
    """One request: ``prompts`` (token ids each), ``n`` rows per prompt (choice index =
    prompt * n + j), decoded with ``depth``; ``sink(event)`` is called from the engine's
    thread. ``draft``: a :class:`continuumlm.decoding.Draft` (self-speculative; one row)."""

    prompts: list[list[int]]
    max_tokens: int
    sink: Callable[[Event], None]
    depth: Depth = Depth()
    sampling: Sampling = field(default_factory=Sampling)
    n: int = 1
    stop: list[str] = field(default_factory=list)
    eos_id: int | None = None
    logprobs: int | None = None
    echo: bool = False
    draft: object | None = None
    cancelled: bool = False

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def cancel(self) -> None:
        """Free the request's rows at the next token (a client that went away)."""
        self.cancelled = True


class Row:
    """One sequence being generated: its request, its choice index, what it has produced."""

    def __init__(self, request: Request, index: int, tokenizer, device) -> None:
        self.request, self.index = request, index
        self.generator = request.sampling.generator(index % request.n, device)
        self.out = TextOut(tokenizer, request.stop)
        self.count = 0  # tokens produced
        self.nfe = 0
        self.pending: int | None = None  # the latest token, which no state holds yet
        self.done = False

    @property
    def alive(self) -> bool:
        return not self.done and not self.request.cancelled

    def choose(self, logits: torch.Tensor) -> int:
        s = self.request.sampling
        return int(sample_next(logits[None], s.temperature, s.top_k, s.top_p, s.greedy,
                               self.generator)[0])

    def take(self, token: int, logits: torch.Tensor | None, nfe: int) -> None:
        """Hand the row's next token to its request; finish the row when it is its last."""
        req = self.request
        self.count += 1
        self.nfe += nfe
        if req.eos_id is not None and token == req.eos_id:
            self.finish("stop")
            return
        text, stopped = self.out.add(token)
        logprob = top = None
        if req.logprobs is not None and logits is not None:
            logprob, top = token_logprobs(logits, token, req.logprobs)
        req.sink(Event("token", self.index, token=token, text=text, logprob=logprob, top=top))
        if stopped:
            self.finish("stop")
        elif self.count >= req.max_tokens:
            self.finish("length")
        else:
            self.pending = token

    def finish(self, reason: str) -> None:
        rest = self.out.flush()
        if rest:
            self.request.sink(Event("token", self.index, text=rest))
        self.done = True
        self.request.sink(Event("done", self.index, finish_reason=reason, nfe=self.nfe,
                                count=self.count))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, dict[int, float]]:
    """The token's log-probability under the model's distribution (the raw logits' log
    softmax, before temperature and filtering) and the ``k`` most probable tokens'."""
    lp = torch.log_softmax(logits.double(), -1)
    top = {}
    if k:
        values, ids = lp.topk(min(k, lp.shape[-1]))
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return float(lp[token]), top


def prompt_logprobs(logits: torch.Tensor | None, prompt: list[int], k: int | None):
    """Echo's log-probabilities of the prompt's tokens, each given the ones before it (the
    first has none: None), with the ``k`` most probable at each position; None when not
    asked."""
    if logits is None:
        return None
    out = [(None, None)]
    for i, token in itertools.islice(enumerate(prompt), 1, None):
        out.append(token_logprobs(logits[i - 1], token, k or 0))
    return out
