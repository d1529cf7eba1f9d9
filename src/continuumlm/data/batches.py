"""Token streams and the windows cut from them.

Training batches are random windows drawn from a seeded generator (its state is saved in
checkpoints, so a resumed run draws the same batches). Evaluation uses fixed, non-overlapping
windows, so a reported number can be reproduced exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class BatchSampler:
    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, seed: int):
        if len(data) < seq_len + 1:
            raise ValueError(f"{len(data)} tokens cannot fill one window of {seq_len} + 1.")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.data) - self.seq_len, (self.batch_size,),
                               generator=self.generator)
        win = self.data[starts[:, None] + self._offsets].long()
        return win[:, :-1], win[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def eval_window_starts(n_tokens: int, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Starts of non-overlapping windows of seq_len inputs (+1 target) covering the stream; at
    most ``max_windows`` of them, evenly spread when the stream holds more."""
    if n_tokens <= seq_len:
        return torch.zeros(0, dtype=torch.long)
    starts = torch.arange(0, n_tokens - seq_len, seq_len)
    if max_windows is not None and len(starts) > max_windows:
        pick = torch.linspace(0, len(starts) - 1, max_windows).round().long()
        starts = starts[pick]
    return starts


def eval_batches(data: torch.Tensor, seq_len: int, batch_size: int,
                 max_windows: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    starts = eval_window_starts(len(data), seq_len, max_windows)
    offsets = torch.arange(seq_len + 1)
    for i in range(0, len(starts), batch_size):
        win = data[starts[i:i + batch_size, None] + offsets].long()
        yield win[:, :-1], win[:, 1:]
