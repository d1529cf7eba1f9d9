"""Cross-entropy, perplexity and bits per character at several context lengths."""

from __future__ import annotations

import contextlib
import math

import torch

from ..data import eval_batches, eval_window_starts


def loss_sum(model, batches, device: torch.device, amp=None,
             token_nfe: list | None = None) -> tuple[float, int]:
    """(summed cross-entropy, number of scored targets) over (inputs, targets) batches; targets
    of -1 (the tail window's already-scored ones, see eval_batches) are not counted. With
    ``token_nfe`` (a list), the field evaluations of the scored tokens are added to its one
    element when the model reports them per token (per-token exit)."""
    total, count = 0.0, 0
    for x, y in batches:
        with amp or contextlib.nullcontext():
            _, loss = model(x.to(device), y.to(device))
        scored = y >= 0
        n = int(scored.sum())
        total += loss.item() * n
        count += n
        per_token = getattr(model, "last_token_nfe", None)
        if token_nfe is not None and per_token is not None:
            token_nfe[0] += int(per_token.cpu()[scored].sum())
    return total, count


def context_support(model, context: int) -> str | None:
    """None if the model can read windows of ``context`` tokens, else the reason it cannot."""
    cfg = model.config
    if cfg.position == "learned" and context > cfg.max_seq_len:
        return f"learned positions cover {cfg.max_seq_len} tokens"
    return None


@torch.no_grad()
def evaluate_contexts(model, data: torch.Tensor, contexts: list[int], char_level: bool,
                      device: torch.device, batch_tokens: int = 16384,
                      max_windows: int | None = None) -> list[dict]:
    """One row per context length: loss (nats/token), ppl, bpc (char level), windows, tokens."""
    model.eval()
    rows = []
    for L in contexts:
        reason = context_support(model, L)
        n_windows = len(eval_window_starts(len(data), L, max_windows))
        if reason is None and n_windows == 0:
            reason = f"the split has only {len(data)} tokens"
        if reason is not None:
            rows.append({"context": L, "unsupported": reason})
            continue
        token_nfe = [0]
        total, count = loss_sum(
            model, eval_batches(data, L, max(1, batch_tokens // L), max_windows), device,
            token_nfe=token_nfe)
        loss = total / count
        row = {"context": L, "loss": loss, "ppl": math.exp(min(loss, 50.0)),
               "windows": n_windows, "tokens": count}
        if getattr(model, "last_token_nfe", None) is not None:  # per-token exit
            row["nfe_per_token"] = token_nfe[0] / count
        if char_level:
            row["bpc"] = loss / math.log(2)
        rows.append(row)
    return rows
