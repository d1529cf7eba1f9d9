"""The parts a checkpoint restores (train/stateful.py): each reads its keys of the flat trainer
state, old formats included, and what does not fit is one error naming the folder and part."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from continuumlm.errors import CheckpointError
from continuumlm.train.stateful import Keyed, Progress, RandomState, restore

ONE = SimpleNamespace(rank=0, enabled=False)


def test_progress_round_trip_and_old_states():
    p = Progress(step=7, best_val=1.5, bad_steps=2, skipped_steps=3)
    q = Progress()
    q.load_state_dict(p.state_dict())
    assert q == p
    q.load_state_dict({"step": 4, "best_val": 2.0})  # before the bad-step counters
    assert q == Progress(step=4, best_val=2.0)


def test_random_state_per_rank_and_single_process_format():
    rng = RandomState(ONE, torch.device("cpu"))
    torch.manual_seed(3)
    saved = RandomState.state_dict([rng.local()])
    want = torch.rand(4)
    torch.manual_seed(99)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(4), want)
    torch.manual_seed(99)
    rng.load_state_dict({"torch_rng": saved["torch_rng"]})  # a checkpoint before rank_rng
    assert torch.equal(torch.rand(4), want)
    second = RandomState(SimpleNamespace(rank=1, enabled=True), torch.device("cpu"))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    second.load_state_dict(saved)  # one rank's states: rank 1 keeps its own seed
    assert torch.equal(torch.get_rng_state(), before)


def test_what_does_not_fit_names_the_folder_and_the_part():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(CheckpointError, match=r"run/ckpt.*the optimizer: ValueError"):
        restore({"optimizer": Keyed(opt, "optimizer")},
                {"optimizer": other.state_dict()}, Path("run/ckpt"))
    with pytest.raises(CheckpointError, match=r"the progress: KeyError"):
        restore({"progress": Progress()}, {}, Path("run/ckpt"))
    restore({"scaler": Keyed(object(), "scaler", optional=True)}, {}, Path("x"))  # absent: left
