"""The transformers adapter: checkpoints load with AutoModelForCausalLM, the HF loss equals
ours, HF generation decodes through the exact ODE caches (greedy tokens and per-step logits
equal ContinuumLM's own decoding), anytime depth from from_pretrained, clear refusals."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import continuumlm.hf  # noqa: E402,F401  (registers the model type)
from continuumlm.hf import ContinuumLMCache, ContinuumLMConfig, ContinuumLMForCausalLM  # noqa: E402
from continuumlm.hf.modeling import CACHE_FIELD  # noqa: E402
from continuumlm.registry import MIXERS, SOLVERS  # noqa: E402
from continuumlm.testing import small_model  # noqa: E402

FIXED_GRID = [n for n in SOLVERS if getattr(SOLVERS.component_class(n), "fixed_grid", False)]
COMBOS = ([(m, "discrete", None) for m in MIXERS]
          + [(m, "ode", s) for m in MIXERS for s in FIXED_GRID])


def build(mixer: str, depth: str, solver: str | None, **kw):
    extra = {"depth": depth, "mixer": mixer, "num_layers": 2 if depth == "discrete" else 1,
             **({"ode_solver": solver, "ode_steps": 2} if solver else {}), **kw}
    return small_model(**extra).eval()


def saved(lm, tmp_path):
    lm.save_pretrained(tmp_path / "ckpt")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("mixer, depth, solver", COMBOS)
def test_hf_generation_equals_ours(mixer, depth, solver, tmp_path):
    torch.manual_seed(0)
    lm = build(mixer, depth, solver)
    hf = saved(lm, tmp_path)
    assert isinstance(hf, ContinuumLMForCausalLM)
    # not the pad id (0): generate would mask it out, which these models refuse
    prompt = torch.randint(1, lm.config.vocab_size, (1, 5))
    n = 6
    out = hf.generate(prompt, max_new_tokens=n, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0)
    ours = lm.generate(prompt, max_new_tokens=n, greedy=True)
    assert out.sequences.tolist() == ours.tolist()
    # ContinuumLM's own cached decoding, step by step, on the same tokens
    state = lm.init_state(1)
    logits, state = lm.step(prompt, state)
    for i, hf_logits in enumerate(out.logits):
        torch.testing.assert_close(hf_logits, logits, rtol=0, atol=1e-5)
        logits, state = lm.step(out.sequences[:, 5 + i:6 + i], state)


ASSISTED_CONFIGS = [("softmax", "discrete", None), ("softmax", "ode", "rk4"),
                    ("deltanet", "discrete", None), ("deltanet", "ode", "rk4"),
                    ("continuous", "ode", "euler")]


def _greedy_outputs(hf, prompt, **kw):
    return hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0,
                       output_scores=True, output_logits=True, return_dict_in_generate=True,
                       **kw)


def _same_outputs(a, b):
    assert a.sequences.tolist() == b.sequences.tolist()
    for x, y in ((a.scores, b.scores), (a.logits, b.logits)):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            torch.testing.assert_close(u, v, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mixer, depth, solver", ASSISTED_CONFIGS)
@pytest.mark.parametrize("assistant", ["same", "random", "small"])
def test_assisted_decoding_matches_greedy_search(mixer, depth, solver, assistant, tmp_path):
    """What transformers' GenerationTesterMixin checks of assisted decoding (its generation
    tests are not in the release's source distribution that make test-hf-suite runs): with
    the model itself, a randomly initialized model of the same config, or a smaller model as
    the assistant (each drafting 2 tokens a round, constant schedule), the sequences, scores
    and logits equal greedy search's; the model verifies each block in one pass and cuts its
    cache back to what it kept. DeltaNet with its short convolution, whose history is cut back
    too."""
    kw = {"components": {"deltanet": {"short_conv": 3}}} if mixer == "deltanet" else {}
    lm = build(mixer, depth, solver, **kw)
    hf = saved(lm, tmp_path / "main")
    if assistant == "same":
        helper = hf
    elif assistant == "random":
        helper = saved(build(mixer, depth, solver, seed=7, **kw), tmp_path / "random")
    else:
        helper = saved(small_model(seed=3, depth="discrete", mixer=mixer, num_layers=1, **kw),
                       tmp_path / "small")
    helper.generation_config.num_assistant_tokens = 2
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    greedy = _greedy_outputs(hf, prompt)
    _same_outputs(_greedy_outputs(hf, prompt, assistant_model=helper), greedy)
    assert greedy.sequences[:, :22].tolist() == lm.generate(prompt, 12, greedy=True).tolist()


@pytest.mark.parametrize("mixer, depth, solver", ASSISTED_CONFIGS)
def test_prompt_lookup_decoding_matches_greedy_search(mixer, depth, solver, tmp_path):
    """Prompt-lookup decoding (drafts copied from the prompt, a repeating one here, so that
    drafts are found and some rejected) gives greedy search's sequences, scores and logits."""
    kw = {"components": {"deltanet": {"short_conv": 3}}} if mixer == "deltanet" else {}
    hf = saved(build(mixer, depth, solver, **kw), tmp_path)
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    _same_outputs(_greedy_outputs(hf, prompt, prompt_lookup_num_tokens=2, max_matching_ngram_size=2),
                  _greedy_outputs(hf, prompt))


def test_assisted_decoding_sample(tmp_path):
    """Assisted sampling runs through the cut-back cache and returns the asked-for length."""
    hf = saved(build("deltanet", "ode", "rk4"), tmp_path)
    torch.manual_seed(0)
    out = hf.generate(torch.tensor([[3, 5, 7, 9]]), max_new_tokens=10, do_sample=True,
                      pad_token_id=0, assistant_model=hf, return_dict_in_generate=True,
                      output_scores=True)
    assert out.sequences.shape == (1, 14) and len(out.scores) == 10


def test_generate_feeds_one_token_per_step_after_the_prompt(tmp_path, monkeypatch):
    lm = build("deltanet", "ode", "rk4")
    hf = saved(lm, tmp_path)
    seen = []
    real = lm.hidden_states

    def spy(idx, state=None, **kw):
        seen.append((idx.shape[1], state.pos if state is not None else None))
        return real(idx, state, **kw)

    monkeypatch.setattr(lm, "hidden_states", spy)
    hf.model = lm
    hf.generate(torch.randint(1, 37, (1, 7)), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert seen == [(7, 0), (1, 7), (1, 8), (1, 9)]


@pytest.mark.parametrize("mixer, depth", [("softmax", "discrete"), ("continuous", "ode")])
def test_labels_give_our_loss(mixer, depth, tmp_path):
    lm = build(mixer, depth, "rk4" if depth == "ode" else None)
    hf = saved(lm, tmp_path)
    x = torch.randint(0, 37, (3, 17))
    _, ours = lm(x[:, :-1], x[:, 1:])
    out = hf(input_ids=x, labels=x)
    torch.testing.assert_close(out.loss, ours, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logits, lm(x)[0], rtol=0, atol=0)
    masked = x.clone()
    masked[:, :9] = -100  # the HF convention: -100 is not scored
    y = x[:, 1:].clone()
    y[:, :8] = -1
    torch.testing.assert_close(hf(input_ids=x, labels=masked).loss, lm(x[:, :-1], y)[1],
                               rtol=0, atol=1e-6)
    assert getattr(hf(input_ids=x, use_cache=False), CACHE_FIELD) is None


def test_anytime_depth_from_from_pretrained(tmp_path):
    lm = build("softmax", "ode", "euler")
    lm.save_pretrained(tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", ode_solver="rk4",
                                                           ode_steps=8)
    assert (hf.config.ode_solver, hf.config.ode_steps) == ("rk4", 8)
    lm.set_solver("rk4", 8, ode_grad="direct")
    x = torch.randint(0, 37, (2, 11))
    torch.testing.assert_close(hf(input_ids=x).logits, lm(x)[0], rtol=0, atol=0)
    assert hf.model.last_nfe == 32


def test_the_auto_classes_check_solver_keywords_too(tmp_path):
    """AutoModelForCausalLM hands ode_steps= to the config, not to from_pretrained: a discrete
    model asked for 8 steps loaded silently that way."""
    from continuumlm.errors import CheckpointError

    build("softmax", "discrete", None).save_pretrained(tmp_path / "discrete")
    with pytest.raises(CheckpointError, match="needs depth = 'ode'"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "discrete", ode_steps=8)
    build("softmax", "ode", "euler").save_pretrained(tmp_path / "ode")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ode", ode_steps=8)
    assert hf.config.ode_steps == hf.model.config.ode_steps == 8


def test_config_round_trip_and_standard_names(tmp_path):
    lm = build("deltanet", "ode", "rk4", components={"deltanet": {"short_conv": 4}})
    cfg = ContinuumLMConfig.from_model_config(lm.config)
    assert cfg.num_attention_heads == lm.config.num_heads
    assert cfg.max_position_embeddings == lm.config.max_seq_len
    assert cfg.model_type == "continuumlm"
    cfg.save_pretrained(tmp_path)
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, ContinuumLMConfig) and back.to_model_config() == lm.config
    assert back.to_model_config().component("deltanet").short_conv == 4
    with pytest.raises(Exception, match="hidden_size"):
        ContinuumLMConfig(hidden_size=-3)


def test_hf_save_pretrained_is_read_by_continuumlm(tmp_path):
    from continuumlm import LanguageModel

    lm = build("continuous", "ode", "rk4")
    hf = saved(lm, tmp_path)
    hf.save_pretrained(tmp_path / "hf")
    back = LanguageModel.from_pretrained(tmp_path / "hf")
    for (name, a), (_, b) in zip(lm.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name  # native -> HF -> native: bitwise
    x = torch.randint(0, 37, (1, 9))
    torch.testing.assert_close(back(x)[0], lm(x)[0], rtol=0, atol=0)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    torch.testing.assert_close(again(input_ids=x).logits, lm(x)[0], rtol=0, atol=0)


def test_refusals_are_clear(tmp_path):
    hf = saved(build("softmax", "discrete", None), tmp_path)
    x = torch.randint(0, 37, (2, 6))
    # padding with a hole is refused where a mixer reads a row as one stretch
    cat = saved(build("continuous", "discrete", None), tmp_path / "cat")
    mask = torch.ones_like(x)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="pad on the left or on the right"):
        cat(input_ids=x, attention_mask=mask)
    other = transformers.DynamicCache()
    other.update(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), 0)  # holds 3 tokens
    with pytest.raises(ValueError, match="ContinuumLMCache"):
        hf(input_ids=x, cache=other)
    with pytest.raises(ValueError, match="attention maps"):
        hf(input_ids=x, output_attentions=True)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        hf()
    cache = ContinuumLMCache(hf.model.init_state(2))
    assert cache.get_seq_length() == 0
    hf(input_ids=x, cache=cache)
    assert cache.get_seq_length() == 6
    cache.crop(-2)  # transformers' meaning from 5.24: remove 2 tokens
    assert cache.get_seq_length() == 4
    cache.crop(3)  # the earlier releases': keep 3
    assert cache.get_seq_length() == 3
    with pytest.raises(NotImplementedError, match="assistant_early_exit"):
        hf.generate(x[:1], max_new_tokens=3, do_sample=False, pad_token_id=0,
                    assistant_early_exit=1)
    # batched generation without padding is exact too
    out = hf.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.tolist() == hf.model.generate(x, 3, greedy=True).tolist()


def test_a_training_checkpoint_loads_with_auto_classes(tiny_corpus, tmp_path):
    from continuumlm.config import load_config
    from continuumlm.train import Trainer

    cfg = load_config(None, ["data.dataset=text", f'data.path="{tiny_corpus}"',
                             "data.tokenizer=bpe", "data.vocab_size=300",
                             "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
                             "model.depth=ode", "train.batch_size=2", "train.seq_len=16",
                             "train.max_steps=2", "train.eval_interval=2", "train.eval_iters=1",
                             "train.device=cpu"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    best = tmp_path / "run" / "checkpoints" / "best"
    hf = transformers.AutoModelForCausalLM.from_pretrained(best)
    tok = transformers.AutoTokenizer.from_pretrained(best)
    ids = tok("the cat sat", return_tensors="pt")["input_ids"]
    out = hf.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 5)


TEXT = "the cat sat\non the mat\n  indented é\n"


@pytest.mark.parametrize("kind", ["char", "word", "bpe", "char_unk"])
def test_exported_tokenizers_encode_as_ours(kind):
    from continuumlm.data.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer
    from continuumlm.hf.export import hf_tokenizer

    tok = {"char": lambda: CharTokenizer.train(TEXT), "word": lambda: WordTokenizer.train(TEXT),
           "bpe": lambda: BPETokenizer.train(TEXT * 20, 300),
           "char_unk": lambda: CharTokenizer(sorted(set(TEXT[:10])) + ["<unk>"])}[kind]()
    ids = hf_tokenizer(tok).encode(TEXT).ids
    assert ids == tok.encode(TEXT)
    assert hf_tokenizer(tok).decode(ids) == tok.decode(ids)


def exported_run(tiny_corpus, tmp_path, tokenizer="bpe"):
    from conftest import run_cli
    from continuumlm.config import load_config
    from continuumlm.train import Trainer

    cfg = load_config(None, ["data.dataset=text", f'data.path="{tiny_corpus}"',
                             f"data.tokenizer={tokenizer}", "model.hidden_size=32",
                             "model.num_heads=2", "model.num_layers=1", "model.depth=ode",
                             "model.max_seq_len=128", "train.batch_size=2", "train.seq_len=16",
                             "train.max_steps=2", "train.eval_interval=2", "train.eval_iters=1",
                             "train.device=cpu", *(["data.vocab_size=300"]
                                                   if tokenizer == "bpe" else [])])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    r = run_cli("export", "--format", "hf", "--checkpoint", tmp_path / "run", "--out",
                tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    return tmp_path / "hf"


def test_lm_eval_harness_scores_an_exported_checkpoint(tiny_corpus, tmp_path):
    """lm-evaluation-harness's HFLM loads the folder through the Auto classes; its rolling
    log-likelihood (the perplexity tasks) and continuation log-likelihoods equal ours."""
    lm_eval = pytest.importorskip("lm_eval")  # noqa: F841
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    out = exported_run(tiny_corpus, tmp_path)
    harness = HFLM(pretrained=str(out), batch_size=1, device="cpu")
    assert isinstance(harness.model, ContinuumLMForCausalLM)
    text = tiny_corpus.read_text()[:300]
    [rolling] = harness.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    tok, model = harness.tokenizer, harness.model.model
    ids = tok(text)["input_ids"]
    x = torch.tensor([[tok.eos_token_id] + ids[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].double(), -1)[0]
    ours = logp[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
    assert abs(rolling - ours) < 1e-3 * max(1.0, abs(ours))
    [(ll, greedy)] = harness.loglikelihood(
        [Instance("loglikelihood", {}, ("the cat", " sat"), 0)], disable_tqdm=True)
    assert ll < 0 and isinstance(greedy, bool)
    [gen] = harness.generate_until(
        [Instance("generate_until", {}, ("the cat", {"until": ["\n\n"], "max_gen_toks": 8,
                                                     "do_sample": False}), 0)],
        disable_tqdm=True)
    prompt = torch.tensor([tok("the cat")["input_ids"]])
    want = tok.decode(model.generate(prompt, 8, greedy=True)[0, prompt.shape[1]:].tolist())
    assert gen == want.split("\n\n")[0]


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 16, 17, 30])
def test_harness_windows_are_lm_eval_s(n):
    """Our copy of the harness's rolling windows (for the exact check of `continuumlm harness`)
    gives lm-eval's windows: the same inputs and the same scored tokens, at lengths below, at
    and past one window and not a multiple of it."""
    pytest.importorskip("lm_eval")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from continuumlm.hf.harness import harness_windows

    tokens, context, prefix = list(range(100, 100 + n)), 8, -1
    theirs = [(ctx + cont)[-(context + 1):][:-1] for ctx, cont in map(
        make_disjoint_window, get_rolling_token_windows(tokens, prefix, context, 1))]
    scored_theirs = [cont for _, cont in map(
        make_disjoint_window, get_rolling_token_windows(tokens, prefix, context, 1))]
    seq = [prefix] + tokens
    ours = harness_windows(n, context)
    assert [seq[s + 1:s + 1 + length] for s, length, _ in ours] == theirs
    assert [seq[s + 2:s + 2 + length][length - k:] for s, length, k in ours] == scored_theirs
    assert sum(k for _, _, k in ours) == n


def test_export_refuses_a_folder_in_use(tiny_corpus, tmp_path):
    from conftest import run_cli

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    r = run_cli("export", "--format", "hf", "--checkpoint", tmp_path / "nothing", "--out",
                tmp_path / "taken")
    assert r.returncode == 2 and "not an empty folder" in r.stderr


@pytest.mark.slow
def test_harness_command_agrees_with_eval(tiny_corpus, tmp_path, monkeypatch):
    """`continuumlm harness`: lm-eval's own command-line path (--model hf, trust_remote_code, a
    local task) on the run's validation split; its bits per byte equal continuumlm eval's
    within 1% (they differ by the first token, which only the harness scores)."""
    pytest.importorskip("lm_eval")
    import json

    from conftest import run_cli
    from continuumlm.hf.harness import harness_windows

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    out = exported_run(tiny_corpus, tmp_path)  # trains tmp_path/run
    del out
    # --max-tokens above the split's length (127 tokens) scores all of it
    r = run_cli("harness", "--checkpoint", tmp_path / "run", "--json", "--context", "32",
                "--max-tokens", "400", "--keep", tmp_path / "kept")
    assert r.returncode == 0, r.stderr[-3000:]
    kept = json.loads(r.stdout)
    assert kept["tokens"] > 100 and abs(kept["bits_per_byte_ratio"] - 1) < 0.01
    # one progress report for the task (lines away from a terminal), not a bar per window,
    # and no warning about the document being longer than the context (windows cut it)
    windows = len(harness_windows(kept["tokens"], 32))
    assert r.stderr.count("windows scored") <= 10
    assert f"lm-eval continuumlm_val: {windows} of {windows} windows scored" in r.stderr
    # (lm-eval's one bar over the task's documents is left: 1 of 1, drawn twice)
    assert "indexing errors" not in r.stderr and r.stderr.count("it/s]") <= 2, r.stderr[-3000:]
    # exact: our model on the harness's own windows (the split is several windows long)
    assert abs(kept["harness_windows_ratio"] - 1) < 1e-5, kept
    r = run_cli("harness", "--checkpoint", tmp_path / "run", "--json", "--context", "32",
                "--ode-steps", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    deeper = json.loads(r.stdout)
    assert deeper["nfe"] == 32 and abs(deeper["bits_per_byte_ratio"] - 1) < 0.01
    assert abs(deeper["harness_windows_ratio"] - 1) < 1e-5, deeper
    # a text no longer than the context: refused before lm-eval runs (it ended in a KeyError)
    r = run_cli("harness", "--checkpoint", tmp_path / "run", "--context", "32",
                "--max-tokens", "20")
    assert r.returncode == 2 and "--context 32" in r.stderr and "20 tokens" in r.stderr
    # lm-eval's own command line on the kept folder gives the same figure
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    cmd = shlex.split(kept["lm_eval_command"])
    exe = Path(sys.executable).parent / "lm_eval"
    done = subprocess.run([str(exe), *cmd[1:], "--output_path", str(tmp_path / "lm_eval_out")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = (tmp_path / "lm_eval_out").rglob("results_*.json")
    bpb = json.loads(result.read_text())["results"]["continuumlm_val"]["bits_per_byte,none"]
    assert bpb == pytest.approx(kept["harness"]["bits_per_byte"], rel=1e-6)


def test_bad_folders_and_solvers_are_refused(tmp_path):
    from continuumlm.errors import CheckpointError

    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(CheckpointError, match="'llama' model"):
        ContinuumLMForCausalLM.from_pretrained(tmp_path / "llama")
    build("softmax", "discrete", None).save_pretrained(tmp_path / "discrete")
    with pytest.raises(CheckpointError, match="needs depth = 'ode'"):
        ContinuumLMForCausalLM.from_pretrained(tmp_path / "discrete", ode_steps=8)
    hf = ContinuumLMForCausalLM.from_pretrained(tmp_path / "discrete")
    with pytest.raises(ValueError, match="device_map .* splits the model"):
        ContinuumLMForCausalLM.from_pretrained(tmp_path / "discrete",
                                               device_map={"a": "cpu", "b": "meta"})
    adaptive = build("softmax", "ode", "dopri5")
    adaptive.save_pretrained(tmp_path / "adaptive")
    hf = ContinuumLMForCausalLM.from_pretrained(tmp_path / "adaptive")
    with pytest.raises(ValueError, match="adaptive ODE solver cannot be decoded incrementally"):
        hf.generate(torch.randint(0, 37, (1, 4)), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)


def test_without_the_extras_the_commands_name_them(tmp_path, monkeypatch):
    import sys

    from conftest import run_cli

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    r = run_cli("export", "--format", "hf", "--checkpoint", tmp_path, "--out", tmp_path / "o")
    assert r.returncode == 2 and "continuumlm[hf]" in r.stderr
    r = run_cli("harness", "--checkpoint", tmp_path)
    assert r.returncode == 2 and "continuumlm[eval]" in r.stderr


def test_solver_overrides_keep_the_exported_config(tiny_corpus, tmp_path):
    out = exported_run(tiny_corpus, tmp_path)
    base = ContinuumLMForCausalLM.from_pretrained(out)
    deeper = ContinuumLMForCausalLM.from_pretrained(out, ode_steps=8)
    assert deeper.config.ode_steps == 8 and deeper.config.auto_map == base.config.auto_map
    assert deeper.config.eos_token_id == base.config.eos_token_id is not None
    assert deeper.generation_config.eos_token_id == base.config.eos_token_id
    from continuumlm.errors import CheckpointError

    with pytest.raises(CheckpointError, match="is not a folder"):
        ContinuumLMForCausalLM.from_pretrained(str(tmp_path / "no" / "such" / "folder"))


@pytest.mark.slow
@pytest.mark.parametrize("corpus,split,tokenizer", [("tinyshakespeare", "val", "char"),
                                                    ("ptb", "test", "word")])
def test_shipped_task_yamls_score_the_split_continuumlm_scores(data_dir, tmp_path, monkeypatch,
                                                               corpus, split, tokenizer):
    """tasks/continuumlm_*.yaml read the local corpus, cut as ContinuumLM cuts it: the whole
    split's text encodes (exported tokenizer) to exactly the tokens continuumlm eval scores,
    and lm-eval's bits per byte on a prefix equal ours on the same tokens within 1% (ours
    leave out the first token, which the harness scores after its end-of-text token)."""
    pytest.importorskip("lm_eval")
    import math

    import lm_eval
    from lm_eval.tasks import TaskManager

    from conftest import REPO, run_cli
    from continuumlm.config import load_config
    from continuumlm.data import prepare_data
    from continuumlm.eval.perplexity import evaluate_contexts
    from continuumlm.hf.export import hf_tokenizer
    from continuumlm.train import Trainer, load_model_and_tokenizer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.syspath_prepend(str(REPO / "tasks"))
    from continuumlm_corpora import split_text

    cfg = load_config(None, [f"data.dataset={corpus}", f"data.tokenizer={tokenizer}",
                             "model.hidden_size=32", "model.num_heads=2", "model.num_layers=1",
                             "model.depth=ode", "model.ode_steps=2", "train.batch_size=2",
                             "train.seq_len=32", "train.max_steps=2", "train.eval_interval=2",
                             "train.eval_iters=1", "train.device=cpu"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    model, tok, ckpt = load_model_and_tokenizer(tmp_path / "run", "last")
    data = prepare_data(cfg.data, tok)
    text = split_text(corpus, split)
    assert hf_tokenizer(tok).encode(text).ids == [int(i) for i in data.splits[split]]

    r = run_cli("export", "--format", "hf", "--checkpoint", tmp_path / "run", "--out",
                tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    n = 1500
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(tmp_path / "hf"), "trust_remote_code": True,
                                "max_length": 32, "dtype": "float32"},
        tasks=[f"continuumlm_{corpus if corpus == 'ptb' else 'shakespeare'}_{split}"],
        batch_size=1, device="cpu", log_samples=False,
        task_manager=TaskManager(include_path=str(REPO / "tasks"), metadata={"max_chars": n}))
    [res] = out["results"].values()
    prefix = text[:n]
    ids = hf_tokenizer(tok).encode(prefix).ids
    [row] = evaluate_contexts(model, torch.tensor(ids), [32], tokenizer == "char",
                              torch.device("cpu"))
    ours = row["loss"] * row["tokens"] / math.log(2) / len(prefix.encode("utf-8"))
    assert res["bits_per_byte,none"] == pytest.approx(ours, rel=0.01)


def test_word_vocabulary_with_one_character_words_exports(tmp_path):
    """PTB's vocabulary holds one-character words (a, $, &): the export's round-trip probe
    keeps them apart and ends its lines, as the converted tokenizer needs."""
    from continuumlm.data.tokenizers import WordTokenizer
    from continuumlm.hf.export import export_hf, hf_tokenizer

    tok = WordTokenizer.train("a $ & the cat sat on a mat\nN years ago\n", 100)
    assert {"a", "$", "&"} <= set(tok.vocab)
    model = small_model(vocab_size=tok.vocab_size)
    export_hf(model, tok, tmp_path / "hf", probe="the cat\na mat")
    text = "the $ cat & a\nyears ago\n"
    assert hf_tokenizer(tok).encode(text).ids == tok.encode(text)


@pytest.mark.slow
def test_harness_scores_a_word_vocabulary_with_unk(tiny_corpus, tmp_path, monkeypatch):
    """A capped word vocabulary maps rare words to <unk>: the harness scores the text the ids
    decode to (rare words spelled <unk>, as Penn Treebank's files are), which encodes back to
    the same ids, and agrees with continuumlm eval."""
    pytest.importorskip("lm_eval")
    import json

    from conftest import run_cli
    from continuumlm.config import load_config
    from continuumlm.train import Trainer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    cfg = load_config(None, ["data.dataset=text", f'data.path="{tiny_corpus}"',
                             "data.tokenizer=word", "data.vocab_size=8", "model.hidden_size=32",
                             "model.num_heads=2", "model.num_layers=1", "train.batch_size=2",
                             "train.seq_len=16", "train.max_steps=2", "train.eval_interval=2",
                             "train.eval_iters=1", "train.device=cpu"])
    Trainer(cfg, tmp_path / "run", quiet=True).run()
    r = run_cli("harness", "--checkpoint", tmp_path / "run", "--json", "--context", "16")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert abs(res["bits_per_byte_ratio"] - 1) < 0.01


def test_a_character_model_exports_without_an_end_of_text_token(tiny_corpus, tmp_path):
    """A character vocabulary defines no end-of-text token: the exported model generates to
    max_new_tokens through newlines (it stopped at the first one: its generation config names
    no end), reads a text after a newline (its bos, the harness's prefix) and pads with it.
    The tokenizer names the newline as its eos for the stock tools that read one there
    (lm-eval's generate_until, ``pad_token = eos_token``)."""
    out = exported_run(tiny_corpus, tmp_path, tokenizer="char")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    newline = tok.convert_tokens_to_ids("\n")
    assert hf.config.eos_token_id is None and hf.generation_config.eos_token_id is None
    assert tok.eos_token == "\n" and tok.eos_token_id == newline
    assert hf.config.bos_token_id == newline == tok.pad_token_id == tok.bos_token_id
    tok.pad_token = tok.eos_token  # the batching idiom keeps a pad token
    assert tok.pad_token_id == newline
    assert tok("ab")["input_ids"] == tok.convert_tokens_to_ids(["a", "b"])  # no bos added
    prompt = tok("the cat", return_tensors="pt")
    new = hf.generate(**prompt, max_new_tokens=40, do_sample=False)[0, prompt.input_ids.shape[1]:]
    assert len(new) == 40
    # the user who wants a line at a time names the newline
    line = hf.generate(**prompt, max_new_tokens=40, do_sample=False, eos_token_id=newline)
    assert line.shape[1] <= prompt.input_ids.shape[1] + 40


@pytest.mark.parametrize("mixer", ["softmax", "deltanet", "continuous"])
def test_as_draft_assists_with_a_coarser_solve_of_the_same_weights(mixer, tmp_path):
    """model.as_draft(): the same fields integrated by Euler x 1, sharing every weight, as
    transformers' assistant: greedy search's sequences, scores and logits, and the model's
    own solve untouched."""
    kw = {"components": {"deltanet": {"short_conv": 3}}} if mixer == "deltanet" else {}
    hf = saved(build(mixer, "ode", "rk4", **kw), tmp_path)
    draft = hf.as_draft("euler", 1)
    assert (draft.model.config.ode_solver, draft.model.config.ode_steps) == ("euler", 1)
    assert (hf.model.config.ode_solver, hf.model.config.ode_steps) == ("rk4", 2)
    assert all(a is b for a, b in zip(draft.parameters(), hf.parameters()))
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    greedy = _greedy_outputs(hf, prompt)
    _same_outputs(_greedy_outputs(hf, prompt, assistant_model=draft), greedy)
    assert hf.model.depth.blocks[0].solver is not draft.model.depth.blocks[0].solver
    with pytest.raises(ValueError, match="discrete model has no solve"):
        saved(build("softmax", "discrete", None), tmp_path / "d").as_draft()
    with pytest.raises(ValueError, match="adaptive"):
        hf.as_draft("dopri5")
