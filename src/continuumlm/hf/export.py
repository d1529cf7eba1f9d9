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
    also ends an unterminated last line with <eos>; this one does not)."""
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
    # as WordTokenizer.decode: every word followed by a space, <eos> as a newline
    out.decoder = decoders.Sequence([decoders.Replace(Regex("$"), " "),
                                     decoders.Replace(f"{tok.EOS} ", "\n"), decoders.Fuse()])
    return out


def end_of_text(tok) -> tuple[str | None, int | None]:
    """The token that ends a text, which generation stops at: BPE's <|endoftext|>, the word
    vocabulary's <eos>. A character vocabulary has none (its corpus defines no such token; a
    newline ends a line, not a text, so generation does not stop at one)."""
    if isinstance(tok, BPETokenizer):
        return (tok.EOS, tok.eos_id) if tok.eos_id is not None else (None, None)
    if isinstance(tok, WordTokenizer):
        return tok.EOS, tok.eos_id
    return None, None


def text_start(tok) -> tuple[str | None, int | None]:
    """The token a text is read after (the model's bos, the harness's prefix of its rolling
    windows): the end-of-text token, else a character vocabulary's newline (its texts are
    lines)."""
    eos = end_of_text(tok)
    if eos[1] is not None or not isinstance(tok, CharTokenizer):
        return eos
    return ("\n", tok.stoi["\n"]) if "\n" in tok.stoi else (None, None)


def special_tokens(tok) -> dict:
    """The tokenizer's named tokens. A character vocabulary names its newline as both bos and
    eos: bos, the token lm-evaluation-harness reads a text after (its prefix), never added to
    an encoding; eos, the end of text that stock tools read off the tokenizer (lm-eval's
    ``generate_until`` decodes it as a stop string, ``pad_token = eos_token`` is the batching
    idiom), while the model's generation config names none, so ``generate`` and the pipeline
    run to ``max_new_tokens`` through newlines."""
    eos, _ = end_of_text(tok)
    start, _ = text_start(tok)
    out = {"eos_token": eos} if eos is not None else {}
    if eos is None and start is not None:
        out.update(bos_token=start, eos_token=start, add_bos_token=False)
    if isinstance(tok, WordTokenizer) or getattr(tok, "unk_id", None) is not None:
        out["unk_token"] = tok.UNK
    return out


def check_round_trip(tok, hf, probe: str) -> None:
    """The converted tokenizer must encode ``probe`` as ``tok`` does (and decode it back as
    ``tok`` decodes); an ExportError otherwise."""
    from ..errors import CheckpointError

    ours, theirs = tok.encode(probe), hf.encode(probe).ids
    if ours != theirs or tok.decode(ours) != hf.decode(theirs, skip_special_tokens=False):
        raise CheckpointError(f"the {tok.kind} tokenizer does not convert to a tokenizers model "
                              f"that encodes and decodes as it does (first ids {ours[:8]} vs "
                              f"{theirs[:8]}); it cannot be exported for transformers.")


def export_hf(model, tok, out: str | Path, probe: str = "") -> Path:
    """Write ``model`` (a LanguageModel) and ``tok`` as a transformers folder ``out``:
    loadable by the Auto classes after ``import continuumlm.hf``, and by tools that never
    import it with ``trust_remote_code=True`` (``auto_map`` names two one-line modules that
    import the installed package). ``probe``: text the converted tokenizer is checked on."""
    from transformers import GenerationConfig

    from .configuration import AUTO_MAP, ContinuumLMConfig
    from .modeling import ContinuumLMForCausalLM

    out = Path(out)
    converted = hf_tokenizer(tok)
    singles = [v for v in getattr(tok, "vocab", [])[:2000] if len(v) == 1]
    if isinstance(tok, WordTokenizer):
        # words apart, and every line ended: the converted model does not add the <eos> that
        # ContinuumLM's encoder puts after an unterminated last line (a vocabulary with
        # one-character words, as PTB's, made such a line and failed the check)
        probe = probe.rstrip("\n") + "\n" + " ".join(singles) + "\n"
    else:
        probe += "".join(singles)
    check_round_trip(tok, converted, probe)
    specials = special_tokens(tok)
    _, eos = end_of_text(tok)
    _, bos = text_start(tok)
    hf = ContinuumLMForCausalLM(ContinuumLMConfig.from_model_config(
        model.config, eos_token_id=eos, bos_token_id=bos, auto_map=AUTO_MAP), model=model)
    # the pad is the end-of-text token, or none: transformers' generate, given no attention
    # mask, takes every pad id in the prompt for padding unless it is also the end of text,
    # so a character model's newline named as pad would be masked out of every prompt
    hf.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=bos,
                                            pad_token_id=eos)
    hf.save_pretrained(out)
    converted.save(str(out / "tokenizer.json"))
    # batches are padded with the end-of-text token (the model masks pads, so which id fills
    # them does not matter), on the left, where generation appends after the real tokens
    pad = specials.get("eos_token") or specials.get("bos_token") or specials.get("unk_token")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
           **({"pad_token": pad} if pad is not None else {}), "padding_side": "left",
           "model_max_length": model.config.max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
