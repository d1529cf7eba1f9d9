"""Local corpora as lm-evaluation-harness datasets, split exactly as ContinuumLM splits them.

Used by the task YAMLs beside this file (``custom_dataset``); they read local files only: the
corpus is looked up as ContinuumLM looks it up ($CONTINUUMLM_DATA, then the user cache), never
downloaded. ``max_chars`` (``--metadata '{"max_chars": N}'``) keeps the first N characters of
the split, for a quick check.
"""

from __future__ import annotations


def split_text(corpus: str, split: str, max_chars: int | None = None) -> str:
    from continuumlm.config import DataConfig
    from continuumlm.data.corpora import CORPORA, resolve_file

    files = CORPORA[corpus]
    if split in files:  # a file per split (PTB)
        text = resolve_file(files[split], download=False).read_text(encoding="utf-8")
    else:  # one file cut by characters: train, then validation, then test (prepare.py's rule)
        cfg = DataConfig(dataset=corpus)
        text = resolve_file(files["all"], download=False).read_text(encoding="utf-8")
        n_train = int(len(text) * cfg.train_fraction)
        n_test = int(len(text) * cfg.test_fraction)
        bounds = {"train": (0, n_train), "val": (n_train, len(text) - n_test),
                  "test": (len(text) - n_test, len(text))}
        lo, hi = bounds[split]
        text = text[lo:hi]
    return text[:max_chars] if max_chars else text


def _one_document(corpus: str, split: str, max_chars=None):
    import datasets

    text = split_text(corpus, split, int(max_chars) if max_chars else None)
    return {"test": datasets.Dataset.from_dict({"text": [text]})}


# the harness passes the task's metadata and the model arguments as keywords
def shakespeare_val(max_chars=None, **_):
    return _one_document("tinyshakespeare", "val", max_chars)


def ptb_test(max_chars=None, **_):
    return _one_document("ptb", "test", max_chars)
