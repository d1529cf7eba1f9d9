"""What self-speculative decoding is asked to do (:class:`Draft`) and what it reports having
done (:class:`DraftStats`); the loop itself is speculative.py."""

from __future__ import annotations

from dataclasses import dataclass, field

AUTO = "auto"
MAX_AUTO_TOKENS = 16


@dataclass(frozen=True)
class Draft:
    """How to draft: an ODE model's same weights integrated with ``solver`` x ``steps`` (any
    fixed-grid solver); a discrete model's first ``layers`` layers through its own final norm
    and head (LayerSkip's early exit). ``tokens`` proposals per verification (a number, or
    ``"auto"``: start at 4, one more after a round that kept every draft, one fewer after a
    round that kept under half, between 1 and 16). ``reuse`` (layer drafts, eager): the draft
    and the verifier share the first layers' caches, and the verifying pass goes on from the
    states the drafts made there (LayerSkip's cache reuse: those layers see each drafted token
    once); False: the verifier runs every layer over the drafted tokens again. ``lean``
    (eager): the draft solve runs as :class:`.lean_draft.LeanDraft`'s step, written out op
    by op with caches of its own, where it covers the model, and layer drafts that reuse the
    caches through the stack's lean step (:class:`.lean_stack.LeanStack`), verified there too
    (the stream's stats say which, and why not); False: through the decoding pass always.
    ``confidence``
    (a probability in (0, 1)): a round stops drafting after the first draft the draft itself
    gives less than this probability (the softmax of its logits when greedy, its processed
    distribution when sampling), so ``tokens`` becomes the most per round: drafts likely to be
    refused are not paid for. Which drafts are proposed never changes what is decoded (the
    drafting rule reads only the draft's own distributions, before the model's pass).
    ``pipeline`` (eager, CPU, Linux): the drafts are made ahead by a process of their own,
    on a second core, while the model's own solve verifies (:mod:`.pipeline`); the same
    greedy tokens, the same distribution when sampling; a fixed ``tokens`` and no
    ``confidence``."""

    solver: str = "euler"
    steps: int = 1
    tokens: int | str = 4
    layers: int | None = None
    reuse: bool = True
    lean: bool = True
    confidence: float | None = None
    pipeline: bool = False

    def __post_init__(self) -> None:
        if self.tokens != AUTO and (isinstance(self.tokens, bool) or not isinstance(
                self.tokens, int) or self.tokens < 1):
            raise ValueError(f"Draft(tokens={self.tokens!r}): give a positive number of drafted "
                             f"tokens per verification, or 'auto'.")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"Draft(steps={self.steps!r}): give a positive number of steps.")
        if self.layers is not None and (isinstance(self.layers, bool) or not isinstance(
                self.layers, int) or self.layers < 1):
            raise ValueError(f"Draft(layers={self.layers!r}): give a positive number of "
                             f"layers.")
        c = self.confidence
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not 0 < c < 1):
            raise ValueError(f"Draft(confidence={c!r}): give a probability between 0 and 1 "
                             f"(exclusive), below which a round stops drafting, or None.")
        for name in ("reuse", "lean", "pipeline"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Draft({name}={getattr(self, name)!r}): give True or False.")


@dataclass
class DraftStats:
    """What a speculative stream did: verification passes, drafted and kept tokens, field
    evaluations (draft and verify together) and the time it ran."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    nfe: int = 0
    seconds: float = 0.0
    kept_per_round: list[int] = field(default_factory=list)
    drafted_by: str = ""
    """How the drafts were made: "lean step" (:mod:`.lean_draft`), "decoding pass" (and why
    not the lean step), "first layers" (through the decoding pass), or "first layers, lean
    step" (:mod:`.lean_stack`)."""
    verified_by: str = ""
    """How the model's own solve ran (the prompt and each verification): "lean step" or
    "decoding pass" (and why not the lean step)."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def report(self) -> str:
        per = self.tokens / self.rounds if self.rounds else float("nan")
        return (f"speculative: {self.acceptance:.0%} of {self.drafted} drafted tokens kept, "
                f"{per:.2f} tokens per verification, "
                f"{self.nfe / max(self.tokens, 1):.1f} field evaluations per token"
                + (f"; drafts by {self.drafted_by}" if self.drafted_by else "")
                + (f"; verified by {self.verified_by}" if self.verified_by else ""))
