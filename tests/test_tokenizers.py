import pytest

from continuumlm.data.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    WordTokenizer,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)
from continuumlm.errors import DataError

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"


@pytest.mark.parametrize("kind", ["char", "word", "bpe"])
def test_round_trip_through_file(kind, tmp_path):
    tok = train_tokenizer(kind, TEXT, vocab_size=300 if kind == "bpe" else None)
    save_tokenizer(tok, tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.encode(TEXT) == tok.encode(TEXT)
    if kind == "word":  # whitespace is normalized: one space between words, \n at <eos>
        assert loaded.decode(tok.encode(TEXT)).split() == TEXT.split()
    else:
        assert loaded.decode(tok.encode(TEXT)) == TEXT


def test_char_unknown_characters_are_named():
    tok = CharTokenizer.train("abc")
    with pytest.raises(DataError, match=r"\['x', 'é'\]"):
        tok.encode("abxé")


def test_word_vocab_cap_unk_and_eos():
    tok = WordTokenizer.train("a a a b b c\nd\n", vocab_size=4)
    assert tok.vocab == ["<eos>", "<unk>", "a", "b"]
    assert tok.encode("a c\nb\n") == [2, 1, 0, 3, 0]
    assert tok.decode([2, 1, 0]) == "a <unk> \n"


def test_word_counts_match_ptb_convention():
    tok = WordTokenizer.train(" the cat \n the dog \n")
    assert len(tok.encode(" the cat \n the dog \n")) == 6  # 4 words + 2 <eos>


def test_bpe_handles_unseen_unicode():
    tok = BPETokenizer.train(TEXT * 5, vocab_size=300)
    s = "naïve café ☕"
    assert tok.decode(tok.encode(s)) == s


def test_corrupt_tokenizer_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"format": "continuumlm-tokenizer", "type": "char", "vocab": 3}')
    with pytest.raises(DataError, match="non-empty list"):
        load_tokenizer(tmp_path)


def test_bpe_refuses_text_that_is_not_unicode():
    tok = train_tokenizer("bpe", TEXT, vocab_size=300)
    with pytest.raises(DataError, match="not valid Unicode"):
        tok.encode("abc\udcff")  # how argv carries a byte that was not UTF-8


def test_bpe_encodes_as_its_saved_tokenizer_does_on_indented_text():
    """The ids of our encode must be those of the saved tokenizer.json applied to the whole
    text with the `tokenizers` library (what anyone reusing the checkpoint does), also for text
    whose lines start with spaces, where cutting at every newline changes the pre-tokens."""
    import random

    from tokenizers import Tokenizer

    rng = random.Random(0)
    words = ["def", "return", "x", "self", "if", "else:", "for", "in", "(", ")", "=", "+", "1"]
    lines = [" " * rng.choice([0, 0, 4, 8, 12]) + " ".join(rng.choices(words, k=rng.randint(1, 6)))
             for _ in range(6000)]
    text = "\n".join(lines) + "\n \n\n  \n"
    tok = BPETokenizer.train(text, 400)
    whole = Tokenizer.from_str(tok.to_json())
    for sample in (text, text[:999], "\n    return x\n", ""):
        assert tok.encode(sample) == whole.encode(sample, add_special_tokens=False).ids
