"""Token streams and the windows cut from them.

Training batches are random windows drawn from a seeded generator (its state is saved in
checkpoints, so a resumed run draws the same batches). Evaluation uses fixed, non-overlapping
windows, so a reported number can be reproduced exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ..errors import first_line


def gather(data, index: torch.Tensor) -> torch.Tensor:
    """``data[index]`` as int64: ``data`` is a 1-D tensor or a numpy array (a memmap of a
    prepared split, whose pages are read only where a window falls)."""
    if isinstance(data, torch.Tensor):
        return data[index].long()
    return torch.from_numpy(np.asarray(data[index.numpy()], dtype=np.int64))


def stream_seed(seed: int, stream: int) -> int:
    """Seed of batch stream ``stream``: stream 0 uses ``seed`` itself, so a single-process run
    without accumulation draws exactly the batches of one generator seeded with ``seed``."""
    return (seed + stream * 1_000_003) % (2**63)


class BatchSampler:
    """Random training windows from independent, seeded streams.

    A training step consumes one micro-batch from each stream this process owns. Stream
    ``m = rank * grad_accum + j`` feeds micro-step ``j`` of rank ``rank``, so every rank draws
    its own windows (streams are seeded from (seed, m)), and a run with ``world_size`` ranks and
    ``grad_accum`` micro-steps sees the same global batch as a single process with
    ``world_size * grad_accum`` micro-steps.
    """

    def __init__(self, data, batch_size: int, seq_len: int, seed: int,
                 streams: range | list[int] = range(1)):
        if len(data) < seq_len + 1:
            raise ValueError(f"{len(data)} tokens cannot fill one window of {seq_len} + 1.")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.streams = list(streams)
        self.generators = {m: torch.Generator().manual_seed(stream_seed(seed, m))
                           for m in self.streams}
        self._offsets = torch.arange(seq_len + 1)

    @property
    def generator(self) -> torch.Generator:
        return self.generators[self.streams[0]]

    def next(self, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.generators[self.streams[micro_step]]
        starts = torch.randint(len(self.data) - self.seq_len, (self.batch_size,), generator=g)
        win = gather(self.data, starts[:, None] + self._offsets)
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict:
        return {"streams": {m: g.get_state() for m, g in self.generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Accepts the states of any superset of this sampler's streams (a checkpoint holds those
        of every rank), and the single-generator format of earlier checkpoints."""
        streams = state.get("streams", {0: state["generator"]} if "generator" in state else {})
        missing = [m for m in self.streams if m not in streams]
        if missing:
            raise ValueError(f"the checkpoint holds batch streams {sorted(streams)} but this run "
                             f"needs {missing}: resume with the same number of processes and "
                             f"train.grad_accum as the run that wrote it.")
        for m in self.streams:
            try:
                self.generators[m].set_state(streams[m])
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"the checkpoint's state of batch stream {m} is damaged "
                                 f"({first_line(e)}); "
                                 f"resume from an earlier checkpoint.") from None


def eval_window_starts(n_tokens: int, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Starts of windows of seq_len inputs (+1 target each) that score every target of the
    stream (tokens 1 .. n_tokens-1) exactly once: non-overlapping windows from the start, and,
    when targets remain after the last of them, one more window that ends at the last token
    (its targets already scored are masked by :func:`eval_batches`), so every context length
    scores the same tokens. With ``max_windows`` smaller than the non-overlapping count, that
    many of them, evenly spread (a sample; no tail window); ``max_windows`` equal to that count
    gives those windows, not one more for the tail."""
    if n_tokens <= seq_len:
        return torch.zeros(0, dtype=torch.long)
    starts = torch.arange(0, n_tokens - seq_len, seq_len)
    if max_windows is not None and len(starts) >= max_windows:
        pick = torch.linspace(0, len(starts) - 1, max_windows).round().long()
        return starts[pick]
    last = n_tokens - 1 - seq_len
    if starts[-1] < last:
        starts = torch.cat([starts, torch.tensor([last])])
    return starts


def eval_batches(data, seq_len: int, batch_size: int,
                 max_windows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) batches over :func:`eval_window_starts`; a target an earlier window
    already scored is set to -1 (the model's ignore_index). Count ``targets >= 0``."""
    starts = eval_window_starts(len(data), seq_len, max_windows)
    offsets = torch.arange(seq_len + 1)
    # leading targets of each window already scored by the one before (only the tail has any)
    seen = (torch.cat([starts[:1], starts[:-1] + seq_len]) - starts).clamp(min=0)
    for i in range(0, len(starts), batch_size):
        win = gather(data, starts[i:i + batch_size, None] + offsets)
        y = win[:, 1:].clone()
        y[offsets[:-1] < seen[i:i + batch_size, None]] = -1
        yield win[:, :-1], y
