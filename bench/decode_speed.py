"""Decoding speed: cached incremental decoding vs full recompute, eager and compiled.

    python bench/decode_speed.py         # writes bench/results/decode_speed.json
    python bench/decode_speed.py --rates # eager and compiled tokens/s only, printed

4 ODE blocks (sequential field) integrated with 4 classical RK4 steps each (NFE 64 per
token), d=128, 4 heads, RoPE, batch 1, prompt 64 tokens; softmax and DeltaNet mixers; greedy
decoding. Recompute and cached decoding are both timed over 512 new tokens; cached decoding is
also timed over 2048. Recomputing 2048 new tokens would take the better part of an hour, so its
rate is estimated: the sum of one recomputed token's time (a full forward of the sequence so
far) over the 2048 lengths, timed at 9 evenly spaced lengths and interpolated linearly between
them, scaled by what the same sampling gets wrong at 512 new tokens, where the whole loop is
also timed (estimate = measured 512 rate x sampled 2048 rate / sampled 512 rate; the sampling
leaves out the loop's own costs, and this machine's speed drifts between parts of a run).
Per-token times at positions 128 and 2048 show whether a step's cost grows with the context.

The operations per field evaluation are counted by torch.profiler over one cached token: the
top-level aten operations (those not called by another aten operation), divided by the token's
field evaluations.

Cached decoding is timed eager (``model.generate``) and compiled (``model.generate(...,
compile=True)``: one torch.compile graph of one solver step, serving every step of every block
at every capacity, with inductor's C++ wrapper around its kernels; and once more with the
default Python wrapper, for comparison). Compiled tokens/s time a second generation of the
same length (the graph already built). What a user pays is timed as whole processes (Python start, imports, model
build, 512 new tokens): eager; compiled with an empty compiler cache of its own (cold); and
compiled again with the cache that cold process filled (warm: a second run of ``continuumlm
generate --compile``). From those, the number of new tokens from which compiling pays.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

# a compiler cache of this run's own, empty at first (the warm-cache child process reuses it)
if "DECODE_SPEED_WARM_CHILD" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode_speed_inductor_")
import torch  # noqa: E402
from common import markdown_table, write_json  # noqa: E402

from continuumlm import LanguageModel, ModelConfig  # noqa: E402


def build(mixer: str) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=4,
                                     max_seq_len=256, mixer=mixer, depth="ode",
                                     field="sequential", ode_solver="rk4", ode_steps=4)).eval()


def tokens_per_s(m, prompt, n, use_cache, compile=False) -> float:
    t0 = time.perf_counter()
    m.generate(prompt, n, greedy=True, use_cache=use_cache, compile=compile)
    return n / (time.perf_counter() - t0)


def compiled_tokens_per_s(m, prompt, n) -> tuple[float, float]:
    """(tokens/s once compiled, seconds of the first call, which compiles)."""
    t0 = time.perf_counter()
    m.generate(prompt, n, greedy=True, compile=True)
    first = time.perf_counter() - t0
    return tokens_per_s(m, prompt, n, True, compile=True), first


def python_wrapper_tokens_per_s(m, prompt, n) -> float:
    """Compiled tokens/s with inductor's default Python wrapper around the kernels instead of
    the C++ one that compiled decoding uses on CPU (the comparison behind that choice)."""
    from continuumlm.decoding import Compiled, Decoder

    torch._dynamo.reset()
    try:
        decoder = Decoder(m, compile=Compiled("cpu", options={}))
        decoder.generate(prompt, n, greedy=True)  # compiles
        t0 = time.perf_counter()
        decoder.generate(prompt, n, greedy=True)
        return n / (time.perf_counter() - t0)
    finally:
        torch._dynamo.reset()


def process_s(mixer: str, n: int, compile: bool, cache_dir: str | None = None) -> float:
    """Wall seconds of a whole new process that builds the model and generates ``n`` tokens
    after the 64-token prompt (eager, or compiled with ``cache_dir`` as its compiler cache:
    empty, a cold start; filled by an earlier process, a warm one)."""
    code = (f"import torch, decode_speed as d; m = d.build({mixer!r}); "
            f"p = torch.randint(0, 65, (1, 64)); "
            f"m.generate(p, {n}, greedy=True, compile={compile!r})")
    env = {**os.environ, "DECODE_SPEED_WARM_CHILD": "1"}
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def pays_from(eager_s: float, compiled_s: float, eager_tok_s: float, compiled_tok_s: float,
              n: int) -> int | None:
    """New tokens from which a compiled process is faster than an eager one: the extra
    set-up (compiling, loading graphs) over the time saved per token; None when compiled
    decoding is not faster per token."""
    saved = 1 / eager_tok_s - 1 / compiled_tok_s
    if saved <= 0:
        return None
    extra = (compiled_s - n / compiled_tok_s) - (eager_s - n / eager_tok_s)
    return round(max(extra, 0.0) / saved)


@torch.inference_mode()
def recompute_token_s(m, length: int, repeats: int = 2) -> float:
    """Seconds to recompute one token after ``length`` tokens: what ``generate(...,
    use_cache=False)`` does per token (the full forward, the head on the last position)."""
    ids = torch.randint(0, 65, (1, length))
    m.lm_head(m.hidden_states(ids)[:, -1])  # warm-up at this length
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.lm_head(m.hidden_states(ids)[:, -1])
        best = min(best, time.perf_counter() - t0)
    return best


def recompute_tok_s_sampled(m, prompt_len: int, n: int, samples: int = 9) -> float:
    """Recompute tokens/s over ``n`` new tokens after a ``prompt_len`` prompt, from one
    token's recompute time at ``samples`` evenly spaced lengths, linearly interpolated (token
    i reads prompt_len + i tokens)."""
    lengths = [prompt_len + round(j * (n - 1) / (samples - 1)) for j in range(samples)]
    times = [recompute_token_s(m, L) for L in lengths]
    total = 0.0
    for (L0, t0), (L1, t1) in zip(zip(lengths, times), zip(lengths[1:], times[1:])):
        # the tokens from L0 up to (not counting) L1, t linear between the two: their mean
        # is the mean of t(L0) and t(L1 - 1)
        total += (L1 - L0) * (t0 + t1) / 2 - (t1 - t0) / 2
    total += times[-1]  # the last token's
    return n / total


@torch.inference_mode()
def ops_per_evaluation(m, prompt) -> float:
    """Top-level aten operations per field evaluation of one cached token (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    state = m.init_state(1)
    m.step(prompt, state)
    tok = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(2):
        m.step(tok, state)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        m.step(tok, state)
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(top) / m.depth.last_nfe


@torch.no_grad()
def step_ms_at(m, prompt, position: int, repeats: int = 20) -> float:
    """Mean time of one cached step when the context already holds ``position`` tokens."""
    state = m.init_state(1)
    ids = torch.randint(0, 65, (1, position))
    m.step(ids, state)
    tok = torch.zeros(1, 1, dtype=torch.long)
    t0 = time.perf_counter()
    for _ in range(repeats):
        m.step(tok, state)
    return (time.perf_counter() - t0) / repeats * 1000


def main() -> None:
    rows = []
    prompt = torch.randint(0, 65, (1, 64))
    for mixer in ("softmax", "deltanet"):
        m = build(mixer)
        m.generate(prompt, 4, greedy=True)  # warm-up
        row = {"mixer": mixer,
               "recompute_tok_s_512": tokens_per_s(m, prompt, 512, False),
               "cached_tok_s_512": tokens_per_s(m, prompt, 512, True),
               "recompute_tok_s_512_sampled": recompute_tok_s_sampled(m, 64, 512),
               "recompute_tok_s_2048_sampled": recompute_tok_s_sampled(m, 64, 2048),
               "cached_tok_s_2048": tokens_per_s(m, prompt, 2048, True),
               "ops_per_evaluation": ops_per_evaluation(m, prompt),
               "step_ms_at_128": step_ms_at(m, prompt, 128),
               "step_ms_at_2048": step_ms_at(m, prompt, 2048)}
        row["compiled_tok_s_512"], row["first_compiled_call_s_512"] = \
            compiled_tokens_per_s(m, prompt, 512)
        row["compiled_tok_s_2048"], _ = compiled_tokens_per_s(m, prompt, 2048)
        row["compiled_tok_s_512_python_wrapper"] = python_wrapper_tokens_per_s(m, prompt, 512)
        row["cpp_vs_python_wrapper"] = (row["compiled_tok_s_512"]
                                        / row["compiled_tok_s_512_python_wrapper"])
        cache_dir = tempfile.mkdtemp(prefix=f"decode_speed_{mixer}_inductor_")
        row["process_s_eager_512"] = process_s(mixer, 512, False)
        row["process_s_compiled_cold_512"] = process_s(mixer, 512, True, cache_dir)
        row["process_s_compiled_warm_512"] = process_s(mixer, 512, True, cache_dir)
        row["cache_speedup"] = row["cached_tok_s_512"] / row["recompute_tok_s_512"]
        row["recompute_tok_s_2048_est"] = (row["recompute_tok_s_512"]
                                           * row["recompute_tok_s_2048_sampled"]
                                           / row["recompute_tok_s_512_sampled"])
        row["cache_speedup_2048"] = row["cached_tok_s_2048"] / row["recompute_tok_s_2048_est"]
        row["compiled_speedup"] = row["compiled_tok_s_512"] / row["recompute_tok_s_512"]
        row["compiled_vs_eager"] = row["compiled_tok_s_512"] / row["cached_tok_s_512"]
        row["warm_process_vs_eager"] = (row["process_s_compiled_warm_512"]
                                        / row["process_s_eager_512"])
        for cache in ("cold", "warm"):
            row[f"pays_from_{cache}"] = pays_from(
                row["process_s_eager_512"], row[f"process_s_compiled_{cache}_512"],
                row["cached_tok_s_512"], row["compiled_tok_s_512"], 512)
        row["step_2048_vs_128"] = row["step_ms_at_2048"] / row["step_ms_at_128"]
        rows.append(row)
        print(row, flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    table = make_table(rows)
    print(table)
    write_json("decode_speed", {"command": "python bench/decode_speed.py",
                                "setup": "4 ODE blocks x RK4 x 4 steps (NFE 64/token), d=128, "
                                         "batch 1, prompt 64, greedy; recompute at 2048 "
                                         "new tokens estimated: one token's recompute time "
                                         "at 9 lengths, interpolated, scaled by the measured "
                                         "/ sampled rate at 512; process peak RSS "
                                         f"{peak_mb:.0f} MB; compiled: torch.compile of one "
                                         "solver step (its 4 field evaluations), one graph "
                                         "for every step, block and capacity, inductor's "
                                         "C++ wrapper (and, for comparison, the Python "
                                         "one) (buffers "
                                         "doubling from 128 as the sequence grows); whole "
                                         "processes: Python start, imports, model build and "
                                         "512 new tokens, the compiled ones with a compiler "
                                         "cache of their own, empty (cold) and then filled "
                                         "(warm)",
                                "rows": rows, "table": table})

def make_table(rows: list[dict]) -> str:
    return markdown_table(rows, [
        ("mixer", "mixer"), ("recompute_tok_s_512", "recompute tok/s (512 new)"),
        ("cached_tok_s_512", "cached tok/s (512 new)"), ("cached_tok_s_2048", "cached tok/s (2048 new)"),
        ("cache_speedup", "cached / recompute (512 new)"),
        ("recompute_tok_s_2048_est", "recompute tok/s (2048 new; estimated)"),
        ("cache_speedup_2048", "cached / recompute (2048 new; estimated)"),
        ("ops_per_evaluation", "aten ops per field evaluation"),
        ("compiled_tok_s_512", "compiled cached tok/s (512 new)"),
        ("compiled_tok_s_2048", "compiled cached tok/s (2048 new)"),
        ("compiled_tok_s_512_python_wrapper",
         "compiled cached tok/s, Python wrapper (512 new)"),
        ("compiled_speedup", "compiled cached / recompute (512 new)"),
        ("process_s_eager_512", "whole process, s (512 new; eager)"),
        ("process_s_compiled_cold_512", "whole process, s (512 new; compiled, cold cache)"),
        ("process_s_compiled_warm_512", "whole process, s (512 new; compiled, warm cache)"),
        ("pays_from_cold", "compiling pays from N new tokens (cold cache)"),
        ("pays_from_warm", "compiling pays from N new tokens (warm cache)"),
        ("step_ms_at_128", "ms/token at 128"),
        ("step_ms_at_2048", "ms/token at 2048"), ("step_2048_vs_128", "2048 / 128")])


def rates(repeats: int) -> None:
    """Only eager cached and compiled tokens/s over 512 new tokens, the median of ``repeats``
    timed generations each, printed as JSON (nothing written): to compare two checkouts of
    the package in one sitting, ``PYTHONPATH=OTHER/src python bench/decode_speed.py --rates``
    beside the same command here (only ``model.generate`` is called)."""
    import json
    import statistics

    import continuumlm

    prompt = torch.randint(0, 65, (1, 64))
    out = {"package": os.path.dirname(continuumlm.__file__)}
    for mixer in ("softmax", "deltanet"):
        m = build(mixer)
        m.generate(prompt, 4, greedy=True)  # warm-up
        out[f"{mixer}_eager_tok_s"] = statistics.median(
            tokens_per_s(m, prompt, 512, True) for _ in range(repeats))
        m.generate(prompt, 512, greedy=True, compile=True)  # compiles
        out[f"{mixer}_compiled_tok_s"] = statistics.median(
            tokens_per_s(m, prompt, 512, True, compile=True) for _ in range(repeats))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if "--rates" in sys.argv:
        rates(int(os.environ.get("DECODE_SPEED_REPEATS", "3")))
    else:
        main()
