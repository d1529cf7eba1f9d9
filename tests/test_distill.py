"""Distillation (train.distill.teacher / train.distill.weight): the term is KL(teacher || model)
computed against a direct reference, the teacher stays frozen and unchanged, the term
shrinks as the model learns, a resume repeats the run and refuses another teacher, and the
config and tokenizer refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import write_tiny_corpus
from continuumlm import ConfigError, load_config
from continuumlm.train import Trainer, load_model_and_tokenizer
from continuumlm.train.logging import read_metrics


def cfg(corpus, *extra):
    return load_config(None, [
        "data.dataset=text", f'data.path="{corpus}"', "model.hidden_size=32",
        "model.num_heads=2", "model.num_layers=1", "model.depth=ode", "model.dropout=0.0",
        "model.ode_solver=euler", "model.ode_steps=2", "train.batch_size=4",
        "train.seq_len=16", "train.max_steps=6", "train.lr_decay_steps=6",
        "train.warmup_steps=1", "train.log_interval=1", "train.eval_interval=3",
        "train.eval_iters=2", "train.checkpoint_interval=3", "train.device=cpu", *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_tiny_corpus(tmp_path_factory.mktemp("corpus") / "tiny.txt")


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A discrete two-layer model trained 60 steps (far from uniform, so a student starts far
    from it): a teacher of another depth and field."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    Trainer(cfg(corpus, "model.depth=discrete", "model.num_layers=2", "train.seed=7",
                "train.max_steps=60", "train.lr_decay_steps=60", "train.lr=1e-2",
                "train.checkpoint_interval=60", "train.eval_interval=60"), out, quiet=True).run()
    return out


def kd(teacher_run, w=1.0):
    return [f'train.distill.teacher="{teacher_run}"', f"train.distill.weight={w}"]


def test_the_term_is_kl_from_the_teacher_on_the_step_batch(corpus, teacher, tmp_path):
    tr = Trainer(cfg(corpus, *kd(teacher, 0.5)), tmp_path / "s", quiet=True)
    x, y = copy.deepcopy(tr.sampler).next(0)  # the batch the first step draws
    student = copy.deepcopy(tr.model).eval()  # dropout 0: train mode computes the same
    t_model, _, _ = load_model_and_tokenizer(teacher, "last")
    before = {k: v.clone() for k, v in tr.objective.teacher.model.state_dict().items()}
    tr.train_step()
    with torch.no_grad():
        p = F.log_softmax(t_model.eval()(x, y)[0].double(), -1)
        q = F.log_softmax(student(x, y)[0].double(), -1)
    want = (p.exp() * (p - q)).sum(-1).mean().item()
    assert want > 0.01 and tr.objective.distill == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the teacher is frozen: no gradient, weights unchanged, still in eval mode
    assert all(p.grad is None and not p.requires_grad for p in tr.objective.teacher.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in tr.objective.teacher.model.state_dict().items())
    assert not tr.objective.teacher.model.training


def test_the_gradient_adds_the_weighted_kl(corpus, teacher, tmp_path):
    """One step's update with the term minus the update without it is the optimizer applied to
    w * grad KL: checked through the gradients themselves (before the optimizer step)."""
    base = cfg(corpus, "train.grad_clip=0")
    a = Trainer(base, tmp_path / "a", quiet=True)
    b = Trainer(cfg(corpus, "train.grad_clip=0", *kd(teacher, 2.0)), tmp_path / "b",
                quiet=True)
    x, y = copy.deepcopy(a.sampler).next(0)
    grads = {}
    for name, tr in (("a", a), ("b", b)):
        def read(*args, name=name, tr=tr, **kw):  # in place of the update: read the gradients
            grads[name] = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for p in tr.model.parameters()]
        tr.optimizer.step = read
        tr.train_step()
    t_model, _, _ = load_model_and_tokenizer(teacher, "last")
    m = copy.deepcopy(a.model)
    m.zero_grad()
    with torch.no_grad():
        target = F.log_softmax(t_model.eval()(x, y)[0].float(), -1)
    q = F.log_softmax(m(x, y)[0].float(), -1)
    (2.0 * (target.exp() * (target - q)).sum(-1).mean()).backward()
    for ga, gb, p in zip(grads["a"], grads["b"], m.parameters()):
        want = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(gb - ga, want, rtol=1e-4, atol=1e-6)
    assert any(bool((gb != ga).any()) for ga, gb in zip(grads["a"], grads["b"]))


def test_distilling_pulls_the_model_toward_the_teacher_and_resumes_exactly(corpus, teacher,
                                                                           tmp_path):
    long = ["train.max_steps=30", "train.lr_decay_steps=30", "train.lr=3e-3",
            "train.checkpoint_interval=15", "train.eval_interval=15"]
    Trainer(cfg(corpus, *long, *kd(teacher, 5.0)), tmp_path / "full", quiet=True).run()
    ev = {e["step"]: e for e in read_metrics(tmp_path / "full") if "loss" in e}
    assert all(e["distill"] >= 0 for e in ev.values())
    first = sum(ev[s]["distill"] for s in range(1, 4)) / 3
    last = sum(ev[s]["distill"] for s in range(28, 31)) / 3
    assert last < 0.5 * first, (first, last)
    # interrupted at 15 and resumed: the same losses and terms
    Trainer(cfg(corpus, *long, "train.max_steps=15", *kd(teacher, 5.0)),
            tmp_path / "cut", quiet=True).run()
    Trainer(cfg(corpus, *long, *kd(teacher, 5.0)), tmp_path / "cut", resume=True,
            quiet=True).run()
    ev2 = {e["step"]: e for e in read_metrics(tmp_path / "cut") if "loss" in e}
    assert [(ev[s]["loss"], ev[s]["distill"]) for s in range(16, 31)] == \
        [(ev2[s]["loss"], ev2[s]["distill"]) for s in range(16, 31)]


def test_a_resume_refuses_another_teacher(corpus, teacher, tmp_path):
    other = tmp_path / "other"
    Trainer(cfg(corpus, "model.depth=discrete", "model.num_layers=2", "train.seed=8",
                "train.max_steps=3", "train.lr_decay_steps=3"), other, quiet=True).run()
    Trainer(cfg(corpus, "train.max_steps=3", *kd(teacher)), tmp_path / "s",
            quiet=True).run()
    with pytest.raises(ConfigError, match="is not the one this run was distilling from"):
        Trainer(cfg(corpus, *kd(other)), tmp_path / "s", resume=True, quiet=True)


def test_refusals(corpus, teacher, tmp_path):
    with pytest.raises(ConfigError, match="go together"):
        cfg(corpus, "train.distill.weight=1.0")
    with pytest.raises(ConfigError, match="go together"):
        cfg(corpus, f'train.distill.teacher="{teacher}"')
    with pytest.raises(ConfigError, match="distill.weight must be >= 0"):
        cfg(corpus, f'train.distill.teacher="{teacher}"', "train.distill.weight=-1")
    with pytest.raises(ConfigError, match="cannot be loaded as the teacher"):
        Trainer(cfg(corpus, *kd(tmp_path / "nowhere")), tmp_path / "s", quiet=True)
    # a teacher trained on other text has another tokenizer
    text = tmp_path / "other.txt"
    text.write_text("0123456789 " * 400)
    other = tmp_path / "other"
    Trainer(cfg(text, "train.max_steps=2", "train.lr_decay_steps=2"), other, quiet=True).run()
    with pytest.raises(ConfigError, match="tokenizer"):
        Trainer(cfg(corpus, *kd(other)), tmp_path / "s2", quiet=True)
