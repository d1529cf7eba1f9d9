"""oneDNN's CPU kernels against torch's own, for decoding (continuumlm/decoding/kernels.py).

    python bench/cpu_kernels.py --runs DIR ...   # writes bench/results/cpu_kernels.json

torch sends a float32 GELU on the CPU to oneDNN whenever oneDNN is on, whatever the size; the
command line's ``generate`` and ``serve`` turn it off for a float32 model on the CPU
(``--onednn auto``). This measures why, on the trained runs given (each its best checkpoint)
and on the decoding benchmark's untrained model (4 ODE blocks of RK4 x 4, d 128, RoPE):

- decoding, greedy, 8-token prompts, as many new tokens as the model's positions leave (at
  most 248; 64 at batch 32): batch 1 through the lean step (the decoder's default), batch 1 through the
  decoding pass (``Decoder(lean=False)``), batch 8 and batch 32 (``serve``'s default most);
  tokens/s with oneDNN on and off, timed alternately in one process (the median of 5 each), on
  torch's threads for the run;
- a prompt's one pass (as many tokens as the positions allow, at most 512): tokens/s;
- GELU alone on rows of 512 (an MLP's width here) from 1 to 8,192: microseconds per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import machine, markdown_table, write_json
from speculative import benchmark_model

from continuumlm.decoding import Decoder

REPEATS = 5
ROWS = (1, 8, 64, 1024, 8192)


def _rate(decoder: Decoder, idx: torch.Tensor, new: int) -> float:
    t0 = time.perf_counter()
    decoder.generate(idx, new, greedy=True)
    return idx.shape[0] * new / (time.perf_counter() - t0)


def decoding_rows(name: str, model) -> list[dict]:
    new = min(248, model.config.max_seq_len - 8)
    rows = []
    for label, batch, lean in (("batch 1, lean step", 1, True),
                               ("batch 1, decoding pass", 1, False),
                               ("batch 8, decoding pass", 8, False),
                               ("batch 32, decoding pass", 32, False)):
        decoder = Decoder(model, lean=lean)
        n = new if batch < 32 else min(new, 64)  # the rate is what is read; a shorter run
        idx = torch.randint(0, model.config.vocab_size, (batch, 8),
                            generator=torch.Generator().manual_seed(0))
        rates = {True: [], False: []}
        for on in (True, False):  # warm both
            torch.backends.mkldnn.enabled = on
            _rate(decoder, idx, 16)
        for _ in range(REPEATS):
            for on in (True, False):
                torch.backends.mkldnn.enabled = on
                rates[on].append(_rate(decoder, idx, n))
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        rows.append({"model": name, "decoding": label, "new_tokens": n,
                     "onednn_tok_s": round(on, 1), "own_tok_s": round(off, 1),
                     "speedup": round(off / on, 3)})
    # a prompt's one pass (as long as the positions allow, at most 512 tokens): the rows
    # where oneDNN's GELU is the faster one
    length = min(512, model.config.max_seq_len)
    idx = torch.randint(0, model.config.vocab_size, (1, length),
                        generator=torch.Generator().manual_seed(0))
    ms = {True: [], False: []}
    for _ in range(REPEATS + 1):  # the first of each warms
        for on in (True, False):
            torch.backends.mkldnn.enabled = on
            t0 = time.perf_counter()
            model(idx)
            ms[on].append((time.perf_counter() - t0) * 1e3)
    on, off = statistics.median(ms[True][1:]), statistics.median(ms[False][1:])
    rows.append({"model": name, "decoding": f"a {length}-token prompt's pass",
                 "onednn_tok_s": round(length / on * 1e3, 1),
                 "own_tok_s": round(length / off * 1e3, 1), "speedup": round(on / off, 3)})
    return rows


def gelu_rows() -> list[dict]:
    rows = []
    for n in ROWS:
        x = torch.randn(n, 512)
        calls = max(20, 20000 // n)
        us = {}
        for on in (True, False):
            torch.backends.mkldnn.enabled = on
            for _ in range(10):
                F.gelu(x)
            samples = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                for _ in range(calls):
                    F.gelu(x)
                samples.append((time.perf_counter() - t0) / calls * 1e6)
            us[on] = statistics.median(samples)
        rows.append({"rows": n, "onednn_us": round(us[True], 2), "own_us": round(us[False], 2),
                     "speedup": round(us[True] / us[False], 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", nargs="*", default=[], metavar="DIR",
                    help="trained run folders (each its best checkpoint)")
    ap.add_argument("--out", default="cpu_kernels")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    from continuumlm.runs import load_model_and_tokenizer

    decoding = []
    was = torch.backends.mkldnn.enabled
    try:
        for run in args.runs:
            model, _, _ = load_model_and_tokenizer(run, "best")
            decoding += decoding_rows(Path(run).name, model.eval())
        decoding += decoding_rows("untrained (4 ODE blocks of RK4 x 4, d 128, RoPE)",
                                  benchmark_model())
        gelu = gelu_rows()
    finally:
        torch.backends.mkldnn.enabled = was
    command = "python bench/cpu_kernels.py" + (" --runs " + " ".join(args.runs)
                                               if args.runs else "")
    table = markdown_table(decoding, [("model", "model"), ("decoding", "decoding"),
                                      ("onednn_tok_s", "oneDNN on, tok/s"),
                                      ("own_tok_s", "oneDNN off, tok/s"),
                                      ("speedup", "off / on")])
    write_json(args.out, {
        "command": command,
        "setup": (f"greedy, 8-token prompts, oneDNN on and off timed alternately in one "
                  f"process, the median of {REPEATS} each; GELU on rows of 512; {machine()}"),
        "decoding": decoding, "gelu": gelu, "table": table,
        "gelu_table": markdown_table(gelu, [("rows", "rows"),
                                            ("onednn_us", "oneDNN on, us"),
                                            ("own_us", "oneDNN off, us"),
                                            ("speedup", "on / off")]),
        "load_average": [round(x, 2) for x in os.getloadavg()[:2]]})
    print(table)


if __name__ == "__main__":
    main()
