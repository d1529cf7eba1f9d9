"""GPU benchmarks, in order of value: DeltaNet kernels (ours, fla's when installed, SDPA) in
bf16; training tokens/s and MFU of discrete vs ODE models in fp32, bf16 and compiled; cached
decoding, eager, compiled, and replayed from a recorded CUDA graph of the token step (eager
and compiled units); a GPT-2-small-sized discrete model (12 x 768, context 1024) and
its ODE counterpart (one shared block, Euler x 12: the same compute per token) in bf16,
compiled.

    python bench/gpu_bench.py --out DIR          # DIR/gpu_bench.json (run by gpu_check.sh)
    python bench/gpu_bench.py --out DIR --dry    # every section on the CPU at toy size

Each section runs in a child process with its own time budget, so one slow compile or a hung
kernel costs that section's remaining rows, not the run. The JSON is rewritten after every
measurement; a row's status says what happened: "done", "error" (with the message),
"interrupted" or "skipped" (with the reason: budget spent, corpus missing, child crashed).
A measurement that fails records its error and the row keeps what else it measured. Training
run folders live in a temporary folder (nothing large lands in DIR), so a second run into the
same DIR starts afresh. The training rows read Tiny Shakespeare (``--corpus``, else the
package's corpus search: $CONTINUUMLM_DATA, the user cache); the GPT-2 rows time the training
step on random token ids (throughput only; their loss means nothing).

--dry runs on the CPU with toy sizes and dynamo's eager backend for the compiled rows (no
inductor code generation), and the CPU emulation of CUDA-graph capture for the graph-replay
rows, to prove the plumbing without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULT = "gpu_bench.json"
# replayed against unrecorded frozen steps' logits, eager units (float32 model): round-off only
FROZEN_ATOL = 1e-5
# seconds per section on a GPU, in the order they run, and for the whole bench (a section gets
# at most what is left of it, child start-ups included): 280 s beside gpu_check.sh's 90 s of
# CUDA tests fits its 8-minute limit.
# most valuable first: graph-replayed decoding (never yet run on a GPU), DeltaNet's kernels by
# GPU time, then the GPT-2-small rows and training; a later `--resume` command completes what
# a budget cut short
BUDGETS = {"decoding": 70, "kernels": 70, "gpt2": 90, "training": 50}
DEADLINE = 280
DRY_BUDGETS = {"decoding": 60, "kernels": 30, "gpt2": 40, "training": 60}
DRY_DEADLINE = 180
# dense peaks from the vendors' data sheets (FLOP/s): bf16 tensor cores, and fp32 without
# TF32 (this package does not enable TF32), for MFU. First match of the device name wins.
SPEC_PEAKS = [("H100 PCIe", {"bf16": 756e12, "fp32": 51e12}),
              ("H200 NVL", {"bf16": 835e12, "fp32": 60e12}),
              ("H100 NVL", {"bf16": 835e12, "fp32": 60e12}),
              ("H200", {"bf16": 989e12, "fp32": 67e12}),
              ("H100", {"bf16": 989e12, "fp32": 67e12}),
              ("A100", {"bf16": 312e12, "fp32": 19.5e12})]


# ------------------------------------------------------------------ the JSON (parent and child)

def load(out: Path) -> dict:
    p = out / RESULT
    return json.loads(p.read_text()) if p.is_file() else {}


def save(out: Path, result: dict) -> None:
    tmp = out / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out / RESULT)


class Section:
    """A section's rows in the JSON: planned first (status "pending"), each measurement saved
    as soon as it is taken."""

    def __init__(self, out: Path, name: str, dry: bool, resume: bool = False):
        self.out, self.name, self.dry = out, name, dry
        self.result = load(out)
        # resuming: the rows an earlier run finished are kept as they are, not measured again
        self.kept = ({r["row"]: r for r in self.result.get(name, {}).get("rows", [])
                      if r["status"] == "done"} if resume else {})
        self.rows: dict[str, dict] = {}
        self.result[name] = {"rows": []}
        self.t0 = time.perf_counter()

    def plan(self, key: str, **fields) -> dict:
        row = self.kept.get(key) or {"row": key, "status": "pending", **fields}
        self.rows[key] = row
        self.result[self.name]["rows"].append(row)
        return row

    def save(self) -> None:
        save(self.out, self.result)

    def measure(self, key: str, field: str, fn):
        """Run ``fn`` for one measurement of row ``key``; its value (or its error) is saved."""
        row = self.rows[key]
        row["status"] = "running"
        self.save()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the row's other measurements count
            row[f"{field}_error"] = f"{type(e).__name__}: {e}"[:1000]
            print(f"{self.name}/{key}/{field} failed: {row[f'{field}_error']}", flush=True)
            value = None
        else:
            if isinstance(value, dict):
                row.update(value)
            else:
                row[field] = value
        self.save()
        return value

    def done(self, key: str) -> bool:
        """Whether row ``key`` was finished by an earlier run (kept when resuming)."""
        return self.rows[key]["status"] == "done"

    def finish(self, key: str) -> None:
        row = self.rows[key]
        errors = [k for k in row if k.endswith("_error") and row[k]]
        row["status"] = "error" if errors else "done"
        # the code it measured (set by the parent for every section; see commit())
        row["commit"] = os.environ.get("GPU_CHECK_COMMIT") or None
        self.save()
        print(json.dumps(row), flush=True)


# ------------------------------------------------------------------ timing helpers

def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeats * 1000


def timed(name: str, fn, device, repeats=20, warmup=3) -> dict:
    """``{name}_ms``: host wall time per call over back-to-back calls (what the device and
    the host's launches together take); on CUDA also ``{name}_gpu_ms``: the median over the
    calls of the GPU time between CUDA events recorded around each call, which a host that
    launches faster than the GPU runs does not inflate; the kernel rows' verdict reads it."""
    import statistics

    import torch

    out = {f"{name}_ms": time_ms(fn, device, repeats, warmup)}
    if device.type == "cuda":
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(repeats)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        out[f"{name}_gpu_ms"] = statistics.median(s.elapsed_time(e) for s, e in pairs)
    return out


def bf16_matmul_peak(device, dry: bool) -> float:
    import torch

    n = 256 if dry else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device, repeats=3 if dry else 20, warmup=1 if dry else 5)
    return 2 * n ** 3 / (ms / 1000)


def spec_peaks(name: str) -> dict | None:
    return next((v for k, v in SPEC_PEAKS if k in name), None)


def peak_for(result: dict, dtype: str) -> tuple[float | None, str]:
    """The peak a row's MFU is taken against, and what it is: the data sheet's for the
    row's precision, else (unknown device, or the dry run) the measured bf16 matmul rate."""
    spec = result.get("peak_flops_spec") or {}
    kind = "bf16" if dtype in ("bf16", "bfloat16") else "fp32"
    if spec.get(kind):
        return spec[kind], f"data sheet {kind}"
    measured = result.get("peak_bf16_flops_measured")
    return measured, "measured bf16 matmul" if measured else "none"


# ------------------------------------------------------------------ sections

def kernels(sec: Section, device) -> None:
    import torch
    import torch.nn.functional as F

    from continuumlm.mixers import delta_rule_chunkwise
    from continuumlm.mixers.deltanet import fla_status

    usable, why = fla_status()
    sec.result["fla"] = usable if usable else why
    lengths = (64, 130) if sec.dry else (1024, 4096, 16384)
    # two shapes: this project's (d 512 in 8 heads of 64), and the wide one of
    # flash-linear-attention's kernel benchmarks (B 4, H 64, D 128), where linear attention
    # fills the GPU; rows "T{T}" and "wide-T{T}"
    shapes = {"": (1, 2, 16) if sec.dry else (4, 8, 64),
              "wide-": (1, 4, 32) if sec.dry else (4, 64, 128)}
    for prefix, (B, H, D) in shapes.items():
        for T in lengths:
            sec.plan(f"{prefix}T{T}", T=T, B=B, H=H, D=D, dtype="bfloat16",
                     shape="flash-linear-attention's benchmark" if prefix else "this project's")
    todo = [(prefix, T) for prefix in shapes for T in lengths if not sec.done(f"{prefix}T{T}")]

    def inputs(T, B, H, D):
        g = torch.Generator(device=device).manual_seed(0)

        def make(*shape, norm=False):
            x = torch.randn(*shape, device=device, generator=g)
            x = F.normalize(x, dim=-1) if norm else x
            return x.to(torch.bfloat16).requires_grad_()

        q, k = make(B, H, T, D, norm=True), make(B, H, T, D, norm=True)
        v = make(B, H, T, D)
        beta = torch.rand(B, H, T, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        return q, k, v, beta

    def fwd_bwd(fn):
        def go():
            fn().float().sum().backward()
        return go

    reps = dict(repeats=2, warmup=1) if sec.dry else dict(repeats=10, warmup=2)
    with_fla = usable and device.type == "cuda"
    # SDPA and the built-in kernel at every length first; fla after them, since its first call
    # autotunes its Triton kernels (over 90 s on a bare H200): a budget spent there still
    # leaves the comparison with SDPA
    for prefix, T in todo:
        key, (q, k, v, beta) = f"{prefix}T{T}", inputs(T, *shapes[prefix])
        sec.measure(key, "sdpa", lambda: timed("sdpa", fwd_bwd(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), device, **reps))
        sec.measure(key, "chunkwise_torch", lambda: timed("chunkwise_torch", fwd_bwd(
            lambda: delta_rule_chunkwise(q, k, v, beta, backend="torch")[0]), device, **reps))
        if not with_fla:
            sec.finish(key)
    for prefix, T in todo if with_fla else ():
        key, (q, k, v, beta) = f"{prefix}T{T}", inputs(T, *shapes[prefix])
        fla = fwd_bwd(lambda: delta_rule_chunkwise(q, k, v, beta, backend="fla")[0])

        def first_call(fla=fla):
            t0 = time.perf_counter()
            fla()
            sync(device)
            return time.perf_counter() - t0
        # the first call at a new shape (autotuning included), apart from the timed calls
        sec.measure(key, "fla_first_call_s", first_call)
        sec.measure(key, "chunkwise_fla", lambda: timed("chunkwise_fla", fla, device, **reps))
        sec.finish(key)


TRAINING = ("transformer_baby", "ode_rk4", "deltanet")
# eager rows of every model first: a compile can take minutes and must not cost them
TRAINING_MODES = (("fp32", False), ("bf16", False), ("bf16", True))


def _mfu_fields(cfg, nfe: int, tokens_per_s: float, result: dict, dtype: str) -> dict:
    from mfu import flops_per_token

    fpt = flops_per_token(cfg, nfe, cfg.train.seq_len)
    achieved = fpt * tokens_per_s
    peak, what = peak_for(result, dtype)
    return {"flop_per_token": fpt, "tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "mfu_peak": what}


def training(sec: Section, device, corpus: str | None, runs: Path) -> None:
    from continuumlm import load_config
    from continuumlm.train import Trainer
    from continuumlm.train.logging import read_metrics

    steps = 4 if sec.dry else 150
    size = (["train.batch_size=2", "train.seq_len=16", "model.max_seq_len=16",
             "model.hidden_size=32"] if sec.dry else
            ["train.batch_size=64", "train.seq_len=256", "model.max_seq_len=256"])
    modes = [(c, d, k) for k in (False, True) for c in TRAINING for d, kk in TRAINING_MODES
             if kk == k]
    for c, d, k in modes:
        sec.plan(f"{c}-{d}{'-compiled' if k else ''}", config=c, dtype=d, compile=k)
    if corpus is None:
        for row in (r for r in sec.rows.values() if r["status"] != "done"):  # kept rows stay
            row.update(status="skipped", reason="no tinyshakespeare.txt: pass --corpus or set "
                                                 "CONTINUUMLM_DATA (gpu_check.sh looks in "
                                                 ".gpu_data/)")
        sec.save()
        return
    for c, d, k in modes:
        key = f"{c}-{d}{'-compiled' if k else ''}"
        if sec.done(key):
            continue
        sets = [f"train.max_steps={steps}", f"train.eval_interval={steps}", "train.eval_iters=2",
                f"train.checkpoint_interval={steps}", f"train.log_interval={max(1, steps // 15)}",
                f"train.device={device.type}", f"train.dtype={d}",
                f"train.compile={str(k).lower()}", "data.dataset=text",
                f"data.path={json.dumps(corpus)}", *size]
        run = runs / key

        def one(c=c, sets=sets, run=run):
            cfg = load_config(ROOT / "configs" / "shakespeare_char" / f"{c}.toml", sets)
            trainer = Trainer(cfg, run, quiet=True)
            res = trainer.run()
            tps = sorted(m["tokens_per_s"] for m in read_metrics(run) if "tokens_per_s" in m)
            tps = tps[1:] or tps  # the first window holds the warm-up (and the compile)
            row = {"steps": res["step"], "val_loss": res["val_loss"],
                   "compiled": res["compiled"], "compile_error": res["compile_error"],
                   "tokens_per_s_median": tps[len(tps) // 2] if tps else None,
                   "nfe": trainer.model.last_nfe, "parameters": res["parameters"]}
            if res["interrupted"]:  # the parent's budget ran out: not a finished measurement
                row["interrupted"] = res["interrupted"]
            elif row["tokens_per_s_median"]:
                row.update(_mfu_fields(cfg, row["nfe"] or cfg.model.num_layers,
                                       row["tokens_per_s_median"], sec.result, d))
            return row

        row = sec.measure(key, "train", one)
        if row and row.get("interrupted"):
            sec.rows[key]["status"] = "interrupted"
            sec.save()
            raise SystemExit(3)  # stop the section: the parent asked it to
        sec.finish(key)


def decoding(sec: Section, device) -> None:
    import torch

    from continuumlm import LanguageModel, ModelConfig

    new, prompt_len = (12, 5) if sec.dry else (256, 64)
    mixers = ("softmax", "deltanet")
    # eager rows first, each finished on its own: a compile that runs out of budget must not
    # cost the eager figures
    for mixer in mixers:
        sec.plan(f"{mixer}-eager", mixer=mixer, new_tokens=new, prompt=prompt_len)
    for mixer in mixers:
        sec.plan(f"{mixer}-compiled", mixer=mixer, new_tokens=new, prompt=prompt_len)
    # then graph replay of the whole token step (generate(cuda_graph=True)): eager units first
    # (no compile, so cheap), then compiled units. The dry run records through the CPU
    # emulation of graph capture (continuumlm.decoding.replay), which sees aten operations only, so it
    # has no compiled-unit rows
    graphed = [(mixer, compile) for compile in ((False,) if sec.dry else (False, True))
               for mixer in mixers]
    for mixer, compile in graphed:
        sec.plan(_graph_row(mixer, compile), mixer=mixer, new_tokens=new, prompt=prompt_len)
    # then self-speculative decoding through depth with both states' frozen steps replayed
    # (Euler x 1 drafting 4 tokens; the untrained model's greedy text is repetitive, so these
    # rows check the mechanism and time it, not a trained model's acceptance)
    for mixer, compile in graphed:
        sec.plan(_graph_row(mixer, compile) + "-speculative", mixer=mixer, new_tokens=new,
                 prompt=prompt_len, draft="euler x 1, 4 tokens")
    models = {}
    # eager rows of both mixers first, then the compiled ones (each builds several graphs)
    for mixer in mixers:
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=65, hidden_size=32 if sec.dry else 128,
                                      num_heads=4, num_layers=1 if sec.dry else 4,
                                      max_seq_len=1024, mixer=mixer, depth="ode",
                                      field="sequential", ode_solver="rk4",
                                      ode_steps=4)).to(device).eval()
        models[mixer] = m
        prompt = torch.randint(0, 65, (1, prompt_len), device=device)
        if sec.done(f"{mixer}-eager"):
            continue
        for use_cache in (True, False):
            def tok_s(use_cache=use_cache):
                with torch.no_grad():
                    m.generate(prompt, 4, greedy=True, use_cache=use_cache)
                    sync(device)
                    t0 = time.perf_counter()
                    m.generate(prompt, new, greedy=True, use_cache=use_cache)
                    sync(device)
                return new / (time.perf_counter() - t0)
            sec.measure(f"{mixer}-eager", "cached_tok_s" if use_cache else "recompute_tok_s",
                        tok_s)
        row = sec.rows[f"{mixer}-eager"]
        if row.get("cached_tok_s") and row.get("recompute_tok_s"):
            row["cached_speedup"] = row["cached_tok_s"] / row["recompute_tok_s"]
        sec.finish(f"{mixer}-eager")
    for mixer in mixers:
        if sec.done(f"{mixer}-compiled"):
            continue
        m = models[mixer]
        prompt = torch.randint(0, 65, (1, prompt_len), device=device)

        def compiled():
            with torch.no_grad():
                t0 = time.perf_counter()
                m.generate(prompt, new, greedy=True, compile=True, cuda_graph=False)
                sync(device)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                m.generate(prompt, new, greedy=True, compile=True, cuda_graph=False)
                sync(device)
            return {"compile_first_call_s": first,
                    "compiled_tok_s": new / (time.perf_counter() - t0)}
        sec.measure(f"{mixer}-compiled", "compiled", compiled)
        sec.finish(f"{mixer}-compiled")
    refs = {}  # eager greedy tokens per mixer, for the graphed rows to equal
    for mixer, compile in graphed:
        key = _graph_row(mixer, compile)
        if sec.done(key):
            continue
        m = models[mixer]
        torch.manual_seed(1)
        prompt = torch.randint(0, 65, (1, prompt_len), device=device)

        def replayed(mixer=mixer, compile=compile):
            from continuumlm.decoding import Decoder

            # one decoder for both calls: the timed one reuses its compiled evaluator and
            # recorder (what a kept Decoder does)
            decoder = Decoder(m, compile=compile, cuda_graph=True)
            with torch.no_grad():
                if mixer not in refs:
                    refs[mixer] = m.generate(prompt, new, greedy=True)
                ref = refs[mixer]
                t0 = time.perf_counter()
                first_out = decoder.generate(prompt, new, greedy=True)
                sync(device)
                first = time.perf_counter() - t0
                (rec,) = decoder.recorders.values() or [None]
                before = rec.replays if rec else 0
                t0 = time.perf_counter()
                decoder.generate(prompt, new, greedy=True)
                sync(device)
                tok_s = new / (time.perf_counter() - t0)
                replays = rec.replays - before if rec else 0
                # steady state: each token's time after the warm-ups and the recording, with
                # the prompt's capacity holding every token (no refreeze, so no new capture)
                from continuumlm.decoding.frozen import capacity_for

                steady_new = min(new, capacity_for(prompt_len + 1) - prompt_len)
                stamps = []
                for _ in decoder.stream(prompt, steady_new, greedy=True):
                    sync(device)
                    stamps.append(time.perf_counter())
                settled = getattr(rec, "warmups_needed", 1) + 2  # warm-ups, record, replay
                gaps = [b - a for a, b in zip(stamps[settled:], stamps[settled + 1:])]
                # the replayed frozen step's logits against the same frozen step unrecorded
                # (eager units: the same kernels; a library may pick another inside a capture,
                # cuBLAS keeping a workspace per stream, so round-off is allowed)
                frozen_diff = None
                if not compile and rec is not None and replays:
                    from continuumlm.decoding import GraphRecorder
                    from continuumlm.testing import _frozen_logits

                    tokens = first_out[:, prompt_len:]
                    fresh = GraphRecorder(device) if device.type == "cuda" else rec
                    replayed_logits, _ = _frozen_logits(m, prompt, tokens, fresh)
                    plain_logits, _ = _frozen_logits(m, prompt, tokens)
                    frozen_diff = float((replayed_logits - plain_logits).abs().max())
            if decoder.capture_refused or not replays:
                # a graphed row that replayed nothing measured eager decoding: an error
                why = decoder.capture_refused or "none recorded"
                raise RuntimeError(f"no graph was replayed ({why}); the row would time eager "
                                   f"decoding")
            return {"first_call_s": first, "graph_tok_s": tok_s,
                    "steady_ms_per_token": (1000 * sorted(gaps)[len(gaps) // 2]
                                            if gaps else None),
                    # the same greedy tokens as eager cached decoding (eager units: the same
                    # kernels, so bit for bit; compiled ones may round differently)
                    "greedy_equal_to_eager": bool(torch.equal(first_out, ref)),
                    # eager units only; tolerance FROZEN_ATOL (compiled units round otherwise)
                    "frozen_logits_max_abs_diff": frozen_diff,
                    "frozen_logits_within_tolerance": (None if frozen_diff is None
                                                       else frozen_diff <= FROZEN_ATOL),
                    # what the timed call replayed of its frozen steps (the first token comes
                    # from the prompt's pass): all but the warm-ups unless CUDA refused a
                    # recording (warned in the log), and whether compiling failed
                    "frozen_steps": new - 1,
                    "graph_replays": replays,
                    "compile_failed": decoder.compile_refused is not None}
        sec.measure(key, "graph", replayed)
        row = sec.rows[key]
        eager = sec.rows.get(f"{mixer}-eager", {}).get("cached_tok_s")
        if row.get("graph_tok_s") and eager:
            row["graph_vs_eager"] = row["graph_tok_s"] / eager
        sec.finish(key)
    for mixer, compile in graphed:
        key = _graph_row(mixer, compile) + "-speculative"
        if sec.done(key):
            continue
        m = models[mixer]
        torch.manual_seed(1)
        prompt = torch.randint(0, 65, (1, prompt_len), device=device)

        def speculative(mixer=mixer, compile=compile):
            from continuumlm import Draft
            from continuumlm.decoding import Decoder

            decoder = Decoder(m, compile=compile, cuda_graph=True)
            draft = Draft("euler", 1, 4)
            with torch.no_grad():
                if mixer not in refs:
                    refs[mixer] = m.generate(prompt, new, greedy=True)
                decoder.generate(prompt, new, greedy=True, draft=draft)  # records the graphs
                (rec,) = decoder.recorders.values() or [None]
                before = rec.replays if rec else 0
                sync(device)
                t0 = time.perf_counter()
                stream = decoder.stream(prompt, new, greedy=True, draft=draft)
                out = torch.cat([prompt] + [t[:, None] for t in stream], dim=1)
                sync(device)
                tok_s = new / (time.perf_counter() - t0)
                replays = rec.replays - before if rec else 0
            if decoder.capture_refused or not replays:
                why = decoder.capture_refused or "none recorded"
                raise RuntimeError(f"no graph was replayed ({why}); the row would time eager "
                                   f"drafting")
            s = stream.stats
            return {"speculative_tok_s": tok_s, "graph_replays": replays,
                    "acceptance": s.acceptance, "tokens_per_verification": s.tokens / s.rounds,
                    "nfe_per_token": s.nfe / s.tokens,
                    "greedy_equal_to_eager": bool(torch.equal(out, refs[mixer])),
                    "compile_failed": decoder.compile_refused is not None}
        sec.measure(key, "speculative", speculative)
        row = sec.rows[key]
        plain = sec.rows.get(_graph_row(mixer, compile), {}).get("graph_tok_s")
        if row.get("speculative_tok_s") and plain:
            row["speculative_vs_graphed"] = row["speculative_tok_s"] / plain
        sec.finish(key)


def _graph_row(mixer: str, compile: bool) -> str:
    return f"{mixer}-{'compiled-' if compile else ''}graphed"


def gpt2(sec: Section, device) -> None:
    """GPT-2 small's shape (12 x 768, 12 heads, context 1024, vocabulary 50,257, tied) as a
    discrete stack and as one shared block integrated with Euler x 12 (NFE 12: the same
    matmuls per token, 1/12 of the block parameters). A timed loop of the training step:
    bf16 autocast, torch.compile, fused AdamW, random token ids. The depth module alone
    (forward and backward on random hidden states, compiled) is timed as well: the head, the
    loss and the optimizer are shared costs that would pull the per-evaluation ratio toward 1."""
    import torch

    from continuumlm import LanguageModel, load_config

    if sec.dry:
        shape = ["model.hidden_size=32", "model.num_heads=4", "model.max_seq_len=32",
                 "model.vocab_size=97"]
        layers, batch, T, warm, timed = 2, 2, 32, 1, 2
    else:
        shape = ["model.hidden_size=768", "model.num_heads=12", "model.max_seq_len=1024",
                 "model.vocab_size=50257"]
        layers, batch, T, warm, timed = 12, 16, 1024, 3, 10
    variants = {
        "discrete": [f"model.num_layers={layers}", "model.depth=discrete"],
        "ode_euler": ["model.num_layers=1", "model.depth=ode", "model.field=sequential",
                      "model.ode_solver=euler", f"model.ode_steps={layers}"],
    }
    for name in variants:
        sec.plan(name, layers_or_nfe=layers, batch=batch, seq_len=T, dtype="bf16",
                 compile=True)

    def timed_loop(step) -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(warm):
            step()
        sync(device)
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(timed):
            step()
        sync(device)
        return warm_s, (time.perf_counter() - t0) / timed

    for name, sets in variants.items():
        if sec.done(name):
            continue
        cfg = load_config(None, [*shape, *sets, "model.position=learned", "model.bias=false",
                                 "model.dropout=0", f"train.seq_len={T}",
                                 f"train.batch_size={batch}"])
        torch.manual_seed(0)
        model = LanguageModel(cfg.model).to(device)

        def train_step():
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
            step_fn = torch.compile(model)
            ids = torch.randint(0, cfg.model.vocab_size, (batch, T + 1), device=device)
            x, y = ids[:, :-1], ids[:, 1:]

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    _, loss = step_fn(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            warm_s, s = timed_loop(step)
            tps = batch * T / s
            nfe = model.last_nfe or layers
            out = {"parameters": model.num_parameters(), "warmup_s": warm_s,
                   "tokens_per_s": tps, "nfe": nfe,
                   "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                                       if device.type == "cuda" else None)}
            out.update(_mfu_fields(cfg, nfe, tps, sec.result, "bf16"))
            return out

        def depth_step():
            depth = torch.compile(model.depth)
            h = torch.randn(batch, T, cfg.model.hidden_size, device=device, requires_grad=True)

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = depth(h)
                out.float().sum().backward()

            warm_s, s = timed_loop(step)
            nfe = model.last_nfe or layers
            return {"depth_warmup_s": warm_s, "depth_fwd_bwd_ms": 1000 * s,
                    "depth_ms_per_evaluation": 1000 * s / nfe}

        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        sec.measure(name, "train", train_step)
        sec.measure(name, "depth", depth_step)
        sec.finish(name)
        model = None  # freed before the next variant is built
    d, o = sec.rows["discrete"], sec.rows["ode_euler"]
    if d.get("depth_ms_per_evaluation") and o.get("depth_ms_per_evaluation"):
        # target: an ODE field evaluation costs at most 1.1x a discrete layer
        sec.result["gpt2"]["ode_evaluation_vs_layer"] = (o["depth_ms_per_evaluation"]
                                                         / d["depth_ms_per_evaluation"])
        sec.save()


# ------------------------------------------------------------------ child and parent

def find_corpus(given: str | None) -> str | None:
    if given:
        return given if Path(given).is_file() else None
    for folder in (os.environ.get("CONTINUUMLM_DATA"), ROOT / ".gpu_data"):
        if folder and (Path(folder) / "tinyshakespeare.txt").is_file():
            return str(Path(folder) / "tinyshakespeare.txt")
    return None


def _die_with_parent() -> None:
    """Linux: this section's process is killed when the bench's parent process dies, even by
    SIGKILL (a backstop timeout's last resort), so no section keeps the GPU busy after it. The
    parent stops the section's whole process group on every other path."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own stop is all there is
        return
    if os.getppid() == 1:  # the parent died before the request was in place
        os._exit(1)


def child(args) -> None:
    _die_with_parent()
    import torch

    sys.path.insert(0, str(HERE))  # mfu.py, common.py
    out = Path(args.out)
    device = torch.device("cpu" if args.dry else "cuda")
    if args.dry:  # dynamo traces as on a GPU, but no inductor code generation (minutes on CPU)
        import functools

        torch.set_num_threads(1)  # a toy size gains nothing from threads, and CI shares cores
        torch.compile = functools.partial(torch.compile, backend="eager")
        # CUDA graphs record CUDA work: on the CPU, the emulation of capture and replay
        from continuumlm.decoding import Decoder, EmulatedGraphRecorder

        def emulated(self, device):
            return (self.recorders.setdefault(device, EmulatedGraphRecorder())
                    if self.cuda_graph else None)
        Decoder._recorder = emulated
    # a section stopped at its budget says where it was (stderr, the log): on the parent's
    # SIGTERM, and 5 s before the budget in case the stop comes as a SIGKILL
    import faulthandler

    faulthandler.register(signal.SIGTERM, chain=True)
    if args.budget:
        faulthandler.dump_traceback_later(max(args.budget - 5, 1), exit=False)
    sec = Section(out, args.section, args.dry, resume=args.resume)
    sec.save()
    if args.section == "kernels":
        kernels(sec, device)
    elif args.section == "training":
        with tempfile.TemporaryDirectory(prefix="gpu_bench_runs_") as runs:
            training(sec, device, find_corpus(args.corpus), Path(runs))
    elif args.section == "decoding":
        decoding(sec, device)
    elif args.section == "gpt2":
        gpt2(sec, device)


_CURRENT: dict = {}  # the section child now running, for the parent's signal handler


def _close_section(out: Path, name: str, t0: float, budget: float, reason: str | None) -> None:
    result = load(out)
    sec = result.setdefault(name, {"rows": []})
    sec["seconds"] = round(time.perf_counter() - t0, 1)
    sec["budget_s"] = round(budget, 1)
    for row in sec["rows"]:
        if row["status"] in ("pending", "running"):
            row.update(status="skipped", reason=reason or "not reached")
    if reason:
        sec["stopped"] = reason
    else:
        sec.pop("stopped", None)  # a resumed section that finished is no longer stopped
    save(out, result)


def _stop(proc: subprocess.Popen) -> int:
    """SIGTERM to the child's process group (a training run saves and returns, the child
    records "interrupted"), SIGKILL 20 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_section(args, name: str, budget: float) -> int:
    """The section in a child process (its own process group), stopped at its budget."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", args.out, "--section", name]
    cmd += ["--dry"] if args.dry else []
    cmd += ["--resume"] if args.resume else []
    cmd += ["--budget", str(budget)]
    cmd += ["--corpus", args.corpus] if args.corpus else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    _CURRENT.update(proc=proc, name=name, t0=t0, budget=budget)
    reason = None
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        reason = f"the section's budget of {budget:.0f} s ran out"
        rc = _stop(proc)
    _CURRENT.clear()
    if reason is None and rc != 0:
        reason = f"the section's process ended with status {rc}"
    _close_section(Path(args.out), name, t0, budget, reason)
    return 0 if reason is None else 1


def _on_signal(signum, frame) -> None:
    """The parent was told to stop (a timeout, Ctrl-C): stop the running section too, mark what
    it had not measured, and leave with the signal's status."""
    name = signal.Signals(signum).name
    if _CURRENT:
        proc = _CURRENT["proc"]
        _stop(proc)
        _close_section(Path(_ARGS.out), _CURRENT["name"], _CURRENT["t0"], _CURRENT["budget"],
                       f"the benchmark was stopped by {name}")
    raise SystemExit(128 + signum)


_ARGS = None


def parent(args) -> int:
    global _ARGS
    import torch

    _ARGS = args
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA device (or --dry for the CPU dry run)")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    start = time.perf_counter()
    device = torch.device("cpu" if args.dry else "cuda")
    name = "cpu (dry run)" if args.dry else torch.cuda.get_device_name()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    # the command as gpu_check.sh was given it (its settings are environment variables)
    env = ["GPU_CHECK_DRY=1" if args.dry else "",
           f"GPU_CHECK_BUDGET_SCALE={args.budget_scale:g}" if args.budget_scale != 1 else "",
           f"GPU_CHECK_DEADLINE={args.deadline:g}" if args.deadline else "",
           f"GPU_CHECK_SECTIONS='{' '.join(args.sections)}'"
           if args.sections != list(BUDGETS) else "",
           *(f"{v}={os.environ[v]}" for v in ("GPU_CHECK_TESTS_LIMIT", "GPU_CHECK_FLA_TESTS_LIMIT")
             if os.environ.get(v))]
    os.environ["GPU_CHECK_COMMIT"] = commit() or ""  # the sections' processes read it
    this_run = {"command": " ".join([*filter(None, env), "bash bench/gpu_check.sh"])
                + (" --resume" if args.resume else ""),
                "started": started, "device": name, "torch": torch.__version__,
                "commit": commit()}
    result = load(out) if args.resume else {}
    if args.resume:
        # only on the same kind of machine: kept rows and new ones must be comparable
        if result.get("dry_run", args.dry) != args.dry or result.get("device", name) != name:
            raise SystemExit(f"--resume: {out / RESULT} was measured on {result.get('device')}, "
                             f"this run is on {name}; resume on the same kind of machine, or "
                             f"start afresh without --resume")
        # a section whose rows are all done is not run again
        # (a section with no rows never planned them: stopped before, or at the deadline)
        args.sections = [s for s in args.sections
                         if not result.get(s, {}).get("rows")
                         or any(r["status"] != "done" for r in result[s]["rows"])]
        result.setdefault("runs", [{**{k: result.get(k) for k in this_run},
                                    "seconds": result.get("seconds")}])
        result["runs"].append({**this_run, "sections": args.sections})
    else:
        result = {**this_run, "dry_run": args.dry,
                  "runs": [{**this_run, "sections": args.sections}]}
    save(out, result)  # a new run starts a new file; a resumed one keeps what was done
    if "peak_bf16_flops_measured" not in result:
        try:
            result["peak_bf16_flops_measured"] = bf16_matmul_peak(device, args.dry)
        except Exception as e:  # noqa: BLE001
            result["peak_bf16_flops_error"] = f"{type(e).__name__}: {e}"[:500]
    result["peak_flops_spec"] = None if args.dry else spec_peaks(name)
    save(out, result)
    budgets = DRY_BUDGETS if args.dry else BUDGETS
    deadline = (args.deadline if args.deadline else
                (DRY_DEADLINE if args.dry else DEADLINE) * args.budget_scale)
    failed = []
    for section in args.sections:
        left = deadline - (time.perf_counter() - start)
        budget = min(budgets[section] * args.budget_scale, max(left, 0.0))
        if budget < 1:  # nothing left: recorded, not run
            _close_section(out, section, time.perf_counter(), 0.0,
                           f"the bench's deadline of {deadline:.0f} s was reached")
            failed.append(section)
            continue
        if run_section(args, section, budget):
            failed.append(section)
    result = load(out)
    result["runs"][-1]["seconds"] = round(time.perf_counter() - start, 1)
    result["seconds"] = round(sum(r.get("seconds") or 0 for r in result["runs"]), 1)
    save(out, result)
    statuses = [r["status"] for s in args.sections for r in result[s]["rows"]]
    print(f"gpu_bench: {statuses.count('done')} rows done, {len(statuses)} planned; "
          f"sections stopped: {', '.join(failed) or 'none'}; {out / RESULT}", flush=True)
    return 1 if failed or any(s != "done" for s in statuses) else 0


def commit() -> str | None:
    """The commit of the code measured: $GPU_CHECK_COMMIT (a copy of the tree without git
    metadata, as a GPU machine gets, is given it: `GPU_CHECK_COMMIT=$(git rev-parse HEAD)`
    where the tree came from), else git's HEAD here (with "+changes" when the tree differs
    from it), else None."""
    given = os.environ.get("GPU_CHECK_COMMIT")
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    ap.add_argument("--dry", action="store_true", help="CPU, toy sizes: proves the plumbing")
    ap.add_argument("--corpus", help="tinyshakespeare.txt for the training rows")
    ap.add_argument("--sections", nargs="+", default=list(BUDGETS), choices=list(BUDGETS))
    ap.add_argument("--budget-scale", type=float,
                    default=float(os.environ.get("GPU_CHECK_BUDGET_SCALE", "1")),
                    help="multiply every time budget, the deadline too (default: "
                         "$GPU_CHECK_BUDGET_SCALE or 1)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows an earlier run into --out finished and measure only the "
                         "rest (sections whose rows are all done are not run)")
    ap.add_argument("--deadline", type=float,
                    help="seconds for the whole bench (default: 280, or 180 with --dry, times "
                         "--budget-scale)")
    ap.add_argument("--section", help=argparse.SUPPRESS)  # the child's own
    ap.add_argument("--budget", type=float, help=argparse.SUPPRESS)  # the child's own
    args = ap.parse_args()
    if args.corpus:
        args.corpus = str(Path(args.corpus).resolve())
    args.out = str(Path(args.out).resolve())
    if args.section:
        child(args)
        return
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
