"""Serving: ``continuumlm serve`` under 1, 4, 16 and 64 concurrent streaming clients (the
official openai client, in this process; the server in its own), against one client at a
time and against transformers' ``generate`` at batch 1 on the exported model. One client
alone decodes through the lean step (a request to an idle server); it is also timed through
the batched decoding pass (a server started with ``--no-lean``), the batch's one-row rate.

    python bench/serve.py [RUN] [--threads N] [--max-tokens 48]

writes bench/results/serve.json: per row the aggregate completion tokens/s, time to first
token and inter-token latency (p50, p99), whether every request's text equals the one-client
row's for its prompt (greedy); a row whose clients ask for different depths (NFE 1, 4 and
16: euler x 1, rk4 x 1 and the model's own rk4 x 4); the server's memory over 1,000
requests; and, in process, what one engine turn spends outside the model's forward.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, machine, markdown_table, write_json

RUN = "runs/any_depth/ode_any_depth_s1337"
CLIENTS = (1, 4, 16, 64)
DEPTHS = {"euler x 1": {"ode_solver": "euler", "ode_steps": 1},
          "rk4 x 1": {"ode_solver": "rk4", "ode_steps": 1}, "own (rk4 x 4)": {}}


def prompts_from_corpus(count: int, length: int) -> list[str]:
    data = Path(os.environ.get("CONTINUUMLM_DATA", ROOT.parent / "shared" / "data"))
    text = (data / "tinyshakespeare.txt").read_text()
    val = text[int(0.9 * len(text)):]  # the split the run validates on
    step = len(val) // count
    return [val[i * step:i * step + length] for i in range(count)]


def start_server(run: str, threads: int, max_batch: int, prefill: int, lean: bool = True):
    p = subprocess.Popen([sys.executable, "-m", "continuumlm", "serve", "--checkpoint", run,
                          "--port", "0", "--threads", str(threads), "--max-batch",
                          str(max_batch), "--max-queue", "4096", "--max-prefill-tokens",
                          str(prefill), *(() if lean else ("--no-lean",))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if "serving" not in line:
        raise SystemExit(f"the server did not start: {line}{p.stderr.read()}")
    return p, line.split("http://")[1].split("/v1")[0], line.split("'")[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def one(client, name, prompt, max_tokens, extra) -> dict:
    sent = time.perf_counter()
    stamps, text, usage = [], [], None
    stream = await client.completions.create(
        model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft": stamps[0] - sent, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "text": "".join(text), "tokens": usage.completion_tokens,
            "nfe": usage.field_evaluations_per_token}


async def load(base: str, name: str, clients: int, jobs: list[tuple[int, str, dict]],
               max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` clients take the jobs (prompt index, prompt, depth fields) in turn, each
    one request at a time; (each job's result, wall seconds)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://{base}/v1", api_key="none", max_retries=0,
                         timeout=600)
    queue = list(enumerate(jobs))
    results: list[dict | None] = [None] * len(jobs)

    async def worker():
        while queue:
            k, (i, prompt, extra) = queue.pop(0)
            results[k] = {"prompt": i, **(await one(client, name, prompt, max_tokens, extra))}

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return results, wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summary(results: list[dict], wall: float) -> dict:
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_p50_ms": round(1e3 * pct([r["ttft"] for r in results], 0.5), 1),
            "ttft_p99_ms": round(1e3 * pct([r["ttft"] for r in results], 0.99), 1),
            "itl_p50_ms": round(1e3 * pct(itl, 0.5), 2),
            "itl_p99_ms": round(1e3 * pct(itl, 0.99), 2)}


def hf_generate(run: str, prompts: list[str], max_tokens: int) -> dict:
    """transformers' generate, batch 1, greedy, on the exported model: tokens/s and its
    texts."""
    import transformers

    import continuumlm.hf  # noqa: F401  (registers the Auto classes)

    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-m", "continuumlm", "export", "--format", "hf",
                            "--checkpoint", run, "--out", f"{d}/hf"], capture_output=True,
                           text=True)
        if r.returncode:
            raise SystemExit(r.stderr)
        model = transformers.AutoModelForCausalLM.from_pretrained(f"{d}/hf",
                                                                  trust_remote_code=True)
        tok = transformers.AutoTokenizer.from_pretrained(f"{d}/hf", trust_remote_code=True)
    model.eval()
    texts, tokens, start = [], 0, time.perf_counter()
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None)
        new = out[0, ids.shape[1]:]
        tokens += len(new)
        texts.append("".join(tok.convert_ids_to_tokens(new.tolist())))
    wall = time.perf_counter() - start
    return {"tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "texts": texts}


def engine_turns(run: str, batches: list[int], max_tokens: int, prompts: list[str]) -> list:
    """In process, no HTTP: a turn of the engine with B rows decoding, and the part of it in
    the model's forward (model.hidden_states: embedding, the solve, the final norm); the rest
    is the head, Python per row (sampling, text, events) and the batch's bookkeeping. Batched
    turns all (lean=False: one row too, which alone would decode through the lean step)."""
    from continuumlm.runs import load_model_and_tokenizer
    from continuumlm.serve.engine import Engine, Request

    model, tok, _ = load_model_and_tokenizer(run, "best")
    rows = []
    for b in batches:
        engine = Engine(model, tok, max_batch=b, lean=False)
        for i in range(b):
            engine.submit(Request([tok.encode(prompts[i % len(prompts)])], max_tokens,
                                  lambda e: None))
        engine.turn()  # admits every row (their prompts)
        spent = [0.0]
        real = model.hidden_states

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        model.hidden_states = timed
        turns, start = 0, time.perf_counter()
        while engine.running and turns < max_tokens - 2:
            engine.turn()
            turns += 1
        wall = time.perf_counter() - start
        del model.hidden_states
        rows.append({"batch": b, "turn_ms": round(1e3 * wall / turns, 2),
                     "forward_ms": round(1e3 * spent[0] / turns, 2),
                     "outside_forward": f"{100 * (1 - spent[0] / wall):.0f}%",
                     "tokens_per_s": round(b * turns / wall, 1)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", default=RUN)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-chars", type=int, default=16)
    ap.add_argument("--memory-requests", type=int, default=1000)
    ap.add_argument("--max-prefill-tokens", type=int, default=256,
                    help="the server's prompt tokens per turn (serve --max-prefill-tokens)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    prompts = prompts_from_corpus(64, args.prompt_chars)

    # one client through the batched decoding pass (--no-lean): the batch's own one-row rate
    server, base, name = start_server(args.run, args.threads, 64, args.max_prefill_tokens,
                                      lean=False)
    try:
        jobs = [(i, prompts[i], {}) for i in range(64)]
        results, wall = asyncio.run(load(base, name, 1, jobs, args.max_tokens))
        batched_one = {"clients": 1, "depths": "own (rk4 x 4)",
                       "path": "batched pass (--no-lean)", **summary(results, wall),
                       "same_tokens": ""}
        batched_texts = {r["prompt"]: r["text"] for r in results}
        print(batched_one, flush=True)
    finally:
        server.terminate()
        server.wait(60)

    server, base, name = start_server(args.run, args.threads, 64, args.max_prefill_tokens)
    rows, reference = [], {}
    try:
        for clients in CLIENTS:
            jobs = [(i % 64, prompts[i % 64], {}) for i in range(max(64, 2 * clients))]
            results, wall = asyncio.run(load(base, name, clients, jobs, args.max_tokens))
            if clients == 1:
                reference = {r["prompt"]: r["text"] for r in results}
            same = sum(r["text"] == reference[r["prompt"]] for r in results)
            rows.append({"clients": clients, "depths": "own (rk4 x 4)",
                         "path": "lean step (alone)" if clients == 1 else "batched",
                         **summary(results, wall), "same_tokens": f"{same}/{len(results)}"})
            print(rows[-1], flush=True)
        same = sum(t == reference[i] for i, t in batched_texts.items())
        batched_one["same_tokens"] = f"{same}/{len(batched_texts)}"
        rows.insert(1, batched_one)
        mixed_jobs = [(i % 64, prompts[i % 64], list(DEPTHS.values())[i % 3])
                      for i in range(96)]
        results, wall = asyncio.run(load(base, name, 16, mixed_jobs, args.max_tokens))
        mixed = {"clients": 16, "depths": "NFE 1, 4 and 16 in turn", "path": "batched",
                 **summary(results, wall),
                 "same_tokens": "", "per_depth": {
                     d: summary([r for k, r in enumerate(results) if k % 3 == j], wall)
                     for j, d in enumerate(DEPTHS)}}
        own = [r for k, r in enumerate(results) if k % 3 == 2]
        mixed["same_tokens"] = (f"{sum(r['text'] == reference[r['prompt']] for r in own)}"
                                f"/{len(own)} (NFE 16)")
        rows.append(mixed)
        print(mixed, flush=True)
        # memory over many requests: short ones, 16 clients
        short = [(i % 64, prompts[i % 64], {}) for i in range(100)]
        asyncio.run(load(base, name, 16, short, 8))
        after_100 = rss_bytes(server.pid)
        rest = [(i % 64, prompts[i % 64], {}) for i in range(args.memory_requests - 100)]
        asyncio.run(load(base, name, 16, rest, 8))
        memory = {"requests": args.memory_requests, "rss_after_100_mib":
                  round(after_100 / 2**20, 1), "rss_after_all_mib":
                  round(rss_bytes(server.pid) / 2**20, 1)}
        print(memory, flush=True)
    finally:
        server.terminate()
        server.wait(60)

    hf = hf_generate(args.run, prompts[:16], args.max_tokens)
    hf_same = sum(t == reference[i] for i, t in enumerate(hf.pop("texts")))
    hf["same_tokens"] = f"{hf_same}/16"
    print("hf", hf, flush=True)
    turns = engine_turns(args.run, [1, 16, 64], args.max_tokens, prompts)

    one = rows[0]
    for r in rows:
        r["vs_one_client"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2)
        r["vs_one_batched"] = round(r["tokens_per_s"] / batched_one["tokens_per_s"], 2)
        r["itl_p99_vs_one"] = round(r["itl_p99_ms"] / one["itl_p99_ms"], 2)
        r["itl_p99_vs_one_batched"] = round(r["itl_p99_ms"] / batched_one["itl_p99_ms"], 2)
    table = markdown_table(rows, [
        ("clients", "clients"), ("depths", "depth asked"), ("path", "decoded by"),
        ("requests", "requests"), ("tokens_per_s", "tokens/s (all clients)"),
        ("vs_one_client", "vs one client"), ("vs_one_batched", "vs one client, batched"),
        ("ttft_p50_ms", "first token p50 ms"), ("ttft_p99_ms", "p99"),
        ("itl_p50_ms", "between tokens p50 ms"), ("itl_p99_ms", "p99"),
        ("itl_p99_vs_one", "p99 vs one client"),
        ("itl_p99_vs_one_batched", "p99 vs one client, batched"),
        ("same_tokens", "text = one client's")])
    depth_table = markdown_table(
        [{"depth": d, **s} for d, s in rows[-1]["per_depth"].items()],
        [("depth", "depth asked (16 clients, mixed)"), ("requests", "requests"),
         ("itl_p50_ms", "between tokens p50 ms"), ("itl_p99_ms", "p99"),
         ("ttft_p50_ms", "first token p50 ms")])
    turn_table = markdown_table(turns, [
        ("batch", "rows decoding"), ("turn_ms", "engine turn ms"),
        ("forward_ms", "model forward ms"), ("outside_forward", "outside the forward"),
        ("tokens_per_s", "tokens/s (no HTTP)")])
    command = f"python bench/serve.py {args.run}" + (
        f" --threads {args.threads}" if args.threads != 1 else "")
    write_json("serve", {
        "command": command,
        "setup": (f"{args.run}'s best checkpoint (rk4 x 4, 16 field evaluations per token), "
                  f"served by continuumlm serve --threads {args.threads} --max-batch 64 in its "
                  f"own process; the clients (openai's AsyncOpenAI, streaming, greedy, "
                  f"{args.max_tokens} new tokens after a {args.prompt_chars}-character "
                  f"validation prompt) in this one; {machine()}"),
        "rows": rows, "hf_generate": hf, "memory": memory, "engine_turns": turns,
        "table": table, "depth_table": depth_table, "turn_table": turn_table})
    print(table, depth_table, turn_table, sep="\n\n")


if __name__ == "__main__":
    main()
