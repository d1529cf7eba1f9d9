"""Metrics: one JSON object per event in ``metrics.jsonl`` and the same scalars in TensorBoard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..errors import DiskError
from ..runs.folder import METRICS, TENSORBOARD, disk_error, read_metrics  # noqa: F401 - read_metrics: public here too

EVAL_KEYS = ("val_loss", "accuracy")  # an event holding one of these is an evaluation


def is_evaluation(event: dict) -> bool:
    return any(k in event for k in EVAL_KEYS)


class MetricsLogger:
    def __init__(self, run_dir: Path, resume_step: int | None = None, tensorboard: bool = True,
                 keep_resume_evaluation: bool = False, task: str = "lm"):
        """``keep_resume_evaluation``: the resumed run will not evaluate again at its first
        step (MQAR saves after its evaluations; a run extended past a final step that is not a
        multiple of eval_interval), so an evaluation already logged at that step is kept."""
        self.path = run_dir / METRICS
        self.task = task  # for the command that continues the run, in a disk error
        self.keep_resume_evaluation = keep_resume_evaluation
        kept_at_resume: list[dict] = []
        try:
            if resume_step is not None and self.path.exists():
                kept_at_resume = self._truncate(resume_step)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise self._disk_error("metrics.jsonl", self.path, e) from None
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides every TensorBoard event at or after the resume step; the events
            # metrics.jsonl keeps at that step (its training update, an evaluation not redone)
            # are written again so that both records agree
            try:
                self.tb = SummaryWriter(str(run_dir / TENSORBOARD), purge_step=resume_step)
            except OSError as e:
                raise self._disk_error("TensorBoard events", run_dir / TENSORBOARD, e) from None
            for event in kept_at_resume:
                self._scalars(event)

    def _truncate(self, step: int) -> list[dict]:
        """Drop events a resumed run will produce again: updates after ``step`` and
        evaluations at or after it (they ran after the checkpoint was written), unless that
        step's evaluation is not to be repeated. Returns the events kept at ``step``."""
        kept, at_step = [], []
        for line in self.path.read_bytes().decode("utf-8", errors="replace").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            s = ev.get("step", 0) if isinstance(ev, dict) else None
            if not isinstance(s, (int, float)):
                continue  # not an event of ours
            if s < step or (s == step and (self.keep_resume_evaluation or not is_evaluation(ev))):
                kept.append(line)
                if s == step:
                    at_step.append(ev)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        tmp.replace(self.path)
        return at_step

    def log(self, event: dict) -> None:
        try:
            self.file.write(json.dumps(event) + "\n")
            self.file.flush()
        except OSError as e:
            raise self._disk_error("metrics.jsonl", self.path, e) from None
        if self.tb is not None:
            self._scalars(event)

    def _disk_error(self, what: str, where: Path, e: OSError) -> DiskError:
        return disk_error(what, where, e, self.path.parent, task=self.task)

    def _scalars(self, event: dict) -> None:
        step = event["step"]
        try:  # TensorBoard writes in a thread of its own and raises its error on a later call
            for k, v in event.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    kind = "val/" if k.startswith("val") or k in EVAL_KEYS else "train/"
                    self.tb.add_scalar(kind + k, v, step)
        except OSError as e:
            raise self._disk_error("TensorBoard events", self.path.parent / TENSORBOARD, e) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError as e:
            raise self._disk_error("metrics.jsonl", self.path, e) from None
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                raise self._disk_error("TensorBoard events", self.path.parent / TENSORBOARD, e) from None


class ProgressLines:
    """Progress as a line every ``every_s`` seconds (step, loss, tokens/s, threads, time left),
    for output that is not a terminal, where the progress bar is off. Fed at each logged step,
    so a line's figures are those of the latest log interval."""

    def __init__(self, max_steps: int, step: int, every_s: float = 10.0):
        self.max_steps, self.every_s = max_steps, every_s
        self.start, self.first_step = time.perf_counter(), step
        self.last = self.start

    def update(self, step: int, loss: float, tokens_per_s: float, threads: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s and step < self.max_steps:
            return
        self.last = now
        done = step - self.first_step
        left = (now - self.start) / max(done, 1) * (self.max_steps - step)
        print(f"step {step}/{self.max_steps}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s, "
              f"{threads} thread{'s' * (threads != 1)}, {_duration(left)} left", flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class NullLogger:
    """What ranks other than 0 log to: nothing."""

    def log(self, event: dict) -> None:
        pass

    def close(self) -> None:
        pass
