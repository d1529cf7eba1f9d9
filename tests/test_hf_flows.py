"""Everyday transformers flows on the adapter, end to end: padded batches (forward and
left-padded generation equal to each row alone), beam search through the cache equal to beam
search without it, hidden states, tuples, input embeddings, embedding resizing, loading
conventions, gradient checkpointing, meta-device initialization, complete saves that reload
in a fresh process with and without remote code, pipeline, Trainer with saves and resume,
a PEFT LoRA adapter, bfloat16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import continuumlm.hf  # noqa: E402,F401  (registers the model type)
from continuumlm.errors import CheckpointError  # noqa: E402
from continuumlm.hf import ContinuumLMConfig, ContinuumLMForCausalLM  # noqa: E402
from continuumlm.registry import MIXERS  # noqa: E402
from continuumlm.testing import small_model  # noqa: E402
from test_hf import exported_run  # noqa: E402  (trains and exports a small run)

PADDED = [m for m in sorted(MIXERS) if getattr(MIXERS.component_class(m), "supports_padding",
                                               False)]
DEPTHS = [dict(depth="discrete", num_layers=2),
          dict(depth="ode", num_layers=1, ode_solver="rk4", ode_steps=2, field="sequential")]
V = 37


def hf_model(mixer="softmax", depth=DEPTHS[0], **kw) -> ContinuumLMForCausalLM:
    lm = small_model(mixer=mixer, **depth, **kw)
    return ContinuumLMForCausalLM(ContinuumLMConfig.from_model_config(lm.config), model=lm).eval()


def left_padded(seqs, pad=0):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):], mask[i, L - len(s):] = s, 1
    return ids, mask


def rows(n=(7, 3, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (k,), generator=g) for k in n]


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
@pytest.mark.parametrize("mixer", PADDED)
def test_padded_batches_equal_rows_alone(mixer, depth):
    hf = hf_model(mixer, depth, position="rope" if mixer == "softmax" else "none")
    seqs = rows()
    ids, mask = left_padded(seqs)
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = hf(input_ids=s[None]).logits[0]
            torch.testing.assert_close(out[i, ids.shape[1] - len(s):], alone, rtol=0, atol=1e-5)
    # left-padded batched generation: each row as if generated alone
    gen = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                      pad_token_id=0)
    for i, s in enumerate(seqs):
        alone = hf.generate(s[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert gen[i, ids.shape[1]:].tolist() == alone[0, len(s):].tolist()


@pytest.mark.parametrize("mixer, depth", [(m, d) for m in sorted(MIXERS) for d in DEPTHS],
                         ids=lambda v: v if isinstance(v, str) else v["depth"])
def test_beam_search_through_the_cache_equals_without(mixer, depth):
    hf = hf_model(mixer, depth)
    x = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    cached = hf.generate(x, use_cache=True, **kw)
    recomputed = hf.generate(x, use_cache=False, **kw)
    assert cached.sequences.tolist() == recomputed.sequences.tolist()
    torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores,
                               rtol=0, atol=1e-4)
    assert cached.sequences.shape[0] == 4


def test_beam_search_with_left_padding_equals_rows_alone():
    hf = hf_model("deltanet", DEPTHS[1])
    seqs = rows((6, 3))
    ids, mask = left_padded(seqs)
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    out = hf.generate(ids, attention_mask=mask, **kw)
    for i, s in enumerate(seqs):
        assert out[i, ids.shape[1]:].tolist() == hf.generate(s[None], **kw)[0, len(s):].tolist()


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_greedy_dict_outputs_with_and_without_the_cache(mixer):
    """What transformers' generation tests check of greedy search: sequences, scores, logits
    and hidden states of a dict output, equal with and without the cache."""
    hf = hf_model(mixer, DEPTHS[1])
    x = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True, output_logits=True, output_hidden_states=True)
    a, b = (hf.generate(x, use_cache=c, **kw) for c in (True, False))
    assert a.sequences.tolist() == b.sequences.tolist() and a.sequences.shape == (2, 9)
    assert len(a.scores) == len(a.logits) == len(a.hidden_states) == 4
    for sa, sb, la, lb in zip(a.scores, b.scores, a.logits, b.logits):
        torch.testing.assert_close(sa, sb, rtol=0, atol=1e-5)
        torch.testing.assert_close(la, lb, rtol=0, atol=1e-5)
    n = hf.config.num_hidden_layers + 1
    # the prompt's step holds every prompt position; later steps the one new token (cached)
    assert [h.shape[1] for h in a.hidden_states[0]] == [5] * n
    assert [h.shape[1] for h in a.hidden_states[1]] == [1] * n
    torch.testing.assert_close(a.hidden_states[1][-1][:, -1], b.hidden_states[1][-1][:, -1],
                               rtol=0, atol=1e-5)


def test_sampling_with_and_without_the_cache_agree():
    hf = hf_model("softmax", DEPTHS[1])
    x = torch.randint(1, V, (2, 4), generator=torch.Generator().manual_seed(4))
    outs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        outs.append(hf.generate(x, do_sample=True, top_k=10, max_new_tokens=8, pad_token_id=0,
                                use_cache=use_cache).tolist())
    assert outs[0] == outs[1]


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
def test_hidden_states_tuples_and_input_embeddings(depth):
    hf = hf_model("softmax", depth)
    x = torch.randint(1, V, (2, 6))
    out = hf(input_ids=x, output_hidden_states=True, labels=x)
    n = hf.config.num_hidden_layers
    assert len(out.hidden_states) == n + 1
    torch.testing.assert_close(out.logits, hf.model.lm_head(out.hidden_states[-1]))
    # the first is the embedding output; a later one is what the next layer reads
    torch.testing.assert_close(out.hidden_states[0], hf.model.tok_emb(x))
    loss, logits, *_ = hf(input_ids=x, labels=x, return_dict=False)
    assert torch.is_tensor(loss) and torch.equal(logits, out.logits)
    by_embeds = hf(inputs_embeds=hf.get_input_embeddings()(x)).logits
    torch.testing.assert_close(by_embeds, out.logits, rtol=0, atol=0)
    gen = hf.generate(inputs_embeds=hf.model.tok_emb(x), max_new_tokens=3, do_sample=False,
                      pad_token_id=0)
    assert gen.tolist() == hf.generate(x, max_new_tokens=3, do_sample=False,
                                       pad_token_id=0)[:, 6:].tolist()
    g = hf.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0,
                    output_hidden_states=True, return_dict_in_generate=True)
    assert len(g.hidden_states) == 2 and len(g.hidden_states[0]) == n + 1


def test_resize_token_embeddings_saves_and_reloads(tmp_path):
    hf = hf_model("softmax")
    hf.resize_token_embeddings(V + 5)
    assert hf.model.config.vocab_size == V + 5 == hf.config.vocab_size
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight  # still tied
    x = torch.randint(0, V + 5, (1, 6))
    hf.save_pretrained(tmp_path / "m")
    again = ContinuumLMForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(again(input_ids=x).logits, hf(input_ids=x).logits)


def test_loading_conventions(tmp_path):
    hf = hf_model("deltanet")
    hf.save_pretrained(tmp_path / "m")
    model, info = ContinuumLMForCausalLM.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(),
                    "error_msgs": []}
    x = torch.randint(0, V, (1, 5))
    built = ContinuumLMForCausalLM.from_pretrained(None, config=hf.config,
                                                   state_dict=hf.state_dict())
    torch.testing.assert_close(built(input_ids=x).logits, hf(input_ids=x).logits)
    with pytest.raises(CheckpointError, match="missing tensors"):
        ContinuumLMForCausalLM.from_pretrained(None, config=hf.config, state_dict={})
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta device context"):
        ContinuumLMForCausalLM.from_pretrained(tmp_path / "m")
    b16 = ContinuumLMForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    assert b16.model.tok_emb.weight.dtype == torch.bfloat16
    assert b16.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 8)


def test_a_model_made_on_meta_initializes_like_a_fresh_one():
    hf = hf_model("softmax", position="rope")
    with torch.device("meta"):
        empty = ContinuumLMForCausalLM(hf.config)
    empty.to_empty(device="cpu")
    empty.init_weights()
    fresh = dict(hf.named_buffers())
    for name, buf in empty.named_buffers():
        assert torch.equal(buf, fresh[name]), name
    for p in empty.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("depth", DEPTHS, ids=["discrete", "ode"])
def test_gradient_checkpointing_keeps_the_gradients(depth):
    hf = hf_model("softmax", depth, dropout=0.1).train()
    x = torch.randint(0, V, (2, 8))

    def grads():
        torch.manual_seed(0)
        hf.zero_grad()
        hf(input_ids=x, labels=x).loss.backward()
        return {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    plain = grads()
    hf.gradient_checkpointing_enable()
    assert hf.is_gradient_checkpointing
    calls = []
    layer = next(m for m in hf.modules() if getattr(m, "gradient_checkpointing", False))
    real = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda fn, *a: calls.append(1) or real(fn, *a)
    checkpointed = grads()
    assert calls, "the checkpointing function was never called"
    assert plain.keys() == checkpointed.keys()
    for n in plain:
        torch.testing.assert_close(checkpointed[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    hf.gradient_checkpointing_disable()
    assert not hf.is_gradient_checkpointing


@pytest.mark.slow
def test_save_after_remote_code_load_is_complete_in_a_fresh_process(tmp_path):
    """Export, load with trust_remote_code in a process that never imports continuumlm.hf,
    save again there, and load that with trust_remote_code in another fresh process."""
    from continuumlm.hf.configuration import AUTO_MAP, REMOTE_CODE

    hf = hf_model("softmax")
    hf.config.eos_token_id = 3
    hf.save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["auto_map"] == AUTO_MAP
    for name in REMOTE_CODE:
        assert (tmp_path / "a" / name).is_file()
    x = torch.randint(0, V, (1, 6))
    ref = hf(input_ids=x).logits[0, -1].tolist()
    script = f"""
import json, sys, torch
from transformers import AutoModelForCausalLM
src, dst = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(src, trust_remote_code=True)
assert any(k.startswith("transformers_modules") for k in sys.modules)  # remote code ran
if dst != "-":
    m.save_pretrained(dst)
print(json.dumps(m(input_ids=torch.tensor({x.tolist()})).logits[0, -1].tolist()))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for src, dst in (("a", "b"), ("b", "-")):
        run = subprocess.run([sys.executable, "-c", script, str(tmp_path / src),
                              dst if dst == "-" else str(tmp_path / dst)],
                             capture_output=True, text=True, env=env, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        torch.testing.assert_close(torch.tensor(json.loads(run.stdout.splitlines()[-1])),
                                   torch.tensor(ref), rtol=0, atol=1e-5)
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP and saved["eos_token_id"] == 3
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", *REMOTE_CODE])


def test_a_failed_save_leaves_nothing_half_written(tmp_path, monkeypatch):
    hf = hf_model("softmax")
    import safetensors.torch

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_model", broken)
    with pytest.raises(OSError, match="disk full"):
        hf.save_pretrained(tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_pipeline_single_and_batched(tiny_corpus, tmp_path):
    out = exported_run(tiny_corpus, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.pad_token is not None and tok.padding_side == "left"
    pipe = transformers.pipeline("text-generation", model=str(out), tokenizer=tok)
    prompts = ["the cat", "alpha beta gamma delta", "a"]
    kw = dict(max_new_tokens=5, do_sample=False, return_full_text=False)
    one = [pipe(p, **kw)[0]["generated_text"] for p in prompts]
    batched = [r[0]["generated_text"] for r in pipe(prompts, batch_size=3, **kw)]
    assert batched == one


def test_trainer_fine_tunes_saves_and_resumes(tmp_path):
    hf = hf_model("deltanet", DEPTHS[1])
    data = [{"input_ids": torch.randint(1, V, (8,)).tolist()} for _ in range(16)]
    for d in data:
        d["labels"] = d["input_ids"]

    def trainer(steps, out):
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
            save_steps=2, logging_steps=1, report_to=[], use_cpu=True, seed=0,
            learning_rate=1e-3, save_total_limit=5)
        return transformers.Trainer(model=hf, args=args, train_dataset=data)

    before = hf.model.tok_emb.weight.detach().clone()
    trainer(4, tmp_path / "t").train()
    assert not torch.equal(before, hf.model.tok_emb.weight)
    ckpt = tmp_path / "t" / "checkpoint-4"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
    again = ContinuumLMForCausalLM.from_pretrained(ckpt)
    x = torch.randint(1, V, (1, 6))
    hf.eval()
    torch.testing.assert_close(again(input_ids=x).logits, hf(input_ids=x).logits)
    trainer(6, tmp_path / "t").train(resume_from_checkpoint=str(ckpt))
    assert (tmp_path / "t" / "checkpoint-6" / "model.safetensors").is_file()


def test_peft_lora_trains_and_merges():
    peft = pytest.importorskip("peft")
    hf = hf_model("softmax").train()
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv"],
                                                   lora_dropout=0.0))
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(1, V, (4, 8))
    losses = []
    for _ in range(5):
        loss = lora(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lora.eval()
    with torch.no_grad():
        adapted = lora(input_ids=x).logits
        merged = lora.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=x).logits, adapted, rtol=1e-4, atol=1e-4)
    assert isinstance(merged, ContinuumLMForCausalLM)


def test_lm_eval_gives_the_same_answers_at_batch_size_8(tiny_corpus, tmp_path):
    """lm-evaluation-harness's HFLM: multiple-choice log-likelihoods (right-padded batches)
    and generate_until (left-padded batches through generate) per document equal at batch
    sizes 1 and 8."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    out = exported_run(tiny_corpus, tmp_path)
    lines = tiny_corpus.read_text().splitlines()[:10]
    choices = [Instance("loglikelihood", {}, (line[:9], c), i)
               for i, line in enumerate(lines) for c in (line[9:20], " the mat", " a")]
    gens = [Instance("generate_until", {}, (line[:4 + i], {"until": ["\n"], "max_gen_toks": 6,
                                                          "do_sample": False}), i)
            for i, line in enumerate(lines)]
    answers = {}
    for bs in (1, 8):
        harness = HFLM(pretrained=str(out), batch_size=bs, device="cpu")
        answers[bs] = (harness.loglikelihood(choices, disable_tqdm=True),
                       harness.generate_until(gens, disable_tqdm=True))
    (ll1, gen1), (ll8, gen8) = answers[1], answers[8]
    assert gen8 == gen1
    assert [g for _, g in ll8] == [g for _, g in ll1]
    torch.testing.assert_close(torch.tensor([x for x, _ in ll8]),
                               torch.tensor([x for x, _ in ll1]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mixer, depth", [("softmax", DEPTHS[0]), ("deltanet", DEPTHS[1]),
                                          ("continuous", DEPTHS[0])],
                         ids=["softmax-discrete", "deltanet-ode", "continuous-discrete"])
def test_torch_export_traces_a_padded_forward(mixer, depth):
    """No data-dependent check stops torch.export; the exported program computes the same."""
    hf = hf_model(mixer, depth, position="rope" if mixer == "softmax" else "none")
    x = torch.randint(1, V, (2, 6))
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    kw = {"input_ids": x, "attention_mask": mask, "use_cache": False}
    program = torch.export.export(hf, args=(), kwargs=kw)
    out = program.module()(**kw)
    torch.testing.assert_close(out.logits if hasattr(out, "logits") else out[0],
                               hf(**kw).logits, rtol=0, atol=1e-6)


def test_padding_keeps_the_autocast_precision():
    """Under bf16 autocast a padded DeltaNet row equals the row alone (the pad masks do not
    promote its projections to float32)."""
    hf = hf_model("deltanet", DEPTHS[0])
    seqs = rows((6, 3))
    ids, mask = left_padded(seqs)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = hf(input_ids=ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = hf(input_ids=s[None]).logits[0]
            torch.testing.assert_close(out[i, ids.shape[1] - len(s):], alone, rtol=0, atol=0)


def test_a_wrapped_model_pickles_and_wrapping_builds_no_second_model(tmp_path, monkeypatch):
    import pickle

    from continuumlm.model import lm as lm_module

    hf = hf_model("softmax", DEPTHS[1])
    again = pickle.loads(pickle.dumps(hf))
    x = torch.randint(0, V, (1, 5))
    torch.testing.assert_close(again(input_ids=x).logits, hf(input_ids=x).logits)
    pickle.dumps(hf.model)  # the LanguageModel it wraps too
    built = []
    real = lm_module.LanguageModel.__init__

    def counting(self, cfg):
        built.append(cfg)
        real(self, cfg)

    monkeypatch.setattr(lm_module.LanguageModel, "__init__", counting)
    hf.save_pretrained(tmp_path / "m")
    ContinuumLMForCausalLM.from_pretrained(tmp_path / "m")
    assert len(built) == 1  # the loaded model only, no throwaway initialization copy
    mode = (tmp_path / "m").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask  # readable as any folder the user makes


def test_continuous_attention_refuses_positions_other_than_its_own():
    hf = hf_model("continuous")
    x = torch.randint(1, V, (1, 8))
    with pytest.raises(ValueError, match="position_ids"):
        hf(input_ids=x, position_ids=torch.arange(4, 12)[None])
    hf(input_ids=x, position_ids=torch.arange(8)[None])  # the usual ones are fine


def test_the_decoding_state_is_named_as_the_installed_transformers_names_it():
    """transformers 5.24 renamed the output field and keyword past_key_values to cache (the
    old name a deprecated alias); the adapter returns the state under the installed release's
    field, and takes either keyword (the GPU machine's 5.17 has only past_key_values)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from continuumlm.hf import ContinuumLMCache
    from continuumlm.hf.modeling import CACHE_FIELD

    assert CACHE_FIELD in CausalLMOutputWithPast.__dataclass_fields__
    hf = hf_model("softmax")
    x = torch.randint(0, V, (1, 5))
    out = hf(input_ids=x)
    state = getattr(out, CACHE_FIELD)
    assert isinstance(state, ContinuumLMCache) and state.get_seq_length() == 5
    for name in ("cache", "past_key_values"):
        nxt = hf(input_ids=x[:, :1], **{name: state})
        assert getattr(nxt, CACHE_FIELD) is state and state.get_seq_length() == 6 + (
            name == "past_key_values")


_STOCK_TASKS = """\
task: stock_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
---
task: stock_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


@pytest.mark.slow
def test_stock_lm_eval_runs_generate_until_on_a_character_model(tiny_corpus, tmp_path):
    """lm-evaluation-harness's own command line (``lm_eval --model hf``, trust_remote_code) on
    an exported character model: a generate_until task (it ended in "TypeError: 'None' is not
    an instance of 'Sequence'": lm-eval decodes the tokenizer's eos as its stop string) and a
    log-likelihood task, each sample's answer the same at batch sizes 1 and 8."""
    pytest.importorskip("lm_eval")
    out = exported_run(tiny_corpus, tmp_path, tokenizer="char")
    lines = [x for x in tiny_corpus.read_text().splitlines() if len(x) > 12][:10]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"prompt": x[:4 + i], "answer": x[4 + i:8 + i],
                                        "choices": [x[4 + i:10], " the mat", " a"]}) + "\n"
                            for i, x in enumerate(lines)))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for i, doc in enumerate(_STOCK_TASKS.format(data=data).split("---\n")):
        (tasks / f"stock_{i}.yaml").write_text(doc)
    exe = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    samples = {}
    for bs in (1, 8):
        r = subprocess.run([exe, "--model", "hf", "--model_args",
                            f"pretrained={out},trust_remote_code=True", "--tasks",
                            "stock_gen,stock_choice", "--include_path", str(tasks), "--device",
                            "cpu", "--batch_size", str(bs), "--log_samples", "--output_path",
                            str(tmp_path / f"out{bs}")], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                             "HF_DATASETS_OFFLINE": "1",
                                             "HF_HOME": str(tmp_path / "hf_home")})
        assert r.returncode == 0, r.stderr[-3000:]
        got = {}
        for f in sorted((tmp_path / f"out{bs}").rglob("samples_*.jsonl")):
            rows = [json.loads(x) for x in f.read_text().splitlines()]
            got[f.name.split("_20")[0]] = [(row["doc_id"], row["resps"]) for row in rows]
        assert len(got) == 2, got.keys()
        samples[bs] = got
    gen = next(v for k, v in samples[1].items() if "stock_gen" in k)
    assert len(gen) == len(lines) and all(isinstance(r[0][0], str) for _, r in gen)
    for k, rows in samples[1].items():
        other = samples[8][k]
        if "stock_gen" in k:
            assert other == rows
        else:  # log-likelihoods: the same to float tolerance, the same greedy flags
            for (d1, r1), (d8, r8) in zip(rows, other):
                assert d1 == d8
                for a, b in zip(r1, r8):
                    assert abs(float(a[0][0]) - float(b[0][0])) < 1e-4 and a[0][1] == b[0][1]


def test_the_pipeline_batches_a_character_model_with_the_eos_pad_idiom(tiny_corpus, tmp_path):
    """``pipe.tokenizer.pad_token = pipe.tokenizer.eos_token``, the everyday batching idiom,
    keeps a pad token on an exported character model, and the batched pipeline gives each
    prompt what it gives alone, max_new_tokens long (no end token stops it)."""
    import transformers

    out = exported_run(tiny_corpus, tmp_path, tokenizer="char")
    pipe = transformers.pipeline("text-generation", model=str(out), trust_remote_code=True,
                                 device="cpu")
    pipe.tokenizer.pad_token = pipe.tokenizer.eos_token
    assert pipe.tokenizer.pad_token_id is not None
    prompts = ["the c", "a", "the mat "]
    kw = dict(max_new_tokens=20, do_sample=False, return_full_text=False)
    alone = [pipe(p, **kw)[0]["generated_text"] for p in prompts]
    batched = [r[0]["generated_text"] for r in pipe(prompts, batch_size=3, **kw)]
    assert batched == alone
    ids = pipe.tokenizer(prompts[0], return_tensors="pt").input_ids
    new = pipe.model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    assert len(new) == 20


def test_generate_without_a_mask_reads_a_character_models_newlines(tiny_corpus, tmp_path):
    """``model.generate(ids)`` with no attention mask, on a prompt holding newlines: the
    tokens are ContinuumLM's own greedy decoding. (transformers infers a mask from the pad id
    when it is not the end of text; a character model whose newline was its pad lost every
    newline of its prompts that way.)"""
    import transformers

    from continuumlm.runs import load_model_and_tokenizer

    out = exported_run(tiny_corpus, tmp_path, tokenizer="char")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours, tok, _ = load_model_and_tokenizer(tmp_path / "run", "last")
    ids = torch.tensor([tok.encode("the cat\nsat on\na mat\n")])
    assert (ids == tok.encode("\n")[0]).sum() == 3
    got = hf.generate(ids, max_new_tokens=30, do_sample=False, output_logits=True,
                      return_dict_in_generate=True)
    assert torch.equal(got.sequences, ours.generate(ids, 30, greedy=True))
    with torch.no_grad():  # the first token's logits: the whole prompt read, newlines too
        want = ours(ids)[0][0, -1]
    assert torch.allclose(got.logits[0][0], want, atol=1e-4)
