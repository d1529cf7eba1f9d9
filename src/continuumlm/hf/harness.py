"""``continuumlm harness``: score a checkpoint with lm-evaluation-harness on its own corpus.

The checkpoint is exported (``export --format hf``) into a temporary folder, the split's text
is written as one document of a local JSON Lines dataset, and a rolling-loglikelihood task
(the harness's perplexity tasks: word perplexity, byte perplexity, bits per byte) over it is
run through ``lm_eval.simple_evaluate`` with ``--model hf`` and ``trust_remote_code`` (the
path a user of the harness's own command line takes). ``continuumlm eval`` is run on the same
tokens at the same context length beside it, so the two can be compared.

Word vocabularies: the split is scored as the text its ids decode to, rare words as
``<unk>`` (Penn Treebank's own practice), which encodes back to the same ids.

Windows: the harness scores every token, the first one given its end-of-text token, in
non-overlapping windows of ``max_length`` predictions (each later window reads the token before
its first prediction, and a last, shorter one reads back a full window); ``continuumlm eval``
scores every token but the first in non-overlapping windows plus one tail window. The two
differ by the first token and by where the windows start, so they agree closely, not exactly.
The exact check is :func:`harness_windows_nll`: our model scored on the harness's own windows,
which must give the harness's figure to float precision.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import torch

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def lm_eval_command(folder: Path, name: str, context: int, solver: dict) -> str:
    """The lm-eval command line that scores the exported model on the written task
    (``solver``: further model arguments, the solver options and the prefix token)."""
    extra = "".join(f",{k}={v}" for k, v in solver.items())
    return (f"lm_eval --model hf --model_args pretrained={folder / 'model'},"
            f"trust_remote_code=True,max_length={context},dtype=float32{extra} --tasks {name} "
            f"--include_path {folder / 'tasks'} --device cpu --batch_size 1")


def harness_windows(n: int, context: int) -> list[tuple[int, int, int]]:
    """lm-eval's rolling windows (``loglikelihood_rolling`` with ``context_len`` 1, as HFLM
    calls it) over ``n`` tokens for a model of ``context`` positions, as ``(start, length,
    scored)``: the window reads tokens ``start .. start + length - 1`` (start -1: the prefix
    token, then tokens ``0 .. length - 2``) and its last ``scored`` outputs are scored. Written
    here from that function's definition (lm_eval.utils.get_rolling_token_windows and
    make_disjoint_window, 0.4.x) so our own model can reproduce the harness's figure."""
    if n <= 0:
        return []
    first = min(context, n)
    out = [(-1, first, first)]
    done = first
    while done < n:
        scored = min(n - done, context)
        end = done + scored  # predicts tokens end - scored .. end - 1
        out.append((end - context - 1, context, scored))
        done = end
    return out


@torch.no_grad()
def harness_windows_nll(model, ids: list[int], context: int, prefix: int,
                        device: torch.device, batch_tokens: int = 8192) -> float:
    """Summed negative log-likelihood (nats) of ``ids`` under ``model``, scored on the
    harness's rolling windows (:func:`harness_windows`) with ``prefix`` before the first token."""
    model.eval()
    seq = torch.tensor([prefix] + list(ids), dtype=torch.long)  # seq[i + 1] is ids[i]
    windows = harness_windows(len(ids), context)
    total = 0.0
    by_length: dict[int, list[tuple[int, int]]] = {}
    for start, length, scored in windows:
        by_length.setdefault(length, []).append((start + 1, scored))
    # an adaptive solver's steps depend on the whole batch: one window at a time, as the
    # harness runs it (batch_size 1)
    adaptive = not getattr(model.depth, "exact_cache", True)
    for length, group in by_length.items():
        per = 1 if adaptive else max(1, batch_tokens // length)
        for i in range(0, len(group), per):
            part = group[i:i + per]
            x = torch.stack([seq[a:a + length] for a, _ in part]).to(device)
            y = torch.stack([seq[a + 1:a + length + 1] for a, _ in part]).to(device)
            logp = torch.log_softmax(model(x)[0].float(), -1).gather(-1, y[..., None])[..., 0]
            for row, (_, scored) in zip(logp, part):
                total -= row[length - scored:].double().sum().item()
    return total


class _WindowProgress:
    """One progress report for the task's windows: a bar at a terminal, else a line at every
    tenth of them (a log, CI)."""

    def __init__(self, total: int, name: str):
        import sys

        from tqdm import tqdm

        self.total, self.name, self.done, self.said = total, name, 0, 0
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=f"lm-eval {name}", unit="window", disable=not self.tty)

    def update(self, n: int) -> None:
        import sys

        self.done += n
        self.bar.update(n)
        tenth = self.done * 10 // max(self.total, 1)
        if not self.tty and tenth > self.said:
            self.said = tenth
            print(f"lm-eval {self.name}: {self.done:,} of {self.total:,} windows scored",
                  file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def _harness_model(args: dict, device: str, progress: _WindowProgress):
    """What lm-eval's ``--model hf`` makes of ``args`` (its own HFLM, built the way
    simple_evaluate builds it, batch size 1), with its progress reported once for the task:
    HFLM opens a progress bar for every batch of rolling windows (about 2,000 for a
    Shakespeare split), which lm-eval has no option to turn off. The tokenizer's warning that
    the document is longer than the model's context is silenced too: the rolling windows cut
    the document to the context on purpose."""
    from lm_eval.models.huggingface import HFLM

    class ScoredOnce(HFLM):
        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                                  override_bs: int | None = None):
            out = super()._loglikelihood_tokens(requests, disable_tqdm=True,
                                                override_bs=override_bs)
            progress.update(len(requests))
            return out

    lm = ScoredOnce.create_from_arg_obj(args, {"batch_size": 1, "device": device})
    # transformers warns once per tokenizer, and marks it warned in this table
    lm.tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return lm


def run_harness(checkpoint, which: str = "best", split: str = "val", context: int | None = None,
                ode_solver: str | None = None, ode_steps: int | None = None,
                max_tokens: int | None = None, device: str = "cpu",
                keep: str | Path | None = None) -> dict:
    """``keep``: write the exported model, the data and the task there (a new folder) and
    keep them, so lm-eval's own command line (returned as ``lm_eval_command``) can be run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from ..data import eval_window_starts, prepare_data
    from ..errors import CheckpointError, DataError
    from ..eval.perplexity import context_support, evaluate_contexts
    from ..runs import load_model_and_tokenizer
    from ..runs.checkpoint import load_run_config
    from .export import export_hf, hf_tokenizer, text_start

    # on the device our own evaluation below runs on
    model, tok, ckpt = load_model_and_tokenizer(checkpoint, which, map_location=device)
    run = load_run_config(ckpt)
    data = prepare_data(run.data, tok)
    if split not in data.splits:
        raise DataError(f"--split {split}: this corpus has the splits "
                        f"{', '.join(s for s in data.splits if s != 'train')}.")
    ids = [int(i) for i in data.splits[split][:max_tokens]]
    # a char vocabulary's <unk> stands for characters the text has and the vocabulary lacks:
    # no text spells it. A word vocabulary's <unk> is a word of the text it decodes to (PTB's
    # own files hold it), which encodes back to the same id: that text is what is scored.
    if tok.kind == "char" and getattr(tok, "unk_id", None) is not None and tok.unk_id in ids:
        raise DataError(f"the {split} split holds {ids.count(tok.unk_id):,} <unk> tokens "
                        f"(characters the training text lacks): the harness scores text, and "
                        f"<unk> stands for no character of it. Score this split with "
                        f"`continuumlm eval`.")
    converted = hf_tokenizer(tok)
    text = tok.decode(ids)
    for _ in range(4):  # --max-tokens may cut a multi-byte character: drop its first bytes
        if converted.encode(text).ids == ids or len(ids) < 2:
            break
        ids = ids[:-1]
        text = tok.decode(ids)
    if converted.encode(text).ids != ids:
        raise CheckpointError(f"the {split} split's text does not re-encode to the same tokens "
                              f"through the exported tokenizer; the harness would score other "
                              f"tokens than continuumlm eval.")
    context = context or run.train.seq_len
    solver = {k: v for k, v in (("ode_solver", ode_solver), ("ode_steps", ode_steps)) if v}
    # what would stop our own evaluation is refused before the (long) lm-eval run
    reason = context_support(model, context)
    if reason is None and not len(eval_window_starts(len(ids), context)):
        reason = (f"the scored text has {len(ids)} tokens, and a window needs more than the "
                  f"context")
    if reason is not None:
        raise DataError(f"--context {context}: {reason}. Score a longer text (raise --max-tokens "
                        f"or leave it out) or a shorter --context.")
    with tempfile.TemporaryDirectory(prefix="continuumlm-harness-") as scratch:
        tmp = Path(keep) if keep else Path(scratch)
        export_hf(model, tok, tmp / "model")  # as trained; lm-eval applies the solver options
        if solver:  # ours, now: a solver the model cannot take stops here, not after lm-eval
            model.set_solver(ode_solver, ode_steps, ode_grad="direct")
        (tmp / "data.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
        data_file = (tmp / "data.jsonl").resolve()
        name = f"continuumlm_{split}"
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / f"{name}.yaml").write_text(TASK.format(name=name, data=data_file))
        _, prefix = text_start(tok)  # HFLM's prefix: the exported bos token, named
        given = {**solver, **({"prefix_token_id": prefix} if prefix is not None else {})}
        command = lm_eval_command(tmp, name, context, given)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        args = {"pretrained": str(tmp / "model"), "trust_remote_code": True,
                "max_length": context, "dtype": "float32", **given}
        with _WindowProgress(len(harness_windows(len(ids), context)), name) as progress:
            lm = _harness_model(args, device, progress)
            out = lm_eval.simple_evaluate(model=lm, tasks=[name], task_manager=TaskManager(
                include_path=str(tmp / "tasks")), log_samples=False)
        harness = {k.split(",")[0]: v for k, v in out["results"][name].items()
                   if k.split(",")[0] in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
    [row] = evaluate_contexts(model, torch.tensor(ids), [context], tok.kind == "char",
                              torch.device(device))
    nfe = model.last_nfe  # before the exact check's forwards (an adaptive solve varies)
    n_bytes = len(text.encode("utf-8"))
    ours_bpb = row["loss"] * row["tokens"] / math.log(2) / n_bytes
    exact_bpb = harness_windows_nll(model, ids, context, prefix, torch.device(device)) / (
        math.log(2) * n_bytes)
    return {"checkpoint": str(ckpt), "split": split, "context": context, "tokens": len(ids),
            "bytes": n_bytes, "nfe": nfe, **solver,
            "harness": harness, "ours": {"loss": row["loss"], "bits_per_byte": ours_bpb,
                                         "targets": row["tokens"]},
            "bits_per_byte_ratio": harness["bits_per_byte"] / ours_bpb,
            # our model on the harness's own windows: equal to float precision, or the adapter
            # (export, tokenizer, solver options) scores something other than our model does
            "ours_on_harness_windows": {"bits_per_byte": exact_bpb},
            "harness_windows_ratio": harness["bits_per_byte"] / exact_bpb,
            **({"lm_eval_command": command} if keep else {})}
