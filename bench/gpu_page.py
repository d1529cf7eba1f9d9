"""The GPU sections of docs/results.md, one per device, from
bench/results/gpu/<device>/gpu_bench.json (written by
bench/gpu_check.sh on a GPU machine, completed by `bash bench/gpu_check.sh --resume`): the
GPT-2-small target rows, training tokens/s and MFU by model and precision, DeltaNet's kernels
against SDPA by length, and cached decoding eager and compiled. A row that did not finish is
shown with its status and reason, never left out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import page
from common import RESULTS, markdown_table

GPU_RESULTS = RESULTS / "gpu"  # a folder per device: gpu_check.sh's OUT, named for the device
MFU_TARGET = 0.35  # GPT-2-small-shaped discrete model, bf16, compiled
EVALUATION_TARGET = 1.1  # an ODE field evaluation against a discrete layer, at most
KERNEL_FROM = 4096  # DeltaNet (fla or built-in) faster than SDPA from this length


def device_folder(name: str) -> str:
    """The folder a device's records go to: its name in lower case, runs of other characters
    as one hyphen ("NVIDIA H200" -> "nvidia-h200"; gpu_check.sh names it the same way)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def records() -> list[dict]:
    """Every device's GPU record (dry runs' left out), in the order of their folders."""
    found = (load(p) for p in sorted(GPU_RESULTS.glob("*/gpu_bench.json")))
    return [r for r in found if r is not None]


def load(path: Path | None = None) -> dict | None:
    """The GPU record at ``path`` (default: the first device's); None without one, and for a
    dry run's (CPU, toy sizes: its figures mean nothing)."""
    if path is None:
        every = records()
        return every[0] if every else None
    r = json.loads(path.read_text()) if path.is_file() else None
    return None if r is None or r.get("dry_run") else r


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _num(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}g}"


def _status(row: dict) -> str:
    if row["status"] == "done":
        # rows of records before commit stamps may predate the code they describe
        return f"done ({row['commit'][:7]})" if row.get("commit") else "done (commit not recorded)"
    why = row.get("reason") or next((v for k, v in row.items() if k.endswith("_error") and v), "")
    return f"{row['status']}: {why}" if why else row["status"]


def _rows(r: dict, section: str) -> list[dict]:
    return r.get(section, {}).get("rows", [])


def gpt2_table(r: dict) -> str:
    rows = [{"model": {"discrete": "discrete, 12 layers",
                       "ode_euler": "ODE, one block, Euler x 12"}.get(x["row"], x["row"]),
             "params": f"{x['parameters'] / 1e6:.1f} M" if x.get("parameters") else "",
             "nfe": x.get("nfe", ""), "tps": f"{x['tokens_per_s']:,.0f}"
             if x.get("tokens_per_s") else "", "tflops": _num(x.get("tflops")),
             "mfu": _pct(x.get("mfu")), "mem": _num(x.get("peak_memory_gib")),
             "eval": _num(x.get("depth_ms_per_evaluation")), "status": _status(x)}
            for x in _rows(r, "gpt2")]
    return markdown_table(rows, [("model", "GPT-2-small shape"), ("params", "parameters"),
                                 ("nfe", "layers / NFE"), ("tps", "tokens/s"),
                                 ("tflops", "TFLOP/s"), ("mfu", "MFU"),
                                 ("mem", "peak GiB"),
                                 ("eval", "ms per layer / evaluation (fwd+bwd)"),
                                 ("status", "status")])


def training_table(r: dict) -> str:
    rows = [{"config": x.get("config", x["row"]), "dtype": x.get("dtype", ""),
             "compiled": "yes" if x.get("compile") else "no",
             "tps": f"{x['tokens_per_s_median']:,.0f}" if x.get("tokens_per_s_median") else "",
             "tflops": _num(x.get("tflops")), "mfu": _pct(x.get("mfu")),
             # an interrupted run's loss is not the 150-step figure the column names
             "loss": f"{x['val_loss']:.3f}" if x.get("val_loss") is not None
             and x["status"] == "done" else "",
             "status": _status(x)} for x in _rows(r, "training")]
    return markdown_table(rows, [("config", "config (Tiny Shakespeare)"), ("dtype", "precision"),
                                 ("compiled", "compiled"), ("tps", "tokens/s (median)"),
                                 ("tflops", "TFLOP/s"), ("mfu", "MFU of that precision's peak"),
                                 ("loss", "val loss at 150 steps"), ("status", "status")])


def _ms(x: dict, name: str) -> float | None:
    """A kernel's time in a kernel row: its GPU time (CUDA events around each call) when the
    row has it, else the host's wall clock over back-to-back calls (older records)."""
    gpu = x.get(f"{name}_gpu_ms")
    return gpu if gpu is not None else x.get(f"{name}_ms")


def _gpu_timed(x: dict) -> bool:
    return x.get("sdpa_gpu_ms") is not None


def kernels_table(r: dict) -> str:
    rows = []
    for x in _rows(r, "kernels"):
        best, sdpa = _best_kernel_ms(x), _ms(x, "sdpa")
        shape = "x".join(str(x[k]) for k in ("B", "H", "D") if x.get(k) is not None)
        rows.append({"T": x.get("T", x["row"]), "shape": shape,
                     "by": "GPU (CUDA events)" if _gpu_timed(x) else "host (wall clock)",
                     "sdpa": _num(sdpa), "torch": _num(_ms(x, "chunkwise_torch")),
                     "fla": _num(_ms(x, "chunkwise_fla")),
                     "first": _num(x.get("fla_first_call_s")),
                     "ratio": f"{best / sdpa:.2f}" if best and sdpa else "",
                     "status": _status(x)})
    return markdown_table(rows, [("T", "T"), ("shape", "B x H x D"), ("by", "timed by"),
                                 ("sdpa", "SDPA ms"), ("torch", "built-in chunkwise ms"),
                                 ("fla", "fla ms"), ("first", "fla first call s"),
                                 ("ratio", "best DeltaNet / SDPA"), ("status", "status")])


def decoding_table(r: dict) -> str:
    rows = {}
    for x in _rows(r, "decoding"):
        d = rows.setdefault(x.get("mixer", x["row"]), {"mixer": x.get("mixer", x["row"]),
                                                        "status": []})
        kind = x["row"][len(d["mixer"]) + 1:] if x["row"].startswith(d["mixer"] + "-") \
            else x["row"]
        d.update({k: x[k] for k in ("cached_tok_s", "recompute_tok_s", "compiled_tok_s",
                                     "compile_first_call_s", "new_tokens") if k in x})
        if kind in ("graphed", "compiled-graphed") and "graph_tok_s" in x:
            # graph replay of the token step, of eager or of compiled units
            d[kind] = x["graph_tok_s"]
            said = f"{kind}: {'yes' if x.get('greedy_equal_to_eager') else 'no'}"
            if "graph_replays" in x:  # how much of the timed call was replay
                said += f", {x['graph_replays']}/{x['frozen_steps']} steps replayed"
            if x.get("compile_failed"):
                said += ", compiling failed (eager units)"
            d.setdefault("equal", []).append(said)
        if kind.endswith("graphed-speculative") and "speculative_tok_s" in x:
            # self-speculative decoding with both states' frozen steps replayed
            d.setdefault("spec", []).append(
                f"{x['speculative_tok_s']:.0f} ({'compiled' if kind.startswith('compiled') else 'eager'} "
                f"units; {100 * x['acceptance']:.0f}% kept, greedy equal: "
                f"{'yes' if x.get('greedy_equal_to_eager') else 'no'})")
        d["status"].append(f"{kind} {_status(x)}")
    out = []
    for d in rows.values():
        c, rc, comp = d.get("cached_tok_s"), d.get("recompute_tok_s"), d.get("compiled_tok_s")
        g, cg = d.get("graphed"), d.get("compiled-graphed")
        out.append({"mixer": d["mixer"], "new": d.get("new_tokens", ""),
                    "cached": _num(c), "recompute": _num(rc),
                    "speedup": f"{c / rc:.2f}x" if c and rc else "",
                    "compiled": _num(comp), "vs": f"{comp / c:.2f}x" if comp and c else "",
                    "first": _num(d.get("compile_first_call_s")),
                    "graphed": _num(g), "cgraphed": _num(cg),
                    "gvs": f"{max(g or 0, cg or 0) / c:.1f}x" if (g or cg) and c else "",
                    "equal": "; ".join(d.get("equal", [])),
                    "spec": "; ".join(d.get("spec", [])),
                    "status": "; ".join(d["status"])})
    columns = [("mixer", "mixer (RK4 x 4, 4 blocks, d 128)"), ("new", "new tokens"),
               ("cached", "eager cached tok/s"), ("recompute", "recompute tok/s"),
               ("speedup", "cached / recompute"), ("compiled", "compiled tok/s"),
               ("vs", "compiled / eager"), ("first", "first compiled call s")]
    if any("graphed" in x["row"] for x in _rows(r, "decoding")):  # a record from before has none
        columns += [("graphed", "graph replay tok/s (eager units)"),
                    ("cgraphed", "graph replay tok/s (compiled units)"),
                    ("gvs", "best graph replay / eager"),
                    ("equal", "greedy tokens equal eager's; frozen steps replayed")]
    if any(x["row"].endswith("-speculative") for x in _rows(r, "decoding")):
        columns += [("spec", "self-speculative, graph replay tok/s (Euler x 1 drafting 4)")]
    return markdown_table(out, columns + [("status", "status")])


def targets(r: dict) -> dict[str, str]:
    """Each target of the GPU check, said from the record: met, missed (with the figure) or
    not measured (with why)."""
    out = {}
    gpt = {x["row"]: x for x in _rows(r, "gpt2")}
    mfu = gpt.get("discrete", {}).get("mfu")
    out["mfu"] = (f"the GPT-2-small-shaped discrete model trains at {_pct(mfu)} MFU (bf16, "
                  f"compiled; target at least {MFU_TARGET:.0%}: "
                  f"{'met' if mfu >= MFU_TARGET else 'missed'})" if mfu is not None else
                  "the GPT-2-small MFU was not measured")
    ratio = r.get("gpt2", {}).get("ode_evaluation_vs_layer")
    out["evaluation"] = (f"one evaluation of the ODE block's field costs {ratio:.2f}x a discrete "
                         f"layer (target at most {EVALUATION_TARGET}x: "
                         f"{'met' if ratio <= EVALUATION_TARGET else 'missed'})"
                         if ratio is not None else "the ODE evaluation against a layer was not "
                                                   "measured")
    long = _long_rows(r)
    measured = [x for x in long if _ms(x, "sdpa") and _best_kernel_ms(x)]

    def faster(x) -> bool:
        return _best_kernel_ms(x) < _ms(x, "sdpa")

    # "missed" only once every kernel there is was timed: fla, when usable, may be the faster
    why = next((x.get("reason") for x in long if x.get("reason")), "not run")
    fla_missing = r.get("fla") is True and any(not _ms(x, "chunkwise_fla") for x in long)
    if long and len(measured) == len(long) and not all(map(_gpu_timed, measured)):
        # a host's clock over back-to-back calls times its own launches too (a fixed cost
        # per operation that these sizes do not hide): no verdict from it
        out["kernels"] = (f"DeltaNet against SDPA from T = {KERNEL_FROM} is not settled: the "
                          f"kernel rows were timed by the host's clock, not the GPU's (by that "
                          f"clock, DeltaNet's fastest kernel over SDPA: "
                          f"{kernel_ratios(measured)}), and GPU time decides it")
    elif long and len(measured) == len(long) and (all(map(faster, measured))
                                                  or not fla_missing):
        met = all(map(faster, measured))
        # each length's best kernel against SDPA, so a crossover past KERNEL_FROM shows
        ratios = kernel_ratios(measured)
        out["kernels"] = (f"DeltaNet's fastest kernel is {'' if met else 'not '}faster than "
                          f"SDPA from T = {KERNEL_FROM} (target: {'met' if met else 'missed'}; "
                          f"its time over SDPA's: {ratios})")
    elif long and len(measured) == len(long):
        out["kernels"] = (f"DeltaNet against SDPA from T = {KERNEL_FROM} is not settled: the "
                          f"built-in kernel is slower, and fla's kernel was not timed ({why})")
    else:
        out["kernels"] = (f"DeltaNet against SDPA from T = {KERNEL_FROM} is not measured yet "
                          f"({why})")
    every = [x for s in ("gpt2", "kernels", "training", "decoding") for x in _rows(r, s)]
    left = [x["row"] for x in every if x["status"] != "done"]
    out["rows"] = (f"all {len(every)} rows are done" if not left else
                   f"{len(every) - len(left)} of {len(every)} rows are done (not: "
                   f"{', '.join(left)})")
    return out


def _best_kernel_ms(x: dict) -> float | None:
    """The faster DeltaNet kernel's time of a kernel row (built-in or fla), None if neither."""
    return min((v for v in (_ms(x, "chunkwise_torch"), _ms(x, "chunkwise_fla")) if v),
               default=None)


def kernel_ratios(rows: list[dict]) -> str:
    """Each kernel row's fastest DeltaNet kernel over SDPA's time, e.g. "3.18x at T = 4096,
    0.36x at T = 16384" (rows with SDPA and at least one DeltaNet kernel timed)."""
    return ", ".join(f"{_best_kernel_ms(x) / _ms(x, 'sdpa'):.2f}x at T = {x['T']}"
                     for x in rows)


def _long_rows(r: dict) -> list[dict]:
    """The kernel rows the target speaks of: T from KERNEL_FROM on, at flash-linear-attention's
    benchmark shape (rows "wide-T...") when the record has them, else at this project's."""
    rows = [x for x in _rows(r, "kernels") if x.get("T", 0) >= KERNEL_FROM]
    wide = [x for x in rows if x["row"].startswith("wide-")]
    return wide or rows


def long_kernels(r: dict) -> list[dict]:
    """The kernel rows from KERNEL_FROM on, when every one of them has SDPA and every usable
    DeltaNet kernel timed; else []."""
    long = _long_rows(r)
    ok = all(_ms(x, "sdpa") and _ms(x, "chunkwise_torch")
             and (_ms(x, "chunkwise_fla") or r.get("fla") is not True) for x in long)
    return long if long and ok else []


def kernels_timed_by_gpu(rows: list[dict]) -> bool:
    return all(map(_gpu_timed, rows))


def eager_decoding(r: dict) -> tuple[float, float] | None:
    """Softmax attention's eager cached decoding: (tokens/s, against recomputing), or None
    when either was not measured."""
    dec = {x["row"]: x for x in _rows(r, "decoding")}.get("softmax-eager", {})
    c, rc = dec.get("cached_tok_s"), dec.get("recompute_tok_s")
    return (c, c / rc) if c and rc else None


def conclusion(r: dict) -> str:
    t = targets(r)
    dec = eager_decoding(r)
    decoding = (f"; cached decoding of the small benchmark model is launch-bound there: "
                f"{dec[0]:.0f} tokens/s, {dec[1]:.2f}x recompute" if dec else "")
    return (f"On one {r.get('device', 'GPU')}, {t['mfu']}, and {t['evaluation']}; "
            f"{t['kernels']}{decoding}.")


def heading(r: dict) -> str:
    return page.heading(page.fill("results/gpu.heading", device=r.get("device", "GPU")))


def section(r: dict) -> list[str]:
    runs = r.get("runs") or [{"command": r.get("command"), "started": r.get("started"),
                              "seconds": r.get("seconds")}]

    def said(x: dict) -> str:
        parts = [f"{x.get('started')} UTC"]
        if x.get("seconds") is not None:  # a run stopped by a signal has none
            parts.append(f"{x['seconds']:.0f} s of benchmark")
        if x.get("sections") and x.get("command", "").endswith("--resume"):
            parts.append("sections " + ", ".join(x["sections"]))
        return f"`{x.get('command')}` ({', '.join(parts)})"

    commands = "; ".join(map(said, runs))
    if len(runs) > 1:
        commands += ("; a `--resume` command measures only the rows the commands before it "
                     "left unfinished and keeps the others")
    spec = r.get("peak_flops_spec") or {}
    peaks = ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in spec.items())
    peak = r.get("peak_bf16_flops_measured")
    peak_said = ("the data sheet's dense peak of the precision (" + peaks + "; fp32 without "
                 "TF32)" if peaks else "no data sheet peak (the device is not in gpu_bench's "
                 "list), so no MFU")
    if peak:
        peak_said += f"; a bf16 matmul measured {peak / 1e12:.0f} TFLOP/s"
    t = targets(r)
    return page.fill("results/gpu.heading", device=r.get("device", "GPU")) + page.fill(
        "results/gpu", torch=r.get("torch", ""),
                     conclusion=conclusion(r), commands=commands, peak=peak_said,
                     gpt2=gpt2_table(r), training=training_table(r),
                     kernels=kernels_table(r), decoding=decoding_table(r),
                     rows=t["rows"])
