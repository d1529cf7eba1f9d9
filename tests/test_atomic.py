"""A model folder is written whole or not at all (continuumlm.atomic)."""

from __future__ import annotations

import pytest
import torch

from continuumlm.atomic import atomic_folder
from continuumlm.testing import small_model


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    import safetensors.torch

    model = small_model()
    model.save_pretrained(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_model", full_disk)
    with pytest.raises(OSError, match="No space"):
        model.save_pretrained(tmp_path / "m")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    with pytest.raises(OSError):
        model.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left


def test_files_move_in_with_the_config_last(tmp_path, monkeypatch):
    import os

    order = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(os.path.basename(b)),
                                                     real(a, b)))
    (tmp_path / "d").mkdir()
    with atomic_folder(tmp_path / "d") as tmp:
        for name in ("config.json", "a.bin", "z.bin"):
            (tmp / name).write_text(name)
    assert order == ["a.bin", "z.bin", "config.json"]
    assert (tmp_path / "d" / "config.json").read_text() == "config.json"
