"""Distillation from a trained model (``train.distill.teacher``, ``train.distill.weight``).

The teacher is a checkpoint of this package (any depth, mixer or solver), loaded once, frozen
and kept in eval mode; each micro-batch adds ``weight * KL(teacher || model)`` of the
next-token distributions to the objective. The teacher must read the same tokens as the run
(its tokenizer is compared with the run's), and its weights' SHA-256 is saved in the trainer
state: a resume refuses a teacher whose weights changed, so a resumed run is the run it
continues. For elastic depth this is the alternative to the consistency term: every drawn
solve is pulled toward one fixed solution (e.g. a model trained at RK4 x 4) instead of toward
a finer solve of the same, still moving, field.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.corpora import sha256_file
from ..errors import CheckpointError, ConfigError


class Teacher:
    """The frozen teacher of a distilling run, or nothing (``enabled`` False)."""

    def __init__(self, t, tokenizer, device: torch.device, state: dict | None):
        self.weight = float(t.distill.weight)
        self.enabled = t.distill.teacher is not None
        self.model = None
        self.digest: str | None = None
        if not self.enabled:
            return
        from ..data.tokenizers import tokenizer_json
        from ..runs.checkpoint import WEIGHTS_FILE, load_model_and_tokenizer

        where = t.distill.teacher
        if tokenizer is None:
            raise ConfigError(f"train.distill.teacher = {where!r}: this task has no tokenizer "
                              f"(MQAR reads integer ids), and a teacher is matched to the run "
                              f"by its tokenizer; distill language-modeling runs only.")
        try:
            model, tok, ckpt = load_model_and_tokenizer(where, "last", map_location="cpu")
        except (CheckpointError, FileNotFoundError, OSError) as e:
            raise ConfigError(f"train.distill.teacher = {where!r} cannot be loaded as the teacher "
                              f"(a trained run folder, whose last checkpoint is used, or a "
                              f"checkpoint folder): {e}") from None
        if tokenizer_json(tok) != tokenizer_json(tokenizer):
            raise ConfigError(f"train.distill.teacher = {where!r}: the teacher's tokenizer "
                              f"({tok.vocab_size} tokens) is not this run's ("
                              f"{tokenizer.vocab_size} tokens); a teacher must have been trained "
                              f"on the same prepared data, so both read the same tokens.")
        self.digest = sha256_file(Path(ckpt) / WEIGHTS_FILE)
        saved = (state or {}).get("distill_teacher_sha256")
        if saved is not None and saved != self.digest:  # (a run may start distilling on resume)
            raise ConfigError(f"--resume: the teacher train.distill.teacher = {where!r} is not "
                              f"the "
                              f"one this run was distilling from (weights SHA-256 "
                              f"{self.digest[:12]}, the run recorded {str(saved)[:12]}); a "
                              f"resumed run would not be the run it continues. Restore that "
                              f"teacher, or start a new run.")
        model.to(device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model

    def target(self, task, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The teacher's next-token log-probabilities on the batch (the positions and shape of
        the task's logits), without gradients."""
        with torch.no_grad():
            logits = task.forward(self.model, x, y)[0]
        return F.log_softmax(logits.float(), -1)

    def state(self) -> dict:
        return {"distill_teacher_sha256": self.digest} if self.enabled else {}
