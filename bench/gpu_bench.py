"""GPU benchmarks (CUDA only): training throughput in fp32 / bf16 / compiled, DeltaNet kernels
(ours, fla's when installed, SDPA) and cached vs recomputed decoding.

    python bench/gpu_bench.py --out DIR      # writes DIR/gpu_bench.json (run by gpu_check.sh)

Sized to finish in a few minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from continuumlm import LanguageModel, ModelConfig, load_config
from continuumlm.mixers import delta_rule_chunkwise
from continuumlm.mixers.deltanet import fla_available
from continuumlm.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def cuda_ms(fn, repeats=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1000


def training(rows: list[dict], out: Path, steps: int) -> None:
    for cfg_name in ("transformer_baby", "ode_rk4", "deltanet"):
        for dtype, compile_ in (("fp32", False), ("bf16", False), ("bf16", True)):
            sets = [f"train.max_steps={steps}", f"train.eval_interval={steps}",
                    "train.eval_iters=2", f"train.checkpoint_interval={steps}",
                    "train.device=cuda", f"train.dtype={dtype}", f"train.compile={compile_}",
                    "train.batch_size=64", "train.seq_len=256", "model.max_seq_len=256"]
            cfg = load_config(ROOT / "configs" / "shakespeare_char" / f"{cfg_name}.toml", sets)
            run = out / f"train-{cfg_name}-{dtype}-{int(compile_)}"
            res = Trainer(cfg, run, quiet=True).run()
            metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            tps = sorted(m["tokens_per_s"] for m in metrics if "tokens_per_s" in m)[1:]
            rows.append({"config": cfg_name, "dtype": dtype, "compile": compile_,
                         "tokens_per_s_median": tps[len(tps) // 2] if tps else res["tokens_per_s"],
                         "val_loss": res["val_loss"]})
            print(json.dumps(rows[-1]), flush=True)


def kernels(rows: list[dict]) -> None:
    B, H, D = 4, 4, 64
    for T in (1024, 4096, 16384):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (F.normalize(torch.randn(B, H, T, D, device="cuda", generator=g), dim=-1)
                .requires_grad_() for _ in range(2))
        v = torch.randn(B, H, T, D, device="cuda", generator=g).requires_grad_()
        beta = torch.rand(B, H, T, device="cuda", generator=g).requires_grad_()

        def fwd_bwd(fn):
            def go():
                o = fn()
                o.sum().backward()
            return go

        row = {"T": T}
        row["chunkwise_torch_ms"] = cuda_ms(fwd_bwd(
            lambda: delta_rule_chunkwise(q, k, v, beta, backend="torch")[0]))
        if fla_available():
            for dt in (torch.bfloat16, torch.float16):  # fla's kernel refuses float32
                qq, kk, vv, bb = (x.detach().to(dt).requires_grad_() for x in (q, k, v, beta))
                row[f"chunkwise_fla_{str(dt)[6:]}_ms"] = cuda_ms(fwd_bwd(
                    lambda: delta_rule_chunkwise(qq, kk, vv, bb, backend="fla")[0]))
        row["sdpa_ms"] = cuda_ms(fwd_bwd(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        rows.append(row)
        print(json.dumps(row), flush=True)


@torch.no_grad()
def decoding(rows: list[dict]) -> None:
    for mixer in ("softmax", "deltanet"):
        torch.manual_seed(0)
        m = LanguageModel(ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=4,
                                      max_seq_len=1024, mixer=mixer, depth="ode",
                                      field="sequential", ode_solver="rk4",
                                      ode_steps=4)).cuda().eval()
        prompt = torch.randint(0, 65, (1, 64), device="cuda")
        row = {"mixer": mixer, "new_tokens": 256}
        for use_cache in (True, False):
            m.generate(prompt, 8, greedy=True, use_cache=use_cache)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.generate(prompt, 256, greedy=True, use_cache=use_cache)
            torch.cuda.synchronize()
            row["cached_tok_s" if use_cache else "recompute_tok_s"] = 256 / (time.perf_counter() - t0)
        row["speedup"] = row["cached_tok_s"] / row["recompute_tok_s"]
        try:  # one torch.compile graph per token step (the first call compiles)
            t0 = time.perf_counter()
            m.generate(prompt, 256, greedy=True, compile=True)
            torch.cuda.synchronize()
            row["compile_first_call_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            m.generate(prompt, 256, greedy=True, compile=True)
            torch.cuda.synchronize()
            row["compiled_tok_s"] = 256 / (time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still count
            row["compiled_error"] = f"{type(e).__name__}: {e}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "fla": fla_available()}
    failed = []

    class Rows(list):  # a section's rows; the JSON is saved again after every one
        def append(self, row):
            super().append(row)
            (out / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")

    # Each section on its own: one GPU session is short, and a failure in one section (say, a
    # corpus missing for the training runs) or a timeout must not cost the figures measured.
    for name, section in (("kernels", kernels), ("decoding", decoding),
                          ("training", lambda rows: training(rows, out / "runs", args.steps))):
        result[name] = Rows()
        try:
            section(result[name])
        except Exception as e:  # noqa: BLE001 - recorded in the JSON, reported by the exit status
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
            failed.append(name)
            print(f"{name} failed: {result[f'{name}_error']}", flush=True)
        (out / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    if failed:
        raise SystemExit(f"gpu_bench.py: {', '.join(failed)} failed (see gpu_bench.json)")


if __name__ == "__main__":
    main()
