"""[train.layer_skip]: a discrete stack's layer dropout rising with depth and its early-exit
loss through the shared head, and the first-layers drafts they train (eval --agreement
layers:N)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, write_tiny_corpus
from continuumlm.config import load_config
from continuumlm.errors import ConfigError
from continuumlm.train.layer_skip import LayerSkip

BASE = ["model.hidden_size=16", "model.num_heads=2", "model.num_layers=3", "model.depth=discrete",
        "model.max_seq_len=16", "train.batch_size=2", "train.seq_len=8", "train.max_steps=3",
        "train.eval_interval=3", "train.eval_iters=1", "train.device=cpu", "train.warmup_steps=1"]


def config(*extra):
    return load_config(None, [*BASE, *extra])


@pytest.mark.parametrize("sets, match", [
    (["train.layer_skip.dropout=1.0"], "dropout must"),
    (["train.layer_skip.dropout=-0.1"], "dropout must"),
    (["train.layer_skip.exit_weight=-1"], ">= 0"),
    (["train.layer_skip.exit_kl=-0.5"], "exit_kl must be >= 0"),
    (["train.layer_skip.exit_weight=1", "train.layer_skip.exit_layers=[3]"], "1 to 2"),
    (["train.layer_skip.exit_weight=1", "train.layer_skip.exit_layers=[0]"], "positive"),
    (["train.layer_skip.exit_weight=1", "train.layer_skip.exit_layers=[1,1]"], "twice"),
    (["train.layer_skip.exit_layers=[1]"], "exit_weight and exit_kl are 0"),
    (["train.layer_skip.dropout=0.2", "model.depth=ode"], r"train.any_depth"),
    (["train.layer_skip.dropout=0.2", "model.num_layers=1"], "at least 2 layers"),
    (["train.layer_skip.exit_weight=1", "train.compile=true"], "compile = false"),
    (["train.layer_skip.exit_kl=1", "train.compile=true"], "exit_kl read each layer"),
    (["train.layer_skip.dropuot=0.1"], "did you mean 'dropout'"),
])
def test_bad_settings_are_refused_by_name(sets, match):
    with pytest.raises(ConfigError, match=match):
        config(*sets)


def _model(layers=3, seed=0):
    from continuumlm.testing import small_model

    model = small_model(seed, depth="discrete", num_layers=layers, position="learned").double()
    with torch.no_grad():  # weights away from the initialization: the layers matter
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def test_layer_dropout_skips_whole_layers_per_sequence_as_drawn():
    """In training, each sequence's output equals running that sequence alone through the
    layers its draws kept (a skipped layer passes its input on); the first layer always runs;
    in evaluation and in decoding every layer runs."""
    model = _model(layers=4)
    cfg = config("model.num_layers=4", "train.layer_skip.dropout=0.6")
    LayerSkip(model, cfg.train)
    assert model.depth.layer_drop == pytest.approx([0, 0.2, 0.4, 0.6])
    B = 16
    x = torch.randint(0, model.config.vocab_size, (B, 8))
    torch.manual_seed(7)
    got = model.train().hidden_states(x)
    torch.manual_seed(7)  # the same draws, in the forward's order: layer by layer
    keep = [torch.rand(B, 1, 1) >= p if p > 0 else torch.ones(B, 1, 1, dtype=torch.bool)
            for p in model.depth.layer_drop]
    model.eval()
    skipped = 0
    for b in range(B):
        h = model.tok_emb(x[b:b + 1]) + model.pos_emb(torch.arange(8))
        for i, layer in enumerate(model.depth.layers):
            if keep[i][b]:
                h = layer(h)
            else:
                skipped += 1
        torch.testing.assert_close(got[b:b + 1], model.norm_f(h))
    assert skipped > 0 and bool(keep[0].all())
    # evaluation runs every layer: the same as a model without dropout
    plain = model.hidden_states(x)
    model.depth.layer_drop = None
    torch.testing.assert_close(plain, model.hidden_states(x))


def test_skip_rates_rise_linearly_with_depth():
    model = _model(layers=3).float()
    LayerSkip(model, config("train.layer_skip.dropout=0.5").train)
    model.train()
    seen = torch.zeros(3)
    outputs = []
    model.depth.record = outputs
    torch.manual_seed(0)
    n = 4000
    with torch.no_grad():
        x = model.tok_emb(torch.randint(0, model.config.vocab_size, (n, 2)))
        model.depth(x)
    model.depth.record = None
    before = x
    for i, h in enumerate(outputs):
        seen[i] = float((h == before).flatten(1).all(1).float().mean())
        before = h
    assert seen[0] == 0
    assert seen[1] == pytest.approx(0.25, abs=0.03) and seen[2] == pytest.approx(0.5, abs=0.03)


def test_the_exit_loss_is_each_first_layers_models_loss_weighted_by_depth():
    """exit_loss(): for exits [1, 2] of a 3-layer stack, (1 * loss of the first layer alone +
    2 * loss of the first two) / 3, each through the shared final norm and head, at the targets
    that are not -1; its gradient reaches the exits' layers and the head, never the last
    layer."""
    from continuumlm.decoding.speculative import FirstLayers

    model = _model(layers=3).train()
    skip = LayerSkip(model, config("train.layer_skip.exit_weight=2.0").train)
    assert skip.exits == [1, 2] and skip.weight == 2.0
    assert model.depth.layer_drop is None  # no dropout asked for
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    y = torch.randint(0, model.config.vocab_size, (2, 8))
    y[0, :3] = -1
    with skip.recording() as outputs:
        _, loss = model(x, y)
    assert model.depth.record is None and len(outputs) == 3
    got = skip.exit_loss(outputs, y)
    ref = []
    for n in (1, 2):
        with FirstLayers(model, n).drafting():
            ref.append(model(x, y)[1])
    torch.testing.assert_close(got, (1 * ref[0] + 2 * ref[1]) / 3)
    first, last = list(model.depth.layers[0].parameters()), list(model.depth.layers[2].parameters())
    grads = torch.autograd.grad(got, first + last, allow_unused=True)
    assert all(g is not None for g in grads[:len(first)])
    assert sum(float(g.abs().sum()) for g in grads[:len(first)]) > 0
    assert all(g is None for g in grads[len(first):])
    # chosen exits only
    only = LayerSkip(model, config("train.layer_skip.exit_weight=1",
                                   "train.layer_skip.exit_layers=[2]").train)
    with only.recording() as outputs:
        model(x, y)
    torch.testing.assert_close(only.exit_loss(outputs, y), ref[1])


def test_the_exit_kl_is_each_exits_kl_from_the_stack_weighted_by_depth():
    """exit_kl(): for exits [1, 2] of a 3-layer stack, (1 * KL(stack || first layer) + 2 *
    KL(stack || first two)) / 3, each exit through the shared final norm and head, averaged
    over the positions whose targets are not -1, written out by hand; no gradient reaches the
    stack's own logits, and none without exit_kl."""
    model = _model(layers=3).train()
    skip = LayerSkip(model, config("train.layer_skip.exit_kl=0.5").train)
    assert skip.exits == [1, 2] and skip.kl_weight == 0.5 and skip.weight == 0.0
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    y = torch.randint(0, model.config.vocab_size, (2, 8))
    y[1, 5:] = -1
    with skip.recording() as outputs:
        logits, _ = model(x, y)
    got = skip.exit_kl(outputs, logits, y)
    keep = (y >= 0).flatten()
    p = torch.softmax(logits.detach().flatten(0, 1)[keep].double(), -1)
    want = 0.0
    for n, w in ((1, 1 / 3), (2, 2 / 3)):
        with torch.no_grad():
            q = torch.softmax(model.lm_head(model.norm_f(outputs[n - 1])).flatten(0, 1)[keep]
                              .double(), -1)
        want += w * float((p * (p.log() - q.log())).sum(-1).mean())
    assert float(got.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7) and want > 0
    (g,) = torch.autograd.grad(got, [logits], allow_unused=True)
    assert g is None  # the stack's side is the target, not pulled toward its exits
    # a task's logits at the target positions alone (targets_only), row-major: the same
    with skip.recording() as outputs:
        sparse, _ = model(x, y, targets_only=True)
    torch.testing.assert_close(skip.exit_kl(outputs, sparse, y), got)
    plain = LayerSkip(model, config("train.layer_skip.exit_weight=1").train)
    assert plain.exit_kl(outputs, logits, y) is None


def test_a_run_logs_the_exit_loss_and_eval_measures_the_first_layers_agreement(tmp_path):
    from continuumlm.train import Trainer

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    cfg = load_config(None, ["data.dataset=text", f'data.path="{corpus}"', *BASE,
                             "train.layer_skip.dropout=0.2", "train.layer_skip.exit_weight=1",
                             "train.layer_skip.exit_kl=0.5"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert steps and all(r["exit_loss"] > 0 and r["exit_kl"] > 0 and r["nfe"] == 3
                         for r in steps)
    saved = load_config(tmp_path / "run" / "config.toml")
    assert (saved.train.layer_skip.dropout, saved.train.layer_skip.exit_weight,
            saved.train.layer_skip.exit_kl) == (0.2, 1.0, 0.5)
    r = run_cli("eval", "--checkpoint", tmp_path / "run", "--which", "last", "--agreement",
                "layers:1,layers:2", "--json", "--max-windows", "4")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["agreement"]) == {"layers:1", "layers:2"}
    assert all(0 <= v <= 1 for v in out["agreement"].values())
    for bad, match in (("layers:3", "from 1 to 2"), ("euler:1", "first layers")):
        r = run_cli("eval", "--checkpoint", tmp_path / "run", "--which", "last", "--agreement",
                    bad)
        assert r.returncode == 2 and match in r.stderr, (bad, r.stderr)


@torch.no_grad()
def test_first_layers_agreement_equals_a_position_by_position_count():
    from continuumlm.decoding.speculative import FirstLayers
    from continuumlm.eval.agreement import agreement

    model = _model(layers=3).float().eval()
    data = torch.randint(0, model.config.vocab_size, (61,))
    got = agreement(model, data, 12, [("layers", 1)], torch.device("cpu"), batch_tokens=36)
    same = total = 0
    kl = 0.0
    from continuumlm.data import eval_batches

    for x, y in eval_batches(data, 12, 3):
        a = model(x)[0].double()
        with FirstLayers(model, 1).drafting():
            c = model(x)[0].double()
        scored = y >= 0
        p, q = a[scored].log_softmax(-1), c[scored].log_softmax(-1)
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float((p.exp() * (p - q)).sum())
        total += int(scored.sum())
    assert got["layers:1"]["positions"] == total == 60
    assert got["layers:1"]["agreement"] == pytest.approx(same / total)
    assert got["layers:1"]["kl"] == pytest.approx(kl / total, rel=1e-4)
    assert 0 < same < total
    with pytest.raises(ValueError, match="from 1 to 2"):
        agreement(model, data, 12, [("layers", 3)], torch.device("cpu"))


def test_a_resumed_run_skips_and_exits_as_the_uninterrupted_one(tmp_path):
    """The layer dropout draws from the global generator, which checkpoints keep: a run cut at
    step 3 and resumed logs the uninterrupted run's losses and exit losses, bit for bit."""
    from continuumlm.train import Trainer
    from continuumlm.train.logging import read_metrics

    corpus = write_tiny_corpus(tmp_path / "tiny.txt")
    sets = ["data.dataset=text", f'data.path="{corpus}"', *BASE, "train.max_steps=6",
            "train.lr_decay_steps=6", "train.checkpoint_interval=3", "train.eval_interval=3",
            "train.log_interval=1", "train.layer_skip.dropout=0.5",
            "train.layer_skip.exit_weight=1"]
    Trainer(load_config(None, sets), tmp_path / "full", quiet=True).run()
    Trainer(load_config(None, [*sets, "train.max_steps=3"]), tmp_path / "cut", quiet=True).run()
    Trainer(load_config(None, sets), tmp_path / "cut", resume=True, quiet=True).run()

    def logged(run):
        return {e["step"]: (e["loss"], e["exit_loss"]) for e in read_metrics(run) if "loss" in e}
    full, cut = logged(tmp_path / "full"), logged(tmp_path / "cut")
    assert [full[s] for s in range(4, 7)] == [cut[s] for s in range(4, 7)]
