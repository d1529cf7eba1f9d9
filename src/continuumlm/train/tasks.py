"""What the trainer trains on: a task supplies the data (a batch sampler with a resumable
state), the objective, the evaluation and what it records. The trainer owns everything else
(optimizer, schedule, AMP, DDP/FSDP, bad-step handling, checkpoints, signals, metrics).

:class:`LanguageModelingTask` is next-token prediction on a corpus (``continuumlm train``);
MQAR (``continuumlm mqar``) is the other built-in task, in :mod:`continuumlm.train.mqar`.
A task has:

- ``name``; ``tokenizer`` (saved with checkpoints, or None when the task has no text);
- ``seq_len``: tokens in each sequence a batch row holds (what tokens/s counts);
- ``sampler(t, dist)``: an object with ``next(micro_step) -> (x, y)``, ``state_dict()`` and
  ``load_state_dict(state)``; ``merge_sampler_states(states)`` turns the per-rank states into
  the one a checkpoint keeps (every rank finds its own part in it on resume);
- ``evaluator(t, device, amp, dist, fsdp)``: ``due(step)`` and ``__call__(model) ->``
  :class:`Evaluation`;
- ``forward(fn, x, y) -> (logits, loss)``: the objective through ``fn`` (the wrapped, maybe
  compiled model; the logits are the ones an elastic run's consistency term compares);
- ``state() -> dict`` (kept in the trainer state under ``"task"``) and ``trainer_state()``
  (top-level entries of the trainer state: the corpus fingerprint);
- ``on_evaluation(trainer, evaluation)`` (every rank, before the step's checkpoint),
  ``record(trainer)`` (rank 0, after it) and ``on_end(trainer, summary)`` (rank 0);
- ``checkpoint_each_evaluation``: save a checkpoint after every evaluation, not only after one
  that improved on the best (a task whose evaluation decides when to stop).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..data import (
    BatchSampler,
    Dataset,
    changed_splits,
    corpus_name,
    load_tokenizer,
    prepare_data,
)
from ..errors import ConfigError, DataError
from .evaluation import Evaluator


@dataclass
class Evaluation:
    """One evaluation: ``score`` (lower is better: what best_val and the ``best`` checkpoint
    track), the ``fields`` logged to metrics.jsonl, the ``text`` of the progress line, and
    ``stop``: the task's target is reached, the run ends here."""

    score: float
    fields: dict = field(default_factory=dict)
    text: str = ""
    stop: bool = False


class LossEvaluator(Evaluator):
    """The validation loss (and perplexity) as an :class:`Evaluation`."""

    def __call__(self, model) -> Evaluation:
        loss = super().__call__(model)
        ppl = math.exp(min(loss, 50.0))
        return Evaluation(loss, {"val_loss": loss, "val_ppl": ppl},
                          f"val loss {loss:.4f} (ppl {ppl:.2f})")


class LanguageModelingTask:
    """Next-token prediction on ``[data]``'s corpus: random windows of the train split, the
    loss over fixed windows of the val split."""

    name = "lm"
    checkpoint_each_evaluation = False

    def __init__(self, cfg: RunConfig, out: Path, resumed_from: Path | None = None,
                 state: dict | None = None, tokenizer=None):
        """Prepares (or reads) the corpus, fills in ``cfg.model.vocab_size`` from the tokenizer
        and checks that a resumed run reads the text it was trained on."""
        t = cfg.train
        self.seq_len = cfg.train.seq_len
        self.data: Dataset = prepare_data(cfg.data, tokenizer)
        self.tokenizer = self.data.tokenizer
        vocab = self.tokenizer.vocab_size
        if cfg.model.vocab_size == 0:
            cfg.model = dataclasses.replace(cfg.model, vocab_size=vocab)
        elif cfg.model.vocab_size != vocab:
            raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} but the tokenizer has "
                              f"{vocab} tokens; leave model.vocab_size at 0 to take it from the "
                              f"tokenizer (cap word/bpe vocabularies with data.vocab_size).")
        # training reads the train and val splits only (a changed test split is eval's concern)
        changed = [n for n in changed_splits(state.get("data") if state else None, self.data)
                   if n in ("train", "val")]
        if changed:
            raise DataError(
                f"--resume: the text of the {' and '.join(changed)} split"
                f"{'s' if len(changed) > 1 else ''} differs from the one the run in {out} "
                f"was trained on (sha256 recorded in "
                f"{resumed_from / 'trainer_state.pt'}); {corpus_name(cfg.data)} was changed "
                f"since. A resumed run must read the same text: restore it, or start a new run "
                f"in another --out.")
        for split in ("train", "val"):
            n = len(self.data.splits[split])
            if n < t.seq_len + 1:
                raise DataError(f"the {split} split has {n} tokens, fewer than one window of "
                                f"train.seq_len + 1 = {t.seq_len + 1}; use a longer corpus or a "
                                f"shorter train.seq_len.")

    def sampler(self, t, dist) -> BatchSampler:
        streams = range(dist.rank * t.grad_accum, (dist.rank + 1) * t.grad_accum)
        return BatchSampler(self.data.splits["train"], t.batch_size, t.seq_len, t.seed, streams)

    @staticmethod
    def merge_sampler_states(states: list[dict]) -> dict:
        """Every rank's batch streams, each under its own number."""
        return {"streams": {m: g for s in states for m, g in s["streams"].items()}}

    def evaluator(self, t, device, amp, dist, fsdp) -> LossEvaluator:
        return LossEvaluator(self.data.splits["val"], t, device, amp, dist, fsdp)

    @staticmethod
    def forward(fn, x, y):
        return fn(x, y)

    def state(self) -> dict:
        return {}

    def trainer_state(self) -> dict:
        """What the trainer state records about the data (top-level keys, as before tasks)."""
        return {"data": self.data.fingerprint,
                "prepared_meta_sha256": self.data.meta_digest}  # the meta.json the run read

    def on_evaluation(self, trainer, evaluation: Evaluation) -> None:
        pass

    def record(self, trainer) -> None:
        pass

    def on_end(self, trainer, summary: dict) -> None:
        pass


def language_modeling(cfg: RunConfig, out: Path, resumed_from: Path | None,
                      state: dict | None) -> LanguageModelingTask:
    """The default task: next-token prediction on ``[data]``'s corpus (a resumed run reads its
    own tokenizer)."""
    tokenizer = load_tokenizer(resumed_from) if resumed_from else None
    return LanguageModelingTask(cfg, out, resumed_from, state, tokenizer)


language_modeling.name = LanguageModelingTask.name
