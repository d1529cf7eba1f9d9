"""Unigram and bigram (add-one / Laplace) perplexity references for PTB, with the vocabulary and
tokenization of configs/ptb/*.toml, fitted on the training split and scored on the validation
and test streams (every token; the bigram's first token is scored by the unigram).

    python bench/ngram_ref.py            # writes bench/results/ptb-ngram.json
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from common import ROOT, markdown_table, write_json

from continuumlm import load_config
from continuumlm.data import prepare_data


def laplace_perplexities(train: torch.Tensor, stream: torch.Tensor, V: int) -> dict:
    uni = torch.bincount(train, minlength=V).double()
    p_uni = (uni + 1) / (uni.sum() + V)
    pair = torch.zeros(V * V, dtype=torch.float64)
    pair.index_add_(0, train[:-1] * V + train[1:], torch.ones(len(train) - 1, dtype=torch.float64))
    prev = torch.bincount(train[:-1], minlength=V).double()
    nll_uni = -torch.log(p_uni[stream]).sum().item()
    p_bi = (pair[stream[:-1] * V + stream[1:]] + 1) / (prev[stream[:-1]] + V)
    nll_bi = -torch.log(p_uni[stream[:1]]).sum().item() - torch.log(p_bi).sum().item()
    n = len(stream)
    return {"unigram_ppl": math.exp(nll_uni / n), "bigram_ppl": math.exp(nll_bi / n),
            "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(ROOT / "configs" / "ptb" / "transformer.toml"))
    args = ap.parse_args()
    cfg = load_config(args.config)
    data = prepare_data(cfg.data)
    V = data.tokenizer.vocab_size
    rows = []
    for split in ("val", "test"):
        if split in data.splits:
            # the prepared splits are memmaps of uint16/uint32 ids: int64 tensors here
            train, stream = (torch.from_numpy(np.asarray(data.splits[s], dtype=np.int64))
                             for s in ("train", split))
            r = laplace_perplexities(train, stream, V)
            rows.append({"split": split, **r})
    table = markdown_table(rows, [("split", "split"), ("unigram_ppl", "unigram ppl (Laplace)"),
                                  ("bigram_ppl", "bigram ppl (Laplace)"), ("tokens", "tokens")])
    print(table)
    write_json("ptb-ngram", {"command": "python bench/ngram_ref.py", "vocab_size": V,
                             "setup": f"word tokenizer of configs/ptb (vocabulary {V} incl. "
                                      f"<unk>), counts from PTB's train file", "rows": rows,
                             "table": table})


if __name__ == "__main__":
    main()
