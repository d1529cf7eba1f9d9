"""``continuumlm export --hf OUT``: a checkpoint as a folder every transformers tool reads:
``config.json`` (model_type continuumlm), ``model.safetensors``, ``generation_config.json``,
and the tokenizer as a ``tokenizers`` file with its ``tokenizer_config.json``, so that
``AutoTokenizer`` (and lm-evaluation-harness, which loads both) encode as ContinuumLM does."""

from __future__ import annotations

import json
from pathlib import Path

from ..data.tokenizers import BPETokenizer, CharTokenizer, WordTokenizer


def hf_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` that encodes as ``tok``: byte-level BPE is one already; a char
    vocabulary becomes a WordLevel model over single characters; a word vocabulary a WordLevel
    model over whitespace words with every newline read as <eos> (ContinuumLM's own encoder
    also ends an unterminated last line with <eos>; this one does not, and it decodes to the
    words joined by spaces, <eos> included)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if isinstance(tok, BPETokenizer):
        return Tokenizer.from_str(tok.to_json())
    vocab = {t: i for i, t in enumerate(tok.vocab)}
    if isinstance(tok, CharTokenizer):
        unk = tok.UNK if tok.unk_id is not None else None
        out = Tokenizer(models.WordLevel(vocab, unk_token=unk) if unk else models.WordLevel(vocab))
        out.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        out.decoder = decoders.Fuse()
        return out
    assert isinstance(tok, WordTokenizer)
    out = Tokenizer(models.WordLevel(vocab, unk_token=tok.UNK))
    out.normalizer = normalizers.Replace("\n", f" {tok.EOS} ")
    out.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return out  # decodes to words joined by spaces, <eos> as it is


def special_tokens(tok) -> dict:
    if isinstance(tok, BPETokenizer):
        return {"eos_token": tok.EOS} if tok.eos_id is not None else {}
    if isinstance(tok, WordTokenizer):
        return {"eos_token": tok.EOS, "unk_token": tok.UNK}
    return {"unk_token": tok.UNK} if tok.unk_id is not None else {}


def export_hf(model, tok, out: str | Path) -> Path:
    """Write ``model`` (a LanguageModel) and ``tok`` as a transformers folder ``out``."""
    from transformers import GenerationConfig

    from .configuration import ContinuumLMConfig
    from .modeling import ContinuumLMForCausalLM

    out = Path(out)
    specials = special_tokens(tok)
    eos = tok.eos_id
    hf = ContinuumLMForCausalLM(ContinuumLMConfig.from_model_config(
        model.config, eos_token_id=eos, bos_token_id=eos), model=model)
    hf.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=eos,
                                            pad_token_id=eos if eos is not None else 0)
    hf.save_pretrained(out)
    hf_tokenizer(tok).save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
           "model_max_length": model.config.max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
