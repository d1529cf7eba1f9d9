"""Which CPU kernels a decoding process runs (continuumlm/decoding/kernels.py): oneDNN off for a
float32 model on the CPU, on where it is the faster one; the command line's generate and
serve set it (--onednn), the library's calls never do. conftest.py puts the switch back after
every test."""

import pytest
import torch

from conftest import run_cli, small_model, train_tiny, write_tiny_corpus
from continuumlm.decoding import Decoder
from continuumlm.decoding.kernels import decoding_kernels, onednn_helps


def test_auto_turns_onednn_off_for_a_float32_cpu_model():
    model = small_model()
    torch.backends.mkldnn.enabled = True
    assert not onednn_helps(model)
    with decoding_kernels(model) as said:
        assert said == "torch's own CPU kernels (oneDNN off)"
        assert torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled is True  # put back


@pytest.mark.parametrize("why", ["bfloat16", "compiled"])
def test_auto_keeps_onednn_where_it_is_the_faster(why):
    model = small_model()
    if why == "bfloat16":
        model = model.to(torch.bfloat16)
    torch.backends.mkldnn.enabled = False
    with decoding_kernels(model, "auto", compiled=why == "compiled") as said:
        assert said == "oneDNN on" and torch.backends.mkldnn.enabled is True
    assert torch.backends.mkldnn.enabled is False


@pytest.mark.parametrize("choice, on", [("on", True), ("off", False)])
def test_a_named_choice_is_kept(choice, on):
    model = small_model().to(torch.bfloat16)  # auto would keep it on
    torch.backends.mkldnn.enabled = not on
    with decoding_kernels(model, choice):
        assert torch.backends.mkldnn.enabled is on
    with pytest.raises(ValueError, match="one of auto, on, off"), decoding_kernels(model, "fast"):
        pass
    assert torch.backends.mkldnn.enabled is not on  # untouched by the refusal


def test_the_switch_goes_back_when_the_work_fails():
    model = small_model()
    torch.backends.mkldnn.enabled = True
    with pytest.raises(RuntimeError, match="decoding failed"), decoding_kernels(model):
        assert torch.backends.mkldnn.enabled is False
        raise RuntimeError("decoding failed")
    assert torch.backends.mkldnn.enabled is True


def test_a_model_on_another_device_keeps_onednn():
    assert onednn_helps(small_model().to("meta"))


def test_a_kept_drafter_serves_only_streams_with_its_kernels():
    """A drafting process inherits the switch when it is forked: the pool keeps one per
    setting, so a stream made under the other setting gets a process of its own."""
    from continuumlm.decoding.draft import Draft
    from continuumlm.decoding.drafter import DrafterPool

    model = small_model(depth="ode", ode_solver="rk4", ode_steps=2, num_layers=1)
    draft, pool = Draft("euler", 1, 4, pipeline=True), DrafterPool()
    torch.backends.mkldnn.enabled = True
    try:
        first = pool.acquire(model, draft)
        assert first.usable(model)
        pool.release(model, draft, first, clean=True)
        with decoding_kernels(model):
            other = pool.acquire(model, draft)
            assert other is not first and other.onednn is False
            pool.release(model, draft, other, clean=True)
        again = pool.acquire(model, draft)
        assert again is first and again.onednn is True
        pool.release(model, draft, again, clean=True)
    finally:
        pool.close()


def test_the_library_leaves_the_switch_alone():
    """Decoding through the library's own calls never flips a setting of the whole process."""
    model = small_model().eval()
    for on in (True, False):
        torch.backends.mkldnn.enabled = on
        Decoder(model).generate(torch.tensor([[1, 2, 3]]), 4, greedy=True)
        assert torch.backends.mkldnn.enabled is on


def test_decoding_is_the_same_either_way():
    """oneDNN's GELU and torch's differ in the last bits of float32 at most: greedy tokens of
    the same model agree (float64 never goes through oneDNN, so float32 is the case)."""
    model = small_model().eval()
    idx = torch.tensor([[1, 2, 3, 4]])
    outs = []
    for on in (True, False):
        torch.backends.mkldnn.enabled = on
        outs.append(Decoder(model).generate(idx, 12, greedy=True))
    assert torch.equal(*outs)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernels")
    return train_tiny(write_tiny_corpus(root / "corpus.txt"), root / "run")


def test_generate_says_which_kernels_and_takes_onednn(tiny_run, monkeypatch):
    import continuumlm.cli.models as models

    base = ["generate", "--checkpoint", tiny_run, "--prompt", "ab", "--max-new-tokens", "4",
            "--greedy"]
    seen, real = [], models._generate

    def spy(*a):  # the switch while the command decodes
        seen.append(torch.backends.mkldnn.enabled)
        return real(*a)

    monkeypatch.setattr(models, "_generate", spy)
    torch.backends.mkldnn.enabled = True
    r = run_cli(*base)
    assert r.returncode == 0, r.stderr
    assert "torch's own CPU kernels (oneDNN off)" in r.stderr
    assert torch.backends.mkldnn.enabled is True  # put back when the command ends
    r2 = run_cli(*base, "--onednn", "on")
    assert r2.returncode == 0 and "; oneDNN on" in r2.stderr
    assert seen == [False, True]
    assert r2.stdout == r.stdout
    bad = run_cli(*base, "--onednn", "fast")
    assert bad.returncode == 2 and "--onednn" in bad.stderr
