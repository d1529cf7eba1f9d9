"""The generation loop: a model's tokens one at a time over a decoding state (cached), or
over the whole context (recomputed), and the hold a stream keeps on the model while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ..model.cache import DecodeState
from ..threads import ThreadPolicy
from .lean import own_step
from .sampling import _whole, check_sampling_args, sample_next


def check_request(model, idx: torch.Tensor, max_new_tokens: int, temperature: float,
                  top_k: int | None, top_p: float | None, greedy: bool) -> None:
    """Refuse a generation request that cannot be served, naming what to change."""
    cfg = model.config
    if cfg.mode != "decoder":
        raise ValueError("generation needs mode = 'decoder'; this model is an encoder.")
    check_sampling_args(temperature, top_k, top_p, greedy)
    if isinstance(max_new_tokens, bool) or not _whole(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}.")
    if idx.dim() != 2 or idx.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token, shaped (batch, length).")
    if cfg.position == "learned" and idx.shape[1] > cfg.max_seq_len:
        raise ValueError(
            f"the prompt has {idx.shape[1]} tokens, more than max_seq_len = {cfg.max_seq_len} "
            f"of this model's learned positions; shorten it to at most {cfg.max_seq_len} "
            f"tokens (its last ones), or use a RoPE model.")
    if cfg.position == "learned" and idx.shape[1] + max_new_tokens - 1 > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({idx.shape[1]} tokens) plus {max_new_tokens} new tokens exceeds "
            f"max_seq_len = {cfg.max_seq_len} of this model's learned positions; ask for at most "
            f"{max(cfg.max_seq_len - idx.shape[1] + 1, 0)} new tokens or use a RoPE model.")


# inference mode, not only no_grad: no version counters or view tracking on the dozens of
# small tensors each field evaluation makes (about 15% of an eager decoded token on CPU); the
# caches are the stream's own, and what it yields is made an ordinary tensor (plain)
@torch.inference_mode()
def token_stream(model, idx: torch.Tensor, max_new_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, greedy: bool, use_cache: bool,
                 generator: torch.Generator | None, eos_token_id: int | None,
                 freeze: Callable[[DecodeState], Callable] | None = None,
                 threads: ThreadPolicy | None = None, lean: bool = False,
                 said: Callable[[str], None] | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token ids (B,) one step at a time. With the cache, the prompt is
    consumed in one pass (``model.step``) and each token after it is a one-token step:
    ``model.step`` again, or, when ``freeze`` is given, the frozen step it returns for the
    state (``freeze(state) -> fn(ids, state) -> logits``; see :mod:`.frozen`), or, with
    ``lean`` (eager, batch 1, on the CPU), the lean step of the model's own solve
    (lean.own_step: ODE blocks or a discrete stack) where it covers the model (caches of its
    own; ``said`` is told which ran: "lean step", or "decoding pass" and why not)."""
    with streaming(model, threads):
        seq = idx
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        # the own solve's lean step, or None
        step, how = own_step(model, idx, lean, freeze is not None, use_cache)
        # the solve its caches were built with (the decoding pass's state checks the same)
        solve = (model.config.ode_solver, model.config.ode_steps)
        if said is not None:
            said(how)
        state = model.init_state(idx.shape[0]) if use_cache and step is None else None
        logits = (step.logits(idx[0].tolist())[None] if step is not None else
                  model.step(idx, state)[0] if use_cache else None)
        token_fn = freeze(state) if use_cache and freeze is not None and max_new_tokens > 1 \
            else None
        for i in range(max_new_tokens):
            if not use_cache:
                logits = model.lm_head(model.hidden_states(seq)[:, -1])
            nxt = sample_next(logits, temperature, top_k, top_p, greedy, generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            yield plain(nxt)
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            if threads is not None:
                threads.poll()
            if step is not None:
                if (model.config.ode_solver, model.config.ode_steps) != solve:
                    raise ValueError(
                        f"this generation started with ode_solver, ode_steps = {solve}, and the "
                        f"model now integrates with {(model.config.ode_solver, model.config.ode_steps)}"
                        f": start a new generation after set_solver().")
                logits = step.logits([int(nxt)])[None]
            elif token_fn is not None:
                logits = token_fn(nxt[:, None], state)
                state.advance()
            elif use_cache:
                logits = model.step(nxt[:, None], state)[0]
            else:
                seq = torch.cat([seq, nxt[:, None]], dim=1)


@contextlib.contextmanager
def streaming(model, threads: ThreadPolicy | None):
    """A stream's hold on the model: eval mode and the stream's thread count, both put back
    at its end. Streams may interleave: the model leaves eval mode only when the last one
    ends (the count of open streams is kept on the model object, the one thing they share)."""
    if threads is not None:
        threads.apply()
    hold = model.__dict__.setdefault("_stream_hold", [0, False])  # [open streams, mode before]
    if hold[0] == 0:
        hold[1] = model.training
    hold[0] += 1
    model.eval()
    try:
        yield
    finally:
        hold[0] -= 1
        if hold[0] == 0:
            model.train(hold[1])
        if threads is not None:
            threads.restore()


def plain(t: torch.Tensor) -> torch.Tensor:
    """An ordinary copy of an inference tensor: a caller may change it in place or use it in
    autograd outside inference mode, which an inference tensor refuses."""
    with torch.inference_mode(False):
        return t.clone()
