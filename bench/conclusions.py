"""The answers of docs/results.md: its summary table ("At a glance") and the one sentence each
section opens with, every number read from bench/results/ (so the page cannot say what its
records do not). One function per section, named by its key in bench/render.py; a function
returns None when its records are missing, and the section then opens with its table.

The longer prose of each section is text in bench/pages/; the README's findings are in
bench/findings.py, and the sections that have one open with it."""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict

import findings
from common import markdown_table
from page import anchor

NANOGPT_BABY_VAL = 1.88  # nanoGPT's README, baby GPT on Tiny Shakespeare characters
ZOOLOGY_BAR = 0.99  # Zoology's recall threshold for "solves MQAR"


def _mean(xs) -> float:
    return statistics.mean(xs)


def _mean_sd(xs: list[float], digits: int = 3) -> str:
    return findings._mean_sd(xs, digits)


def _unlinked(sentence: str | None) -> str | None:
    """A README finding without its trailing link (the section is where it points)."""
    return None if sentence is None else re.sub(r"\s*\[[^\]]+\]\([^)]+\)\s*$", "", sentence)


def _link(title: str, text: str = "section") -> str:
    return f"[{text}](#{anchor(title)})"


# ---- the summary table ------------------------------------------------------------------


def _lr_best(results: dict) -> dict[tuple[str, str], tuple[str, list[float]]]:
    """(model, solve) -> (best learning rate, the seeds' val losses at it) from lr_sweep."""
    sweep = results.get("lr_sweep")
    if not sweep:
        return {}
    by: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in sweep["rows"]:
        by[(r["model"], r["solve"], r["lr"])].append(r["val_loss"])
    best: dict[tuple[str, str], tuple[str, list[float]]] = {}
    for (model, solve, lr), losses in by.items():
        if len(losses) < 3:  # a rate tried on fewer seeds is not a row's chosen setting
            continue
        if (model, solve) not in best or _mean(losses) < _mean(best[(model, solve)][1]):
            best[(model, solve)] = (lr, losses)
    return best


def summary_table(results: dict, regularizer_runs: list[dict]) -> str:
    rows: list[dict] = []

    def row(experiment, model, setting, losses_or_text, anchor_text, section, seeds=""):
        result = (losses_or_text if isinstance(losses_or_text, str)
                  else _mean_sd(losses_or_text))
        if not seeds and not isinstance(losses_or_text, str):
            seeds = str(len(losses_or_text))
        rows.append({"experiment": experiment, "model": model, "setting": setting,
                     "seeds": seeds, "result": result, "anchor": anchor_text,
                     "section": section})

    shakespeare = "Tiny Shakespeare, val loss (nats/char)"
    sh_link = _link("Tiny Shakespeare, characters: nanoGPT's CPU budget")
    best = _lr_best(results)
    base_1e3 = [r["val_loss_full_split"] for r in findings._seeds(
        results, "shakespeare_char-transformer_baby")]
    best_base = best.get(("transformer_baby", "discrete"))
    lr_links = _link("Anytime depth", "best rates") + (", [every rate](ablations.md#learning-"
                                                       "rates-on-tiny-shakespeare)")
    for (model, solve), label in ((("transformer_baby", "discrete"), "discrete Transformer, 4 layers"),
                                  (("ode_euler", "euler"), "ODE block, Euler x 4 (NFE 4)"),
                                  (("ode_rk4", "rk4"), "ODE block, RK4 x 4 (NFE 16)")):
        if (model, solve) not in best:
            continue
        lr, losses = best[(model, solve)]
        anchor_text = (f"nanoGPT {NANOGPT_BABY_VAL} at lr 1e-3 (ours at 1e-3: "
                       f"{_mean(base_1e3):.3f})" if model == "transformer_baby" and base_1e3
                       else f"discrete at its best rate: {_mean(best_base[1]):.3f}"
                       if best_base else "")
        row(shakespeare, label, f"best lr {lr}", losses, anchor_text, lr_links)
    elastic = "elastic (cw1.0 + teacher at 5e-3)"
    if (elastic, "euler") in best and (elastic, "rk4") in best:
        (lr, at4), (_, at16) = best[(elastic, "euler")], best[(elastic, "rk4")]
        row(shakespeare, "one elastic ODE model at NFE 4 / NFE 16",
            f"best lr {lr}; distilled from ode_euler",
            f"{_mean_sd(at4)} / {_mean_sd(at16)}",
            "fixed models at their best rates: "
            f"{_mean(best[('ode_euler', 'euler')][1]):.3f} / "
            f"{_mean(best[('ode_rk4', 'rk4')][1]):.3f}"
            if ("ode_euler", "euler") in best and ("ode_rk4", "rk4") in best else "",
            lr_links, seeds=str(len(at4)))
    for stem, label, ref_stem, ref_label in (
            ("deltanet_conv", "DeltaNet + short convolution, 4 layers", "transformer_baby",
             "softmax, 4 layers"),
            ("ode_parallel", "ODE block, parallel field (2212.06011), RK4 x 4",
             "ode_rk4", "sequential field")):
        runs = findings._seeds(results, f"shakespeare_char-{stem}")
        ref = findings._seeds(results, f"shakespeare_char-{ref_stem}")
        if runs and ref:
            row(shakespeare, label, "lr 1e-3", [r["val_loss_full_split"] for r in runs],
                f"{ref_label} at lr 1e-3: {_mean([r['val_loss_full_split'] for r in ref]):.3f}",
                sh_link)
    std_link = _link("Penn Treebank, standard setup")
    zaremba = f"Zaremba et al. small LSTM {findings.ZAREMBA_SMALL_TEST_PPL}"
    for stem, label in (("transformer", "discrete Transformer, 3 layers"),
                        ("ode_euler", "ODE block, Euler x 4")):
        runs = findings._seeds(results, f"ptb_std-{stem}")
        if runs and all("test_loss_full_split" in r for r in runs):
            row("PTB standard setup (10k words), test perplexity", label, "12 M tokens",
                _mean_sd([math.exp(r["test_loss_full_split"]) for r in runs], 1), zaremba,
                std_link, seeds=str(len(runs)))
    ngram = results.get("ptb-ngram")
    bigram = next((r for r in (ngram or {}).get("rows", []) if r.get("split") == "test"), None)
    for stem, label in (("transformer", "discrete Transformer, 3 layers"),
                        ("ode_rk4", "ODE block, RK4 x 4"),
                        ("ode_rk4_wide", "ODE block, RK4 x 4, parameter-matched")):
        runs = findings._seeds(results, f"ptb-{stem}")
        if runs and all("test_loss_full_split" in r for r in runs):
            row("PTB, 4k-word vocabulary, test perplexity", label, "3000 steps",
                _mean_sd([math.exp(r["test_loss_full_split"]) for r in runs], 1),
                f"bigram {bigram['bigram_ppl']:.0f}" if bigram and "bigram_ppl" in bigram else
                "n-gram references in the section", _link("Penn Treebank, word level"),
                seeds=str(len(runs)))
    rel = results.get("cat_protocol-cat_bias_relative_seed1337")
    rope = results.get("cat_protocol-softmax_rope_seed1337")
    if rel and rope:
        def ce(r, n):
            return next(c["loss"] for c in r["contexts"] if c["context"] == n)
        row("CAT's protocol, cross-entropy at 128 / 5000 characters",
            "relative-kernel attention prior", "trained at 256", f"{ce(rel, 128):.3f} / "
            f"{ce(rel, 5000):.3f}", f"RoPE {ce(rope, 128):.3f} / {ce(rope, 5000):.3f}",
            _link("CAT's context-length protocol"), seeds="1")
    for key, label in (("softmax_kv64_mixed", "softmax attention (mixed pair counts)"),
                       ("deltanet_kv64", "DeltaNet"), ("ode_deltanet_kv64", "ODE DeltaNet block")):
        r = results.get(f"mqar-{key}")
        if r:
            row("MQAR, 64 key-value pairs, recall", label,
                f"lr {r.get('lr_best') or 3e-3:g}, {r['steps']} steps",
                f"{100 * r['accuracy']:.1f}%", f"Zoology's bar {100 * ZOOLOGY_BAR:.0f}%",
                _link("Multi-query associative recall (MQAR)"), seeds="1")
    if len(regularizer_runs) > 1:
        within = [r for r in regularizer_runs[1:] if r["dloss"] <= 0.01]
        if within:
            b = max(within, key=lambda r: r["fewer"])
            row("Adaptive solver (Tsit5), forward NFE", "RNODE kinetic + Jacobian regularizers",
                b["what"], f"{100 * b['fewer']:.0f}% fewer at {100 * b['dloss']:+.2f}% loss",
                "RNODE's target: 40% fewer within 1%",
                _link("NFE regularizers on an adaptive solver"), seeds="1")
    d = results.get("decode_speed")
    if d:
        row("Decoding, 4 ODE blocks RK4 x 4, 512 tokens", "cached decoding through ODE depth",
            "eager, greedy", ", ".join(f"{r['mixer']} {r['cache_speedup']:.1f}x"
                                       for r in d["rows"]),
            "recomputing the prefix (1x); exact to 1e-4", _link("Decoding: cached vs recompute"),
            seeds="-")
    if not rows:
        return ""
    return markdown_table(rows, [("experiment", "experiment"), ("model", "model"),
                                 ("setting", "setting"), ("seeds", "seeds"),
                                 ("result", "result (mean ± sd)"), ("anchor", "set against"),
                                 ("section", "section")])


# ---- one sentence per section -----------------------------------------------------------


def shakespeare(results: dict) -> str | None:
    runs = {stem: findings._seeds(results, f"shakespeare_char-{stem}")
            for stem in ("transformer_baby", "ode_euler", "ode_rk4", "deltanet_conv",
                         "ode_wide_rk4x1")}
    if not runs["transformer_baby"] or not runs["ode_rk4"]:
        return None
    m = {k: _mean([r["val_loss_full_split"] for r in v]) for k, v in runs.items() if v}
    parts = [f"At nanoGPT's learning rate the discrete baseline reaches {m['transformer_baby']:.3f} "
             f"(nanoGPT: {NANOGPT_BABY_VAL}); one shared ODE block reaches {m['ode_rk4']:.3f} at "
             f"NFE 16"]
    if "ode_euler" in m:
        parts.append(f"{m['ode_euler']:.3f} at NFE 4")
    tail = []
    if "deltanet_conv" in m:
        tail.append(f"DeltaNet with a short convolution is the best 4-layer model "
                    f"({m['deltanet_conv']:.3f})")
    if "ode_wide_rk4x1" in m:
        tail.append(f"a parameter-matched 256-wide ODE block reaches {m['ode_wide_rk4x1']:.3f} "
                    f"at about 4x the FLOPs")
    return ", ".join(parts) + (f"; {'; '.join(tail)}" if tail else "") + "."


def cat_protocol(results: dict) -> str | None:
    return _unlinked(findings.cat(results))


def ptb(results: dict) -> str | None:
    runs = {s: findings._seeds(results, f"ptb-{s}") for s in ("transformer", "ode_rk4",
                                                             "ode_rk4_wide")}
    if not all(runs.values()) or not all("test_loss_full_split" in r
                                         for v in runs.values() for r in v):
        return None
    p = {s: _mean([math.exp(r["test_loss_full_split"]) for r in v]) for s, v in runs.items()}
    return (f"With a 4,000-word vocabulary the discrete model's test perplexity is "
            f"{p['transformer']:.1f}, one ODE block's {p['ode_rk4']:.1f} and the "
            f"parameter-matched ODE block's {p['ode_rk4_wide']:.1f}, all far below the n-gram "
            f"references.")


def ptb_std(results: dict) -> str | None:
    return _unlinked(findings.ptb(results))


def mqar(results: dict) -> str | None:
    return _unlinked(findings.mqar(results))


def regularizers(results: dict, regularizer_runs: list[dict]) -> str | None:
    return _unlinked(findings.regularizers(results, regularizer_runs))


def ode_cost(r: dict) -> str:
    by_width = defaultdict(list)
    for x in r["rows"]:
        by_width[x["width"]].append(x["ratio"])
    return ("One field evaluation costs about what one discrete layer of the same width costs "
            "(forward and backward): " + "; ".join(
                f"{min(v):.2f}-{max(v):.2f}x at d {w}" for w, v in sorted(by_width.items()))
            + " across the fixed-grid solvers, so NFE counts cost like layers.")


def ode_memory(r: dict) -> str:
    def peak(grad, steps):
        return next((x["peak_vs_4_steps"] for x in r["rows"] if x["grad"] == grad
                     and x["steps"] == steps and x["solver"] == "euler"), None)
    direct, binomial, adjoint = peak("direct", 64), peak("binomial", 256), peak("adjoint", 256)
    return (f"From 4 to 64 steps direct backpropagation's peak memory grows {direct:.1f}x; "
            f"binomial checkpointing grows it {binomial:.2f}x by 256 steps and the adjoint "
            f"{adjoint:.2f}x, at more backward evaluations.")


def deltanet_kernels(r: dict) -> str:
    rows = sorted(r["rows"], key=lambda x: x["T"])
    over = next((x["T"] for x in rows if x.get("speedup_vs_sdpa", 0) > 1), None)
    rec = [x for x in rows if x.get("speedup_vs_recurrent")]
    return (f"The chunkwise DeltaNet kernel is {rec[0]['speedup_vs_recurrent']:.0f}-"
            f"{rec[-1]['speedup_vs_recurrent']:.0f}x faster than the recurrent one"
            + (f" and faster than causal softmax attention from {over} tokens on "
               f"({rows[-1]['speedup_vs_sdpa']:.1f}x at {rows[-1]['T']})" if over else "") + ".")


def mixer_step(r: dict) -> str:
    by = defaultdict(list)
    for x in r["rows"]:
        by[x["mixer"]].append(x["vs_softmax"])
    return ("At equal depth and NFE a training step costs, against softmax attention's: "
            + "; ".join(f"{m} {min(v):.2f}-{max(v):.2f}x" for m, v in by.items()
                        if m != "softmax") + ".")


def decode_speed(r: dict, results: dict) -> str | None:
    return _unlinked(findings.decoding(results))


def depth_elasticity(r: dict, results: dict) -> str | None:
    return _unlinked(findings.elastic(results))


def depth_exit(r: dict, results: dict) -> str | None:
    best = None
    for x in r["rows"]:
        if x["criterion"] == "full":
            continue
        full = next(y["val_loss"] for y in r["rows"] if y["model"] == x["model"]
                    and y["criterion"] == "full")
        if x["val_loss"] <= full * 1.005:
            fewer = next(y["nfe_per_token"] for y in r["rows"] if y["model"] == x["model"]
                         and y["criterion"] == "full") / x["nfe_per_token"]
            if best is None or fewer > best[0]:
                best = (fewer, x)
    if best is None:
        return "No exit threshold saves field evaluations within 0.5% of full depth's loss."
    fewer, x = best
    return (f"Exiting per token saves at most {fewer:.2f}x field evaluations within 0.5% of "
            f"full depth's loss ({x['model']}, {x['criterion']} criterion, tau {x['tau']}); the "
            f"other models save less.")


def elastic_cost(r: dict, results: dict) -> str | None:
    ratios = {x["config"]: x["ratio"] for x in r["rows"]}
    elastic = {k: v for k, v in ratios.items() if k.startswith("ode_elastic")}
    if not elastic:
        return None
    return (f"Training across depths costs {min(elastic.values()):.2f}-"
            f"{max(elastic.values()):.2f}x a fixed RK4 x 4 model per step, by recipe.")


def adaptive_grads(r: dict, results: dict) -> str | None:
    modes = {(x["grad"], x["adjoint_norm"]) for x in r["rows"]}
    worst = max(r["rows"], key=lambda x: x["grad_rel_error"])
    direct = [x["peak_mb"] for x in r["rows"] if x["grad"] == "direct"]
    other = [x["peak_mb"] for x in r["rows"] if x["grad"] != "direct"]
    return (f"Every gradient mode of an adaptive solve agrees with direct backpropagation to "
            f"{worst['grad_rel_error']:.0e} relative error or better ({len(modes)} modes); "
            f"checkpointing and the adjoint cut peak memory from {min(direct):.0f} MB to "
            f"{max(other):.0f} MB or less.")


def adaptive_solvers(r: dict, results: dict) -> str | None:
    best = {}
    for x in r["rows"]:
        if abs(x["val_loss"] - x["reference_loss"]) <= 0.001:
            key = (x["model"],)
            if key not in best or x["nfe"] < best[key]["nfe"]:
                best[key] = x
    if not best:
        return None
    return ("Within 0.001 of the reference loss, the cheapest adaptive solve takes "
            + "; ".join(f"{x['nfe']} evaluations on {m} ({x['solver']}, rtol {x['rtol']:g})"
                        for (m,), x in sorted(best.items()))
            + ", against the reference's " + str(r["rows"][0]["reference_nfe"]) + ".")


def seminorm_run(r: dict, results: dict) -> str | None:
    semi = next((x for x in r["rows"] if x["norm"] == "seminorm"), None)
    if semi is None:
        return None
    return (f"In training, the seminorm adjoint took {semi['backward_vs_default']:.3f}x the "
            f"default norm's backward evaluations: no saving on this model.")


def scale(r: dict, results: dict) -> str | None:
    return (f"Two DDP processes train {r['speedup_2proc_vs_best_1proc']:.2f}x as fast as the "
            f"best single process (scaling efficiency {r['scaling_efficiency_2proc']:.2f}); "
            f"torch.compile gives {r['compile_speedup']:.2f}x and bf16 autocast "
            f"{r['bf16_speedup']:.2f}x on this CPU.")


def keep_freed_memory(r: dict, results: dict) -> str | None:
    by = defaultdict(dict)
    for x in r["rows"]:
        by[x["config"]][x["keep_freed_memory"]] = x["s_per_step"]
    cuts = [1 - v[True] / v[False] for v in by.values() if True in v and False in v]
    if not cuts:
        return None
    return (f"Keeping freed memory in the process cuts a CPU training step by "
            f"{100 * min(cuts):.0f}-{100 * max(cuts):.0f}% across {len(cuts)} configs.")


def mfu(r: dict, results: dict) -> str | None:
    vals = [float(x["mfu"].rstrip("%")) for x in r["rows"] if str(x.get("mfu", "")).endswith("%")]
    if not vals:
        return None
    return (f"Training runs reach {min(vals):.0f}-{max(vals):.0f}% of this machine's measured "
            f"fp32 matmul peak ({r['peak_gflops']:.0f} GFLOP/s).")


def data_scale(r: dict, results: dict) -> str | None:
    met = [t for t in r["targets"] if t["met"]]
    missed = [t["target"] for t in r["targets"] if not t["met"]]
    return (f"A {r['size_gb']:.0f} GB corpus is prepared and trained from memory-mapped files "
            f"within {len(met)} of {len(r['targets'])} targets"
            + (f"; missed: {'; '.join(missed)} (the page-cache pages, see below)" if missed
               else "") + ".")


def hf_generate(r: dict, results: dict) -> str | None:
    same = all(x["same_tokens"] for x in r["rows"])
    return ("Hugging Face `generate` on the exported model runs at "
            + ", ".join(f"{x['ratio']:.2f}x our decoding ({x['mixer']})" for x in r["rows"])
            + (", with the same tokens" if same else ", with different tokens") + ".")


def hf_harness(r: dict, results: dict) -> str | None:
    ratios = [x["ratio"] for x in r["rows"].values() if x.get("ratio")]
    if not ratios:
        return None
    worst = max(abs(x - 1) for x in ratios)
    return (f"lm-evaluation-harness, loading the exported checkpoints through transformers, "
            f"scores every depth within {100 * worst:.2f}% of our own evaluation "
            f"({len(ratios)} checkpoint and solve pairs).")


def threads(r: dict, results: dict) -> str | None:
    v = r.get("verdicts") or []
    if not v:
        return None
    met = [x for x in v if x["met"]]
    worst_quiet = min(x["quiet_auto_vs_default"] for x in v)
    missed = [x for x in v if not x["met"]]
    share = ""
    if missed:
        kept = [x["loaded_vs_quiet_auto"] / x["fair_share_ceiling"] for x in missed]
        ceilings = ", ".join(f"{x['work']} {x['fair_share_ceiling']:.2f}x" for x in missed)
        share = (f" The {len(missed)} missed keep {min(kept):.2f}-{max(kept):.2f} of what a "
                 f"fair share of the cores allows at all (2/3 of a core at one thread's quiet "
                 f"speed: {ceilings} of the quiet figure).")
    return (f"Beside two busy processes, `--threads auto` keeps "
            f"{min(x['loaded_vs_quiet_auto'] for x in v):.2f}-"
            f"{max(x['loaded_vs_quiet_auto'] for x in v):.2f}x of its quiet tokens/s where "
            f"torch's default count keeps {min(x['loaded_vs_quiet_default'] for x in v):.2f}-"
            f"{max(x['loaded_vs_quiet_default'] for x in v):.2f}x; {len(met)} of {len(v)} rows "
            f"meet their targets (0.4x training, 0.5x decoding), and on a quiet machine auto "
            f"runs at {worst_quiet:.2f}x or more of the default.{share}")


def cpu_kernels(r: dict, results: dict) -> str | None:
    """oneDNN's CPU kernels against torch's own for decoding (bench/cpu_kernels.py): the
    range of the speed-up per kind of decoding, and where oneDNN's GELU turns faster."""
    rows = r.get("decoding") or []
    if not rows:
        return None
    said = []
    for kind in dict.fromkeys(x["decoding"] for x in rows):
        ups = [x["speedup"] for x in rows if x["decoding"] == kind]
        span = (f"{min(ups):.2f}" if f"{min(ups):.2f}" == f"{max(ups):.2f}"
                else f"{min(ups):.2f}-{max(ups):.2f}")
        said.append(f"{span}x ({kind})")
    gelu = r.get("gelu") or []
    one = next((g for g in gelu if g["rows"] == 1), None)
    faster = [g["rows"] for g in gelu if g["speedup"] < 0.95]  # clearly faster, not a tie
    where = (f" oneDNN's GELU takes {one['onednn_us']:.1f} us on one row of 512 against "
             f"{one['own_us']:.1f} us for torch's own" if one else "")
    if faster:
        where += (f", and is the faster one from {min(faster):,} rows on: training keeps "
                  f"it")
    return (f"With oneDNN off, decoding runs at {', '.join(said)} its tokens/s with oneDNN on "
            f"(torch's default), the range over "
            f"{len(dict.fromkeys(x['model'] for x in rows))} models."
            + (where + "." if where else "")
            + " `continuumlm generate` and `serve` turn it off for a float32 model on the CPU "
              "(`--onednn auto`, the default); the library's own calls leave torch's setting "
              "as it is.")


def speculative(r: dict, results: dict) -> str | None:
    models = r.get("models") or []
    if not models:
        return None
    target = r.get("target_speedup", 2.5)
    parts, speedups = [], []
    for m in models:
        (g, gx, plain), (s, sx, _) = (findings.speculative_best(m, d)
                                      for d in ("greedy", "sampled"))
        speedups.append(max(gx, sx))
        parts.append(f"{m['name']} ({g['plain_nfe_per_token']} field evaluations per token, "
                     f"plain {plain:.0f} tokens/s): {gx:.2f}x greedy ({g['draft']} drafting "
                     f"{findings.k_of(g)}, {100 * g['acceptance']:.0f}% of drafts kept, the same tokens: "
                     f"{g['same_tokens']}), {sx:.2f}x sampled ({s['draft']}, k {findings.k_of(s)}, "
                     f"{100 * s['acceptance']:.0f}% kept)")
    best = max(speedups)
    verdict = "met" if best >= target else f"missed (best {best:.2f}x)"
    return (f"The model's own weights integrated by a coarser solve draft, its own solve "
            f"verifies a block of drafts in one pass; the fastest row per model and decoding, "
            f"against plain cached decoding's median rate over the model's rows: "
            f"{'; '.join(parts)}. Target {target}x: {verdict}. What bounds it is how often the "
            f"coarse solve agrees with the full one: a model trained for one solve (RK4 x 4) "
            f"keeps few drafts and decodes slower with them.")


def speculative_compiled(r: dict) -> str:
    """The compiled record's reading: each model's fastest rows against plain compiled
    decoding."""
    parts = []
    for m in r.get("models") or []:
        (g, gx, plain), (s, sx, _) = (findings.speculative_best(m, d, "compiled")
                                      for d in ("greedy", "sampled"))
        rates = [x["plain_tok_s"] for x in m["rows"] if x.get("mode") == "compiled"]
        parts.append(f"{m['name']} (plain compiled {plain:.0f} tokens/s, between "
                     f"{min(rates):.0f} and {max(rates):.0f} across the rows): {gx:.2f}x greedy "
                     f"({g['draft']}, k {findings.k_of(g)}, {100 * g['acceptance']:.0f}% kept, the same "
                     f"tokens: {g['same_tokens']}), {sx:.2f}x sampled ({s['draft']}, k "
                     f"{findings.k_of(s)}, {100 * s['acceptance']:.0f}% kept)")
    return (f"Compiled, the drafts run through the frozen one-token step and each "
            f"verification through a frozen step over the drafted block, against plain "
            f"compiled decoding: {'; '.join(parts)}. A compiled step's cost is mostly fixed "
            f"(its kernels' launches and the host's work around them), so a draft solve of "
            f"few field evaluations saves less of it than eagerly. Where plain decoding's "
            f"rate moved widely between rows, the machine was shared while it ran, and a "
            f"speed-up read against the median is that uncertain.")


def ode_kv(r: dict, results: dict) -> str | None:
    verdicts = r.get("verdicts") or []
    blocks = [v for v in verdicts if v["ode_kv"] == "block"]
    if not blocks:
        return ("No trained runs are recorded yet (`continuumlm experiment ode_kv`); the table "
                "shows the decoding cache and speeds of the models it trains.")
    target = r.get("target", 0.01)

    def said(v: dict) -> str:
        return (f"{v['group']}: {100 * v['loss_change']:+.2f}% {v['split']} loss "
                f"({100 * v['ppl_change']:+.1f}% perplexity) at {v['memory_ratio']:.3g} of the "
                f"cache ({v['seeds'][1]} seed(s) against {v['seeds'][0]})")

    met = [v["group"] for v in blocks if v["within_target"]]
    missed = [f"{v['group']} ({100 * v['loss_change']:+.2f}%, {v['seeds'][1]} seed(s))"
              for v in blocks if not v["within_target"]]
    corpora = {g.split(",")[0] for g in met}
    verdict = (f"met for {', '.join(met)}" if met else "missed") + (
        f"; missed for {', '.join(missed)}" if missed and met else
        f" ({', '.join(missed)})" if missed else "") + (
        "" if {"Tiny Shakespeare", "PTB"} <= corpora else "; not yet met on both corpora")
    steps = [v for v in verdicts if v["ode_kv"] == "step"]
    # the trade: step keeps more cache than block (RK4: 4 times); it is the better one where
    # its loss is the lower of the two
    block_of = {b["group"]: b for b in blocks}
    lower = [v for v in steps
             if v["group"] in block_of and v["loss_change"] < block_of[v["group"]]["loss_change"]]
    not_lower = [v["group"] for v in steps if v["group"] in block_of and v not in lower]
    by = ", ".join(
        f"{v['group']} (by {100 * (block_of[v['group']]['loss_change'] - v['loss_change']):.2f} "
        f"points, at {v['memory_ratio'] / block_of[v['group']]['memory_ratio']:.3g} times "
        f"block's cache)" for v in lower)
    trade = "; ".join(
        ([f"a lower loss than block's on {by}"]
         if lower else []) +
        ([f"no lower than block's on {', '.join(not_lower)}, where block is the better trade"]
         if not_lower else []))
    step_text = (". Memory from the start of each solver step: " + "; ".join(said(v) for v in steps) +
                 (f" ({trade})" if trade else "")
                 if steps else "")
    again = [f"{x['group']} seed {seed}: {v['val_loss']:.4f} against the recorded "
             f"{v['recorded']:.4f}, the seeds' sd being {x['val_loss_sd']:.3f}"
             for x in r.get("rows", []) for seed, v in (x.get("retrained") or {}).items()]
    retrained = (f" The evaluation rows are the earlier experiments' records; trained again by "
                 f"this version ({'; '.join(again)}), they land within the seeds' spread: "
                 f"float32 training on another thread count is another run (1 and 2 threads "
                 f"give weights 1e-7 apart after 30 steps, and the gap grows over a run)."
                 if again else "")
    return (f"Memory from the block's input: {'; '.join(said(v) for v in blocks)}{step_text}. "
            f"Target (block within {100 * target:.0f}% of the loss at 1/16 of the cache, RK4 x "
            f"4, both corpora): {verdict}.{retrained}")


def agreement(r: dict, results: dict) -> str | None:
    """Greedy agreement of the coarse solves with the own solve: the any-depth recipe against
    the model trained for its own solve alone, at the cheapest draft and at RK4 x 1."""
    rows = {(x["model"], x["draft"]): x for x in r.get("rows", [])}
    if ("ode_any_depth", "euler:1") not in rows or ("ode_rk4", "euler:1") not in rows:
        return None
    parts = []
    for draft in ("euler:1", "rk4:1"):
        a, b = rows.get(("ode_rk4", draft)), rows.get(("ode_any_depth", draft))
        if a and b:
            parts.append(f"{draft.replace(':', ' x ')} ({b['nfe']} field evaluations) from "
                         f"{100 * a['agreement']:.0f}% to {100 * b['agreement']:.0f}%")
    own_a = rows[("ode_rk4", "euler:1")]["own_loss"]
    own_b = rows[("ode_any_depth", "euler:1")]["own_loss"]
    seeds = rows[("ode_any_depth", "euler:1")]["seeds"]
    alone = rows[("ode_rk4", "euler:1")]["seeds"]

    def count(n: int) -> str:
        return f"{n} seed{'s' * (n != 1)}"
    text = (f"Teaching the coarse solves the own solve's next-token distribution in the same "
            f"step (train.any_depth) raises their greedy agreement with it, "
            f"{' and '.join(parts)} of the validation positions (RK4 x 4 trained alone, "
            f"{count(alone)}, against the recipe, {count(seeds)}; means), for "
            f"{own_b - own_a:+.4f} in the own solve's validation loss "
            f"({own_a:.4f} to {own_b:.4f}).")
    a2, b2 = rows.get(("ode_rk4-lr2e-3", "euler:1")), rows.get(("ode_any_depth-lr2e-3",
                                                                 "euler:1"))
    if a2 and b2:
        b24 = rows.get(("ode_any_depth-lr2e-3", "rk4:1"))
        text += (f" At lr 2e-3, RK4 x 4's best (bench/lr_sweep.py), the recipe "
                 f"({count(b2['seeds'])}) reads {b2['own_loss']:.4f} against "
                 f"{a2['own_loss']:.4f} ({count(a2['seeds'])}), "
                 f"{100 * (b2['own_loss'] / a2['own_loss'] - 1):+.1f}% (target +0.5%), at "
                 f"{100 * b2['agreement']:.0f}% agreement for Euler x 1"
                 + (f" and {100 * b24['agreement']:.0f}% for RK4 x 1" if b24 else "") + ".")
    light = [name for name in ("ode_any_depth-w0.5-lr2e-3", "ode_any_depth-w0.7-lr2e-3",
                               "ode_any_depth-w0.85-lr2e-3", "ode_any_depth-w0.85-draws2-lr2e-3",
                               "ode_any_depth-w0.7-fine-lr2e-3")
             if (name, "euler:1") in rows]
    if a2 and light:
        said = []
        for name in light:
            w = name.split("-w")[1].split("-")[0]
            e1, r1, e4 = (rows.get((name, d)) for d in ("euler:1", "rk4:1", "euler:4"))
            fine = (" with RK4 x 8 among the drafts" if "-fine" in name else
                    " training two of its three drafts a step (draws = 2, "
                    "ode_any_depth_tuned.toml)" if "-draws2" in name else "")
            said.append(f"weight {w}{fine} ({count(e1['seeds'])}) reads {e1['own_loss']:.4f}, "
                        f"{100 * (e1['own_loss'] / a2['own_loss'] - 1):+.1f}%, at "
                        f"{100 * e1['agreement']:.1f}% for Euler x 1"
                        + (f", {100 * r1['agreement']:.1f}% for RK4 x 1" if r1 else "")
                        + (f" and {100 * e4['agreement']:.1f}% for Euler x 4" if e4 else ""))
        text += (f" A lighter KL term trades agreement for quality: at lr 2e-3, "
                 f"{'; '.join(said)} (targets: +0.5%, 75% and 90%).")
    kv = {d: rows.get(("ode_any_depth-kvblock", d)) for d in ("euler:1", "rk4:1", "rk4:16")}
    kv_alone = rows.get(("ode_rk4-kvblock-lr2e-3", "rk4:1"))
    half = {d: rows.get(("ode_any_depth-kvblock-w0.5", d)) for d in ("euler:1", "rk4:1", "rk4:16")}
    if a2 and kv["euler:1"] and kv["rk4:1"]:
        e1, r1, fine = kv["euler:1"], kv["rk4:1"], kv["rk4:16"]
        text += (f" With the memory from the block's input (model.ode_kv = 'block': every "
                 f"solve reads the keys and values of the block's input), the tuned recipe "
                 f"({count(e1['seeds'])}) agrees at {100 * e1['agreement']:.1f}% for Euler x 1 "
                 f"and {100 * r1['agreement']:.1f}% for RK4 x 1 (lowest seed "
                 f"{100 * r1['agreement_min']:.1f}%), and RK4 x 1 reads {r1['loss']:.4f} "
                 f"against its own solve's {r1['own_loss']:.4f}"
                 + (f" (RK4 x 16: {fine['loss']:.4f})" if fine else "")
                 + f"; its own solve is {100 * (r1['own_loss'] / a2['own_loss'] - 1):+.1f}% "
                   f"against ode_rk4 at lr 2e-3"
                 + (f", and {100 * (r1['own_loss'] / kv_alone['own_loss'] - 1):+.1f}% against "
                    f"ode_rk4 with that memory at lr 2e-3 ({count(kv_alone['seeds'])}; "
                    f"{kv_alone['own_loss']:.4f}, its RK4 x 1 agreeing at "
                    f"{100 * kv_alone['agreement']:.0f}%)" if kv_alone else "") + ".")
    if a2 and half["euler:1"] and half["rk4:1"]:
        e1, r1, fine = half["euler:1"], half["rk4:1"], half["rk4:16"]
        text += (f" That memory leaves room for a lighter KL term: at weight 0.5 "
                 f"(ode_any_depth_kvblock.toml, {count(e1['seeds'])}) the own solve reads "
                 f"{e1['own_loss']:.4f}, {100 * (e1['own_loss'] / a2['own_loss'] - 1):+.2f}% "
                 f"against ode_rk4 at lr 2e-3, at {100 * e1['agreement']:.1f}% for Euler x 1 "
                 f"and {100 * r1['agreement']:.1f}% for RK4 x 1"
                 + (f", RK4 x 16 {fine['loss'] - fine['own_loss']:+.4f} past the own solve"
                    if fine else "") + " (targets: +0.5%, 75% and 90%).")
    e4, fixed = rows.get(("ode_any_depth-euler4-lr5e-3", "euler:4")), rows.get(
        ("ode_euler-lr5e-3", "euler:4"))
    if e4 and fixed:
        drafts = [x for (m, _), x in rows.items() if m == "ode_any_depth-euler4-lr5e-3"]
        worst = max(drafts, key=lambda x: x["loss"])
        e1 = rows.get(("ode_any_depth-euler4-lr5e-3", "euler:1"))
        text += (f" With Euler x 4 (NFE 4) as the own solve, at the fixed Euler x 4 model's "
                 f"best lr (5e-3), and Euler x 1, Euler x 2 and RK4 x 4 as the drafts "
                 f"({count(e4['seeds'])}), NFE 4 reads {e4['own_loss']:.4f} against "
                 f"{fixed['own_loss']:.4f} for Euler x 4 trained alone "
                 f"({count(fixed['seeds'])}), {e4['own_loss'] - fixed['own_loss']:+.4f} (target "
                 f"within 0.01)"
                 + (f", with Euler x 1 agreeing at {100 * e1['agreement']:.1f}% (a quarter of "
                    f"its evaluations)" if e1 else "")
                 + f", and its other solves get worse: {worst['draft'].replace(':', ' x ')} "
                 f"(NFE {worst['nfe']}) reads {worst['loss']:.4f}.")
    text += _nfe4_kvblock(rows, fixed)
    text += _told_the_time(rows, a2, fixed)
    text += _agreement_bought(rows, a2)
    ptb = [(name, label) for name, label in (("ptb_ode_rk4", "ode_rk4 trained alone"),
                                              ("ptb_ode_any_depth", "the recipe"),
                                              ("ptb_ode_any_depth-fine",
                                               "the recipe with RK4 x 8 among the drafts"),
                                              ("ptb_ode_any_depth-euler1",
                                               "ode_any_depth_euler1.toml's recipe (the "
                                               "memory from the block's input, the field told "
                                               "the time, Euler x 1 taught at KL weight 0.5)"))
           if (name, "euler:1") in rows]
    if ptb:
        curves = []
        for name, label in ptb:
            drafts = sorted((x for (m, _), x in rows.items() if m == name),
                            key=lambda x: (x["nfe"], x["draft"]))
            own = drafts[0]["own_loss"]
            finer = [x for x in drafts if x["nfe"] > 16]
            worst = max(finer, key=lambda x: x["loss"]) if finer else None
            flat = findings.never_worse(drafts)
            curves.append(f"{label} ({count(drafts[0]['seeds'])}): NFE 1 {drafts[0]['loss']:.4f}, "
                          f"own (NFE 16) {own:.4f}"
                          + (f", {worst['draft'].replace(':', ' x ')} (NFE {worst['nfe']}) "
                             f"{worst['loss']:.4f} ({worst['loss'] - own:+.4f})" if worst else "")
                          + f", Euler x 1 agreeing at {100 * drafts[0]['agreement']:.1f}%"
                          + (", never worse with more evaluations" if flat else ""))
        text += (" On other text, Penn Treebank words (configs/ptb/ode_rk4.toml's model and "
                 "budget), the validation loss against the solve reads: " + "; ".join(curves)
                 + " (every solve on the ablations page's table).")
    return text


def _seeds(n: int) -> str:
    return f"{n} seed{'s' * (n != 1)}"


def _nfe4_kvblock(rows: dict, fixed: dict | None) -> str:
    """The kv-block recipe with Euler x 4 (NFE 4) as its own solve against the fixed NFE-4
    model (Euler x 4 trained alone at its best lr), and the same model with block memory
    trained alone: the NFE-4 target, its coarse solves' agreement, and the finer solves."""
    name = "ode_any_depth-kvblock-euler4-lr5e-3"
    own, e1, e2 = (rows.get((name, d)) for d in ("euler:4", "euler:1", "euler:2"))
    if not (own and e1 and fixed):
        return ""
    alone = rows.get(("ode_euler-kvblock-lr5e-3", "euler:4"))
    finest = rows.get((name, "rk4:16"))
    gap = own["own_loss"] - fixed["own_loss"]
    text = (f" With the memory from the block's input and Euler x 4 (NFE 4) as the own solve "
            f"(ode_any_depth_nfe4.toml: lr 5e-3, Euler x 1 and x 2 drafted at KL weight 0.5; "
            f"{_seeds(own['seeds'])}), "
            f"NFE 4 reads {own['own_loss']:.4f} against {fixed['own_loss']:.4f} for Euler x 4 "
            f"trained alone ({_seeds(fixed['seeds'])}), {gap:+.4f} (target within 0.01: "
            f"{'met' if gap <= 0.01 else 'missed'})"
            + (f", and {alone['own_loss']:.4f} for Euler x 4 with that memory trained alone "
               f"({_seeds(alone['seeds'])}, its Euler x 1 agreeing at "
               f"{100 * rows[('ode_euler-kvblock-lr5e-3', 'euler:1')]['agreement']:.0f}%)"
               if alone and ("ode_euler-kvblock-lr5e-3", "euler:1") in rows else "")
            + f"; Euler x 1 agrees at {100 * e1['agreement']:.1f}% (lowest seed "
              f"{100 * e1['agreement_min']:.1f}%; a quarter of its evaluations, target 90%)"
            + (f" and Euler x 2 at {100 * e2['agreement']:.1f}%" if e2 else ""))
    heavy = rows.get(("ode_any_depth-kvblock-euler4-w1-lr5e-3", "euler:1"))
    if heavy:
        gap1 = heavy["own_loss"] - fixed["own_loss"]
        both = gap1 <= 0.01 and heavy["agreement_min"] >= 0.9
        cheaper = [x for (m, _), x in rows.items()
                   if m == "ode_any_depth-kvblock-euler4-w1-lr5e-3" and x["nfe"] < 4
                   and x["loss"] < x["own_loss"]]
        text += (f"; at KL weight 1 ({_seeds(heavy['seeds'])}) Euler x 1 agrees at "
                 f"{100 * heavy['agreement']:.1f}% (lowest seed "
                 f"{100 * heavy['agreement_min']:.1f}%) and NFE 4 reads "
                 f"{heavy['own_loss']:.4f}, {gap1:+.4f} against the fixed model"
                 + (", both targets" if both else "")
                 + "".join(f", though {x['draft'].replace(':', ' x ')} (NFE {x['nfe']}) then "
                           f"reads {x['loss']:.4f}, better than the own solve"
                           for x in cheaper[:1]))
    if finest:
        text += (f". Finer solves of that field are worse: RK4 x 16 (NFE 64) reads "
                 f"{finest['loss']:.4f}, so this model meets the NFE-4 target and not the "
                 f"non-increasing one, and the models whose own solve is RK4 x 4 the reverse")
    return text + "."


def _told_the_time(rows: dict, rk4: dict | None, fixed: dict | None) -> str:
    """The field told the time (model.ode_time_embedding = "sinusoidal") against the same
    models without it: ode_rk4 at lr 2e-3, the kv-block recipe, Euler x 4 at lr 5e-3."""
    plain_rk4 = rows.get(("ode_rk4-time-lr2e-3", "rk4:1"))
    recipe = {d: rows.get(("ode_any_depth-kvblock-time", d)) for d in ("euler:1", "rk4:1")}
    euler = rows.get(("ode_euler-time-lr5e-3", "euler:4"))
    base = rows.get(("ode_any_depth-kvblock-w0.5", "rk4:1"))
    if not (plain_rk4 and recipe["euler:1"] and recipe["rk4:1"] and rk4 and base):
        return ""
    e1, r1 = recipe["euler:1"], recipe["rk4:1"]
    text = (f" Telling the field the time (model.ode_time_embedding = 'sinusoidal'): ode_rk4 "
            f"at lr 2e-3 reads {plain_rk4['own_loss']:.4f} ({_seeds(plain_rk4['seeds'])}) "
            f"against {rk4['own_loss']:.4f} without it; ode_any_depth_kvblock.toml reads "
            f"{e1['own_loss']:.4f} ({_seeds(e1['seeds'])}) against {base['own_loss']:.4f}, "
            f"{100 * (e1['own_loss'] / rk4['own_loss'] - 1):+.2f}% against ode_rk4 at lr 2e-3 "
            f"and {100 * (e1['own_loss'] / plain_rk4['own_loss'] - 1):+.2f}% against ode_rk4 "
            f"told the time, at {100 * e1['agreement']:.1f}% for Euler x 1 and {100 * r1['agreement']:.1f}% "
            f"for RK4 x 1, whose loss (NFE 4) is {r1['loss']:.4f}")
    if fixed:
        text += f", {r1['loss'] - fixed['own_loss']:+.4f} against the fixed NFE-4 model"
    h1, h2 = (rows.get(("ode_any_depth-kvblock-time-w1", d)) for d in ("euler:1", "euler:2"))
    e2 = rows.get(("ode_any_depth-kvblock-time", "euler:2"))
    if h1 and h2 and e2:
        text += (f"; at KL weight 1 ({_seeds(h1['seeds'])}) Euler x 1 and x 2 agree at "
                 f"{100 * h1['agreement']:.1f}% and {100 * h2['agreement']:.1f}% (against "
                 f"{100 * e1['agreement']:.1f}% and {100 * e2['agreement']:.1f}% at 0.5) for "
                 f"an own solve of {h1['own_loss']:.4f}")
    if euler and fixed:
        text += (f"; Euler x 4 at lr 5e-3 reads {euler['own_loss']:.4f} "
                 f"({_seeds(euler['seeds'])}) against {fixed['own_loss']:.4f} without it")
    return text + "."


def _agreement_bought(rows: dict, rk4: dict | None) -> str:
    """Euler x 1's agreement pushed further, one seed each: the kv-block recipe told the time
    with Euler x 1 alone drafted at KL weight 2, and the recipe with a step-size embedding
    (its finest solve's loss too: a step the embedding never saw)."""
    x1 = {d: rows.get(("ode_any_depth-kvblock-time-x1w2", d)) for d in ("euler:1", "euler:2")}
    dt = {d: rows.get(("ode_any_depth-kvblock-dt", d)) for d in ("euler:1", "euler:2")}
    if not rk4:
        return ""
    parts = []
    own = {d: rows.get(("ode_any_depth-euler1", d)) for d in ("euler:1", "euler:2", "rk4:1")}
    if all(own.values()):
        e1 = own["euler:1"]
        finest = max((x for (m, _), x in rows.items() if m == "ode_any_depth-euler1"),
                     key=lambda x: x["nfe"])
        parts.append(f"told the time, with Euler x 1 alone drafted (ode_any_depth_euler1.toml, "
                     f"KL weight 0.5, {_seeds(e1['seeds'])}), the own solve reads "
                     f"{e1['own_loss']:.4f}, {100 * (e1['own_loss'] / rk4['own_loss'] - 1):+.2f}% "
                     f"against ode_rk4 at lr 2e-3, with Euler x 1, Euler x 2 and RK4 x 1 at "
                     f"{100 * e1['agreement']:.1f}% (lowest seed "
                     f"{100 * e1['agreement_min']:.1f}%), "
                     f"{100 * own['euler:2']['agreement']:.1f}% and "
                     f"{100 * own['rk4:1']['agreement']:.1f}%, and "
                     f"{finest['draft'].replace(':', ' x ')} {finest['loss'] - e1['own_loss']:+.4f} "
                     f"past the own solve")
    w1 = rows.get(("ode_any_depth-kvblock-time-x1w1", "euler:1"))
    if w1:
        parts.append(f"at KL weight 1 ({_seeds(w1['seeds'])}) Euler x 1 agrees at "
                     f"{100 * w1['agreement']:.1f}% for an own solve of {w1['own_loss']:.4f} "
                     f"({100 * (w1['own_loss'] / rk4['own_loss'] - 1):+.2f}%)")
    if x1["euler:1"] and x1["euler:2"]:
        e1 = x1["euler:1"]
        parts.append(f"at KL weight 2 "
                     f"({_seeds(e1['seeds'])}), Euler x 1 and x 2 agree at "
                     f"{100 * e1['agreement']:.1f}% and {100 * x1['euler:2']['agreement']:.1f}%, "
                     f"but the own solve reads {e1['own_loss']:.4f}, "
                     f"{100 * (e1['own_loss'] / rk4['own_loss'] - 1):+.2f}% against ode_rk4 at "
                     f"lr 2e-3")
    if dt["euler:1"] and dt["euler:2"]:
        e1 = dt["euler:1"]
        finest = max((x for (m, _), x in rows.items() if m == "ode_any_depth-kvblock-dt"),
                     key=lambda x: x["nfe"])
        worse = finest["loss"] > e1["own_loss"] + 1e-3
        parts.append(f"with a step-size embedding (model.ode_dt_embedding; "
                     f"{_seeds(e1['seeds'])}) the own solve reads {e1['own_loss']:.4f} with "
                     f"Euler x 1 and x 2 at {100 * e1['agreement']:.1f}% and "
                     f"{100 * dt['euler:2']['agreement']:.1f}%, and "
                     f"{finest['draft'].replace(':', ' x ')} reads {finest['loss']:.4f}"
                     + ("; finer solves get worse, at steps the embedding never saw"
                        if worse else ""))
    return (" Euler x 1's agreement pushed further: " + "; ".join(parts) + ".") if parts else ""


def layer_skip(r: dict, results: dict) -> str | None:
    """The discrete stack's first-layers agreement with LayerSkip's recipe against without,
    the loss it costs, and what speculative decoding with --draft-layers gains on it."""
    rows = {(x["model"], x["draft"]): x for x in r.get("rows", [])}
    base, ls = rows.get(("transformer_baby", "layers:1")), rows.get(("transformer_layerskip",
                                                                     "layers:1"))
    if not base or not ls:
        return None
    parts = []
    for draft in ("layers:1", "layers:2"):
        a, b = rows.get(("transformer_baby", draft)), rows.get(("transformer_layerskip", draft))
        if a and b:
            n = int(draft.split(":")[1])
            parts.append(f"{'its first layer' if n == 1 else f'its first {n} layers'} from "
                         f"{100 * a['agreement']:.0f}% to {100 * b['agreement']:.0f}%")
    text = (f"LayerSkip's recipe raises the greedy agreement of the baby GPT's first layers "
            f"with all four, {' and '.join(parts)} ({_seeds(base['seeds'])} without it, "
            f"{_seeds(ls['seeds'])} with it; means), for {ls['own_loss'] - base['own_loss']:+.4f} in the whole "
            f"stack's validation loss ({base['own_loss']:.4f} to {ls['own_loss']:.4f}, "
            f"{100 * (ls['own_loss'] / base['own_loss'] - 1):+.1f}%).")
    trained = findings.speculative_models(results, "speculative_layerskip", "layerskip")
    if trained:
        target = 1.5
        said, low = [], float("inf")
        for d in ("greedy", "sampled"):
            speedup, lo, hi, best = findings.median_seed(trained, d)
            low = min(low, speedup)  # the target asks it of both decodings
            said.append(f"{speedup:.2f}x {d} ({lo:.2f}-{hi:.2f}x over the seeds; the median "
                        f"seed's {best['draft']}, k {findings.k_of(best)}, "
                        f"{100 * best['acceptance']:.0f}% kept)")
        verdict = "met" if low >= target else "missed"
        text += (f" Drafting with its first layers then runs at {' and '.join(said)} plain "
                 f"cached decoding, the median of {len(trained)} seeds (target {target}x: "
                 f"{verdict})")
        untrained = findings.speculative_models(results, "speculative_layerskip",
                                                "transformer_baby")
        if untrained:
            s = findings.speculative_best(untrained[0], "greedy")[1]
            text += f", against {s:.2f}x greedy on the baby GPT trained without it"
        text += "." + _against_pass(trained, "every layer of the stack")
        best = findings.median_seed(trained, "greedy")[3]
        if "outside_field" in best:
            text += (f" What bounds it: a drafted token pays the embedding, final norm, head "
                     f"and Python of a whole token for one layer's work, so the median seed's "
                     f"fastest greedy row spends {100 * best['outside_field']:.0f}% of its "
                     f"time outside the layers against "
                     f"{100 * best['plain_outside_field']:.0f}% in plain decoding.")
        median = findings.median_model(trained, "greedy")
        bound = findings.speculative_bound(median, target)
        if bound:
            text += (f" Timed pass by pass (one cached forward alone, before a round's "
                     f"bookkeeping; the verification as a whole-stack pass over the drafted "
                     f"block, which decoding resumes from the drafts' first layers at "
                     f"somewhat less): {bound}.")
    one = rows.get(("transformer_layerskip-exit-at-1", "layers:1"))
    # its seeds' own record (speculative_layerskip_x1), else the first seed's among the variants
    at1 = (findings.speculative_models(results, "speculative_layerskip_x1", "layerskip_x1")
           or findings.speculative_models(results, "speculative_layerskip_variants",
                                          "layerskip_x1"))
    if one and at1:
        said = []
        for d in ("greedy", "sampled"):
            speedup, lo, hi, best = findings.median_seed(at1, d)
            said.append(f"{speedup:.2f}x {d}" + (f" ({lo:.2f}-{hi:.2f}x over the seeds; the "
                                                   f"median seed's {best['draft']}, k "
                                                   f"{findings.k_of(best)}, "
                                                   f"{100 * best['acceptance']:.0f}% kept)"
                                                   if len(at1) > 1 else ""))
        # met when both decodings reach it (findings.layer_skip reads it the same way)
        top = min(findings.median_seed(at1, d)[0] for d in ("greedy", "sampled"))
        distinct = sorted(m.get("distinct_new_tokens", 0) for m in at1)
        text += (f" Putting the whole exit loss after the first layer (exit_layers = [1], "
                 f"{_seeds(one['seeds'])}; configs/shakespeare_char/"
                 f"transformer_layerskip_first.toml), the layer the drafts use, raises its "
                 f"agreement to {100 * one['agreement']:.0f}% (lowest seed "
                 f"{100 * one['agreement_min']:.0f}%) at {one['own_loss']:.4f} for the whole "
                 f"stack ({100 * (one['own_loss'] / base['own_loss'] - 1):+.1f}% against the "
                 f"baby GPT trained without it), and drafting to {' and '.join(said)}"
                 + (f", the median of {len(at1)} seeds"
                    + (", each seed's fastest row re-timed"
                       if all(len(m.get("confirmed") or {}) >= 2 for m in at1) else "")
                    + f" (target 1.5x for both: "
                    f"{'met' if top >= 1.5 else 'missed'}; greedy text from these small "
                    f"models repeats itself ({distinct[0]}-{distinct[-1]} distinct characters "
                    f"in each seed's plain greedy output), which drafts predict well, so the "
                    f"sampled figure is the sterner one)" if len(at1) > 1 else "") + "."
                 + _against_pass(at1, "every layer of the stack"))
    text += _layer_skip_kl(rows, results, base, one)
    text += pipelined(results, "speculative_pipelined_layerskip", "layerskip_x1kl1",
                      "transformer_layerskip_kl.toml, first-layer drafts",
                      "speculative_layerskip_kl", 1.5)
    text += pipelined_native(results, "speculative_pipelined_layerskip_native",
                             "speculative_pipelined_layerskip", "layerskip_x1kl1", 1.5)
    deep = rows.get(("transformer_layerskip-12-layers", "layers:3"))
    deep_trained = findings.speculative_models(results, "speculative_layerskip12", "layerskip")
    if deep and deep_trained:
        best, speedup, _ = findings.speculative_best(deep_trained[0], "greedy")
        text += (f" Twelve layers of the same width give the drafts more to stand in for but "
                 f"agree less per layer: the recipe's first 3 layers agree at "
                 f"{100 * deep['agreement']:.0f}%, and drafting runs at {speedup:.2f}x greedy "
                 f"at best ({best['draft']}, k {findings.k_of(best)}"
                 + ("; plain decoding and the drafts through the decoding pass, measured before "
                    "the stack's lean step" if not any("plain_by" in x
                                                       for x in deep_trained[0]["rows"]) else "")
                 + ").")
    return text


def gate_exit(r: dict, results: dict) -> str | None:
    """Per run: the most evaluations the learned gate saves within 0.5% of full depth's loss,
    against the state criterion's on the same model (target: 2x)."""
    rows = r.get("rows", [])
    models = list(dict.fromkeys(x.get("model") for x in rows))
    chosen = {m: findings.exit_choices(rows, m) for m in models}

    def saves(x) -> str:
        if x is None:
            return "saves nothing"
        return (f"saves {x['fewer_evaluations']:.2f}x field evaluations (tau {x['tau']}, "
                f"{x['loss_change']})")

    parts = []
    for m, (full, best, _) in chosen.items():
        if full is None:
            continue
        on = "the same any-depth model" if m is None else f"{m} (full depth {full['val_loss']})"
        parts.append((f"exiting through the learned gate {saves(best['gate'])} and the state "
                      f"criterion {saves(best['state'])} on {on}", best["gate"]))
    if not parts:
        return None
    text = "Within 0.5% of full depth's loss, " + "; ".join(p for p, _ in parts) + "."
    if models != [None]:
        top = max((g["fewer_evaluations"] if g else 1.0) for _, g in parts)
        text += (f" Target 2x: {'met' if top >= 2 else 'missed'} (best {top:.2f}x).")
        first = chosen[models[0]][0]
        for m in models[1:] if first else []:
            full, _, most = chosen[m]
            if most is None or full is None:
                continue
            change = full["val_loss"] / first["val_loss"] - 1
            text += (f" {m}'s full depth reads {full['val_loss']} against {models[0]}'s "
                     f"{first['val_loss']} ({100 * change:+.1f}%); its gate stops "
                     f"tokens early (at most {most['fewer_evaluations']:.2f}x fewer evaluations, "
                     f"tau {most['tau']}, {most['loss_change']} on its own full depth).")
    return text


def truncated_backprop(r: dict, results: dict) -> str | None:
    rows = r.get("rows", [])
    one = next((x for x in rows if x["steps"] == 4 and x["backprop_steps"] == 1), None)
    if one is None:
        return None
    text = (f"Backpropagating through the last of 4 RK4 steps takes {one['peak_vs_all']:.2f}x "
            f"the peak memory and {one['time_vs_all']:.2f}x the time of a training step "
            f"through all four")
    quarters = [x for x in rows if x["steps"] > 4 and x["backprop_steps"] == x["steps"] // 4]
    if quarters:
        text += "; through the last quarter of the steps (Huginn's share), " + ", ".join(
            f"{x['peak_vs_all']:.2f}x the memory and {x['time_vs_all']:.2f}x the time at "
            f"{x['steps']} steps" for x in quarters)
    losses = r.get("losses") or []
    for x in losses:
        solve = ("the last of 4 steps" if x["steps"] == 4 and x["backprop_steps"] == 1
                 else f"the last {x['backprop_steps']} of {x['steps']} RK4 steps")
        change = 100 * (x["val_loss"] / x["reference_val_loss"] - 1)
        if x["backprop_skip"]:
            solve += " with the gradient passed on to the block's input (backprop_skip)"
        text += (f"; trained through {solve}, ode_rk4.toml"
                 f"{'' if x['steps'] == 4 else ' at RK4 x ' + str(x['steps'])} reaches "
                 f"a validation loss of {x['val_loss']:.4f} against "
                 f"{x['reference_val_loss']:.4f} through every step ({change:+.1f}%)")
    text += "."
    pair = [next((x for x in losses if x.get("steps") == 8 and x["backprop_steps"] == 2
                  and x["backprop_skip"] == skip), None) for skip in (False, True)]
    if None not in pair:
        plain, skip = (x["val_loss"] - x["reference_val_loss"] for x in pair)
        text += (f" What the truncation costs: the state after the untracked steps is detached, "
                 f"so the embeddings learn only as the (tied) head does, and no gradient comes "
                 f"from the field's evaluations in those steps; passing the gradient on to the "
                 f"block's input closes {100 * (1 - skip / plain):.0f}% of the gap.")
    return text


def serve(r: dict, results: dict) -> str | None:
    """Concurrent clients against one, and the inter-token latency they pay, with the
    targets (16 clients at 4x one client's tokens/s or more; p99 between tokens at most 3x):
    against one client alone (the lean step, where the record has it) and against one client
    through the batched decoding pass."""
    rows, batched = findings.serve_rows(r)
    if 1 not in rows or 16 not in rows:
        return None
    x = rows[16]
    speed = "met" if x["vs_one_client"] >= 4 else "missed"
    itl = "met" if x["itl_p99_vs_one"] <= 3 else "missed"
    text = (f"Sixteen concurrent streaming clients get {x['vs_one_client']:.2f}x one client's "
            f"aggregate tokens/s ({x['tokens_per_s']:.0f} against "
            f"{rows[1]['tokens_per_s']:.0f}; target 4x: {speed}), every text the one it gets "
            f"alone ({x['same_tokens']}); their p99 time between tokens is "
            f"{x['itl_p99_vs_one']:.1f}x one client's ({x['itl_p99_ms']:.1f} against "
            f"{rows[1]['itl_p99_ms']:.1f} ms; target 3x: {itl})")
    if batched is not None:
        text += (f". One client alone decodes through the lean step, as generate does; "
                 f"through the batched decoding pass (--no-lean) one client gets "
                 f"{batched['tokens_per_s']:.0f} tokens/s, against which the 16 clients get "
                 f"{x['vs_one_batched']:.2f}x at {x['itl_p99_vs_one_batched']:.1f}x its p99 "
                 f"time between tokens (the batching's own gain)")
    if 64 in rows:
        text += (f"; 64 clients, {rows[64]['vs_one_client']:.2f}x at "
                 f"{rows[64]['itl_p50_ms']:.0f} ms between tokens (p50)")
    return text + "."


def exit_ladder(r: dict, results: dict) -> str | None:
    """Per run: the most evaluations a ladder saves within 0.5% of the own solve's loss
    (target 2x), beside what its coarse solve alone gives, and the decoding speed."""
    import statistics

    rows = r.get("rows", [])
    models = list(dict.fromkeys(x["model"] for x in rows))
    saved, fixed_at = [], []
    for m in models:
        full, fixed, best = findings.ladder_choices(rows, m)
        top = max((x for x in best.values()
                   if x is not None and x["exit"].endswith(" then own")),
                  key=lambda x: x["fewer_evaluations"], default=None)
        if full is None or top is None:
            continue
        saved.append((m, top, full))
        same = next((x for x in fixed if x["exit"] == f"{top['exit'].split(' then')[0]} alone"),
                    None)
        if same is not None:
            fixed_at.append(same)
    if not saved:
        return None
    speed = [x["fewer_evaluations"] for _, x, _ in saved]
    text = ("Exiting across whole solves, within 0.5% of the own solve's loss: "
            + "; ".join(f"{m} ({full['val_loss']}) saves {x['fewer_evaluations']:.2f}x field "
                        f"evaluations through {x['exit']} (confidence, tau {x['tau']}, "
                        f"{x['loss_change']})" for m, x, full in saved)
            + f". Target 2x: {'met' if min(speed) >= 2 else 'missed'} ("
            + (f"at least {min(speed):.2f}x on every run" if min(speed) >= 2
               else f"best {max(speed):.2f}x")
            + (f", median {statistics.median(speed):.2f}x" if len(speed) > 2 else "") + ").")
    if fixed_at:
        text += (" The same coarse solve alone, every token at it: "
                 + "; ".join(f"{x['exit'].replace(' alone', '')} {x['loss_change']} at "
                             f"{x['fewer_evaluations']:.2f}x ({x['model']})" for x in fixed_at)
                 + ".")
        if all(x["within_target"] for x in fixed_at):
            text += (" On these runs that is already within 0.5% of the own solve: the saving "
                     "is the coarse solve's, and the exit's criterion decides little (a fixed "
                     "coarse solve saves as much).")
    dec = [x for x in r.get("decoding", []) if x.get("tau") is not None]
    if dec:
        # each run's fastest setting, against its own solve timed beside it
        fastest = {}
        for x in dec:
            if x["model"] not in fastest or x["decode_speedup"] > \
                    fastest[x["model"]]["decode_speedup"]:
                fastest[x["model"]] = x
        text += (" Decoding (greedy, batch 1, eager), each run's fastest exit against its own "
                 "solve's tokens/s: "
                 + "; ".join(f"{m} {x['decode_speedup']:.2f}x ({x['exit']}, tau {x['tau']}, "
                             f"{x['decode_nfe_per_token']} field evaluations per token)"
                             for m, x in fastest.items()) + ".")
    return text


def kvblock_speculative(results: dict) -> str | None:
    """Self-speculative decoding on ode_any_depth_kvblock.toml's seeds (bench/speculative.py
    records speculative_kvblock, eager, and speculative_kvblock_compiled): the median seed's
    fastest rows, the range over the seeds, the target's verdict and what bounds it."""
    seeds = findings.speculative_models(results, "speculative_kvblock", "any_depth_kvblock")
    if not seeds:
        return None
    r = results["speculative_kvblock"]
    target = r.get("target_speedup", 2.5)
    said, low = [], float("inf")
    for d in ("greedy", "sampled"):
        speedup, lo, hi, best = findings.median_seed(seeds, d)
        low = min(low, speedup)  # the target asks it of both decodings
        said.append(f"{speedup:.2f}x {d} ({lo:.2f}-{hi:.2f}x over the seeds; the median "
                    f"seed's {best['draft']}, k {findings.k_of(best)}, {100 * best['acceptance']:.0f}% "
                    f"kept, {best['tokens_per_verification']} tokens per verification)")
    again = [m["confirmed"] for m in seeds if "eager greedy" in (m.get("confirmed") or {})]
    how = (f", each seed's fastest row timed {len(again[0]['eager greedy']['ratios'])} more "
           f"times against plain decoding beside it (the median ratio: picking the fastest of "
           f"{len(seeds[0]['rows']) // 2} rows timed once inflates it)"
           if len(again) == len(seeds) else "")
    text = (f"On the recipe with that memory as committed (ode_any_depth_kvblock.toml, KL "
            f"weight 0.5), {len(seeds)} seeds, eager: {' and '.join(said)} plain cached "
            f"decoding, the median of the seeds{how} (target {target}x for both: "
            f"{'met' if low >= target else f'missed by {target - low:.2f}x'}).")
    if not any("plain_by" in x for m in seeds for x in m["rows"]):
        text += (" (These rows were timed against plain decoding through the decoding pass, "
                 "before plain decoding and verification ran the model's own solve through the "
                 "lean step.)")
    text += _against_pass(seeds)
    bound = findings.speculative_bound(findings.median_model(seeds, "greedy"), target)
    if bound:
        text += f" Timed pass by pass: {bound}."
    text += _euler1_speculative(results, target)
    text += pipelined(results, "speculative_pipelined", "any_depth_kvblock_time_x1w0.5",
                      "ode_any_depth_euler1.toml", "speculative_euler1", target)
    text += pipelined_native(results, "speculative_pipelined_native", "speculative_pipelined",
                             "any_depth_kvblock_time_x1w0.5", target)
    text += _speed_bought(results, target)
    compiled = findings.speculative_models(results, "speculative_kvblock_compiled",
                                           "any_depth_kvblock")
    parts = []
    for m in compiled:
        (g, gx, plain), (s, sx, _) = (findings.speculative_best(m, d, "compiled")
                                      for d in ("greedy", "sampled"))
        parts.append(f"{m['name']}: {gx:.2f}x greedy ({g['draft']}, k {findings.k_of(g)}, "
                     f"{100 * g['acceptance']:.0f}% kept, the same tokens: {g['same_tokens']}) "
                     f"and {sx:.2f}x sampled ({s['draft']}, k {findings.k_of(s)}, "
                     f"{100 * s['acceptance']:.0f}% kept) against plain compiled decoding "
                     f"({plain:.0f} tokens/s)")
    if parts:
        text += (" Compiled (`" + results["speculative_kvblock_compiled"]["command"] + "`), "
                 "the drafts and each verification through compiled frozen steps: "
                 + "; ".join(parts) + ".")
    return text


def _median_clause(seeds: list[dict], decoding: str, mode: str = "pipelined"
                   ) -> tuple[float, dict, str]:
    """(the median seed's speed-up, its fastest row, "2.00x greedy (1.82-2.46x over the seeds;
    the median seed's DRAFT, k K, N% kept" left open for the caller's details)."""
    speedup, lo, hi, best = findings.median_seed(seeds, decoding, mode)
    return speedup, best, (f"{speedup:.2f}x {decoding} ({lo:.2f}-{hi:.2f}x over the seeds; "
                           f"the median seed's {best['draft']}, k {findings.k_of(best)}, "
                           f"{100 * best['acceptance']:.0f}% kept")


def pipelined(results: dict, record: str, prefix: str, what: str, serial: str,
              target: float) -> str:
    """Self-speculative decoding with the drafts made ahead by a drafting process of their
    own (bench/speculative.py --mode pipelined, Draft(pipeline=True)) on one recipe's seeds
    (``record``'s models named ``prefix``...): the median seed's re-timed fastest rows, the
    range, against plain decoding at the run's thread count and at the other, the verdict,
    and the serial record (``serial``, eager) it is set beside."""
    seeds = findings.speculative_models(results, record, prefix)
    if not seeds:
        return ""
    said, low, other = [], float("inf"), []
    for d in ("greedy", "sampled"):
        speedup, best, clause = _median_clause(seeds, d)
        low = min(low, speedup)
        said.append(clause + f", {best['tokens_per_verification']} tokens per verification"
                    + (f", the same tokens: {best['same_tokens']}" if d == "greedy" else "")
                    + ")")
        again = [(m.get("confirmed") or {}).get(f"pipelined {d}") or {} for m in seeds]
        if all("against_other_threads" in a for a in again):
            other.append((d, statistics.median(a["against_other_threads"] for a in again),
                          again[0]["plain_threads"], again[0]["other_threads"]))
    r = results[record]
    text = (f" With the drafts made ahead by a drafting process of their own on the second "
            f"core while the model verifies on the first (Draft(pipeline=True), "
            f"decoding/pipeline.py; {what}, {len(seeds)} seeds; `{r['command']}`): "
            + " and ".join(said) + f" plain cached decoding, medians of the re-timed fastest "
            f"rows (target {target}x for both: "
            f"{'met' if low >= target else f'missed by {target - low:.2f}x'}).")
    if other:
        _, _, mine, theirs = other[0]
        mine_s = [findings.median_seed(seeds, d, "pipelined")[0] for d, *_ in other]
        faster = all(x >= m for (_, x, _, _), m in zip(other, mine_s))
        text += (f" Plain decoding there runs on {mine} thread{'s' * (mine != 1)} (the "
                 f"verifier's count{', the faster one here' if faster else ''}); against plain "
                 f"decoding on {theirs} thread{'s' * (theirs != 1)}: "
                 + " and ".join(f"{x:.2f}x {d}" for d, x, _, _ in other) + ".")
    base = findings.speculative_models(results, serial, prefix)
    if base:
        same = results[serial]["setup"].split("; ")[-1] == r["setup"].split("; ")[-1]
        text += (" The serial loop on the same seeds (eager, one process; "
                 + ("the same machine" if same else results[serial]["setup"].split("; ")[-1])
                 + "): " + " and ".join(f"{findings.median_seed(base, d)[0]:.2f}x {d}"
                                        for d in ("greedy", "sampled")) + ".")
    return text


def pipelined_native(results: dict, record: str, before: str, prefix: str,
                     target: float) -> str:
    """The pipelined record re-timed with oneDNN off (``record``, bench/speculative.py
    --onednn auto: as `continuumlm generate` runs a float32 model on the CPU) beside the one
    with it on (``before``): medians over the seeds and the verdict; and, for the median
    seed's fastest row, how much faster plain and drafted decoding got (the same seed, draft
    and k in ``before``, where it has that row)."""
    seeds = findings.speculative_models(results, record, prefix)
    if not seeds:
        return ""
    old = {m["name"]: m for m in findings.speculative_models(results, before, prefix)}
    said, low, gains = [], float("inf"), []
    for d in ("greedy", "sampled"):
        speedup, best, clause = _median_clause(seeds, d)
        low = min(low, speedup)
        said.append(clause + ")")
        name = next(m["name"] for m in seeds if best in m["rows"])
        was = next((x for x in (old.get(name) or {}).get("rows", [])
                    if x["mode"] == "pipelined" and x["decoding"] == d
                    and x["draft"] == best["draft"] and x["k"] == best["k"]), None)
        if was:
            plain, drafted = (best["plain_tok_s"] / was["plain_tok_s"],
                              best["tok_s"] / was["tok_s"])
            gains.append(f"{d} ({name}, {best['draft']}, k {findings.k_of(best)}): plain "
                         f"{was['plain_tok_s']:.0f} -> {best['plain_tok_s']:.0f} tokens/s "
                         f"({plain:.2f}x), drafted {was['tok_s']:.0f} -> {best['tok_s']:.0f} "
                         f"({drafted:.2f}x)")
    text = (f" With oneDNN off, as `continuumlm generate` now runs a float32 model on the CPU "
            f"(decoding/kernels.py; `{results[record]['command']}`): " + " and ".join(said)
            + f" plain cached decoding, medians of the re-timed fastest rows (target {target}x "
            f"for both: {'met' if low >= target else f'missed by {target - low:.2f}x'}).")
    if gains:
        text += (" The same row with oneDNN on and off (each timed once against plain "
                 "decoding beside it): " + "; ".join(gains) + ".")
    return text


def _euler1_speculative(results: dict, target: float) -> str:
    """Self-speculative decoding on ode_any_depth_euler1.toml's seeds (record
    speculative_euler1, each fastest row re-timed): medians over the seeds and the verdict."""
    seeds = findings.speculative_models(results, "speculative_euler1",
                                        "any_depth_kvblock_time_x1w0.5")
    if not seeds:
        return ""
    said, low = [], float("inf")
    for d in ("greedy", "sampled"):
        speedup, lo, hi, best = findings.median_seed(seeds, d)
        low = min(low, speedup)
        said.append(f"{speedup:.2f}x {d} ({lo:.2f}-{hi:.2f}x; the median seed's "
                    f"{best['draft']}, k {findings.k_of(best)}, {100 * best['acceptance']:.0f}% kept)")
    retimed = all(all(f"eager {d}" in (m.get("confirmed") or {}) for d in ("greedy", "sampled"))
                  for m in seeds)
    text = (f" On ode_any_depth_euler1.toml's {len(seeds)} seeds (the field told the time, "
            f"Euler x 1 alone drafted; `{results['speculative_euler1']['command']}`): "
            + " and ".join(said) + f", medians of the "
            f"{'re-timed ' if retimed else ''}fastest rows (target {target}x "
            f"for both: {'met' if low >= target else f'missed by {target - low:.2f}x'}).")
    return text + _against_pass(seeds)


def _layer_skip_kl(rows: dict, results: dict, base: dict, one: dict | None) -> str:
    """The first-layer recipe with its exit also taught the stack's own distribution
    (train.layer_skip.exit_kl): its agreement, loss and speculative speed-ups, 3 seeds."""
    kl = rows.get(("transformer_layerskip-exit-at-1-kl", "layers:1"))
    seeds = findings.speculative_models(results, "speculative_layerskip_kl", "layerskip_x1kl1")
    if not (one and kl and seeds):
        return ""
    said = []
    for d in ("greedy", "sampled"):
        speedup, lo, hi, best = findings.median_seed(seeds, d)
        said.append(f"{speedup:.2f}x {d} ({lo:.2f}-{hi:.2f}x over the seeds; the median "
                    f"seed's {best['draft']}, k {findings.k_of(best)}, "
                    f"{100 * best['acceptance']:.0f}% kept)")
    top = min(findings.median_seed(seeds, d)[0] for d in ("greedy", "sampled"))
    return (f" Teaching that layer the whole stack's own next-token distribution as well "
            f"(train.layer_skip.exit_kl = 1: a KL term, the stack's side detached; "
            f"{_seeds(kl['seeds'])}; configs/shakespeare_char/transformer_layerskip_kl.toml) "
            f"takes its agreement to {100 * kl['agreement']:.1f}% (lowest seed "
            f"{100 * kl['agreement_min']:.1f}%; {100 * one['agreement']:.1f}% without the "
            f"term) and its KL from the stack from {one['kl']:.4f} to {kl['kl']:.4f}, at "
            f"{kl['own_loss']:.4f} for the whole stack "
            f"({100 * (kl['own_loss'] / base['own_loss'] - 1):+.1f}% against the baby GPT "
            f"trained without the recipe, {100 * (kl['own_loss'] / one['own_loss'] - 1):+.1f}% "
            f"against the first-layer recipe), and drafting to {' and '.join(said)}, the "
            f"median of {len(seeds)} seeds"
            + (", each seed's fastest row re-timed"
               if all(len(m.get("confirmed") or {}) >= 2 for m in seeds) else "")
            + f" (target 1.5x for both: {'met' if top >= 1.5 else 'missed'})."
            + _against_pass(seeds, "every layer of the stack") + _layer_skip_kl3(rows, results, one))


def _layer_skip_kl3(rows: dict, results: dict, one: dict) -> str:
    """The same at a larger KL weight (exit_kl = 3): what more agreement costs."""
    kl = rows.get(("transformer_layerskip-exit-at-1-kl3", "layers:1"))
    seeds = findings.speculative_models(results, "speculative_layerskip_kl3", "layerskip_x1kl3")
    if not (kl and seeds):
        return ""
    said = []
    for d in ("greedy", "sampled"):
        ups = sorted(findings.confirmed_speedup(m, d) for m in seeds)
        said.append(f"{ups[0]:.2f}-{ups[-1]:.2f}x {d}")
    return (f" A larger KL weight buys little more: at exit_kl = 3 ({_seeds(kl['seeds'])}) the "
            f"first layer agrees at {100 * kl['agreement']:.1f}% with a KL of {kl['kl']:.4f}, "
            f"but the whole stack reads {kl['own_loss']:.4f} "
            f"({100 * (kl['own_loss'] / one['own_loss'] - 1):+.1f}% against the first-layer "
            f"recipe), and drafting runs at {' and '.join(said)} over its seeds.")


def _against_pass(seeds: list[dict], own: str = "the model's own solve") -> str:
    """The baseline a speculative record's re-timed rows were taken against, where they were
    also taken against plain decoding through the decoding pass (findings.against_pass);
    ``own``: what plain decoding runs (a discrete stack: every layer)."""
    both = [findings.against_pass(seeds, d) for d in ("greedy", "sampled")]
    if None in both:
        return ""
    (g, lean_g), (s, lean_s) = both
    return (f" Plain decoding there runs {own} through the lean step too (the "
            f"default, Decoder(lean=True): batch 1, eager, CPU), at {lean_g:.2f}x (greedy) and "
            f"{lean_s:.2f}x (sampled) its rate through the decoding pass, so the verifying "
            f"pass and the plain tokens it is measured against are both lean; against plain "
            f"decoding through the decoding pass, the baseline before it (Decoder(lean=False)), "
            f"the same rows run at {g:.2f}x greedy and {s:.2f}x sampled.")


def _speed_bought(results: dict, target: float) -> str:
    """Speculative decoding on the recipe trained for Euler x 1's agreement at quality's cost
    (record speculative_kvblock_x1w2, one seed): its re-timed speed-ups, its agreement and its
    own solve's loss against ode_rk4 at lr 2e-3 (the agreement record)."""
    r = results.get("speculative_kvblock_x1w2")
    rows = {(x["model"], x["draft"]): x for x in (results.get("agreement") or {}).get("rows", [])}
    agree = rows.get(("ode_any_depth-kvblock-time-x1w2", "euler:1"))
    rk4 = rows.get(("ode_rk4-lr2e-3", "rk4:1"))
    if not (r and r.get("models") and agree and rk4):
        return ""
    m = r["models"][0]
    said = []
    for d in ("greedy", "sampled"):
        best = findings.speculative_best(m, d)[0]
        said.append(f"{findings.confirmed_speedup(m, d):.2f}x {d} ({best['draft']}, k "
                    f"{findings.k_of(best)}, {100 * best['acceptance']:.0f}% kept)")
    low = min(findings.confirmed_speedup(m, d) for d in ("greedy", "sampled"))
    return (f" What agreement would buy, measured (`{r['command']}`): the recipe told the time "
            f"with Euler x 1 alone drafted at KL weight 2 ({_seeds(agree['seeds'])}), whose "
            f"Euler x 1 agrees at {100 * agree['agreement']:.1f}%, runs at "
            + " and ".join(said) + f" ({m['distinct_new_tokens']} distinct tokens in its "
            f"plain greedy output), {'above' if low >= target else 'under'} {target}x, but its "
            f"own solve reads {agree['own_loss']:.4f}, "
            f"{100 * (agree['own_loss'] / rk4['own_loss'] - 1):+.2f}% against ode_rk4 at lr "
            f"2e-3" + (": the quality target (+0.5%) rules it out."
                       if agree["own_loss"] > 1.005 * rk4["own_loss"] else "."))


def ladder_against_chance(r: dict, rung: str = "euler:1") -> str | None:
    """Whether a ladder's confidence criterion picks the right tokens: for ``rung`` then the
    own solve, per run and threshold, the share of tokens sent on to the own solve (from the
    evaluations per token) against the share of the loss gap between the rung alone and the
    own solve that it closes. Sending tokens on at random closes the gap in proportion."""
    rows = r.get("rows", [])
    pairs = []
    for m in dict.fromkeys(x["model"] for x in rows):
        full, fixed, _ = findings.ladder_choices(rows, m)
        alone = next((x for x in fixed if x["exit"] == f"{rung} alone"), None)
        if full is None or alone is None or alone["val_loss"] <= full["val_loss"]:
            continue
        first, own = alone["nfe_per_token"], full["nfe_per_token"]
        for x in rows:
            if x.get("model") == m and x["exit"] == f"{rung} then own":
                sent = (x["nfe_per_token"] - first) / own
                closed = (alone["val_loss"] - x["val_loss"]) / (alone["val_loss"]
                                                               - full["val_loss"])
                pairs.append((x["tau"], sent, closed))
    if not pairs:
        return None
    import statistics

    taus = sorted({t for t, _, _ in pairs}, reverse=True)
    per = [(t, statistics.mean(s for u, s, _ in pairs if u == t),
            statistics.mean(c for u, _, c in pairs if u == t)) for t in taus]
    best = max(per, key=lambda x: x[2] - x[1])
    return (f"Does the confidence criterion pick the tokens that need the own solve? Sending "
            f"tokens on from {rung.replace(':', ' x ')} at random would close the loss gap "
            f"between it alone and the own solve in proportion to the share sent; per "
            f"threshold (the mean over the runs), the share sent on and the share of the gap "
            f"closed: " + ", ".join(f"tau {t}: {100 * s:.0f}% / {100 * c:.0f}%"
                                     for t, s, c in per)
            + f". The largest margin over chance is {100 * (best[2] - best[1]):+.0f} points "
              f"(tau {best[0]})"
            + (", so it does little better than chance here, and what a ladder saves within "
               "0.5% is the coarse solve's, where that solve is good enough alone."
               if best[2] - best[1] < 0.15 else "."))



def draft_cost(r: dict) -> str | None:
    """What the lean draft step buys (bench/draft_cost.py): per decoding, the median over the
    runs of speculative decoding with the drafts by the decoding pass and by the lean step,
    the two draft costs, and what drafts that cost nothing would give."""
    models = r.get("models") or []
    if not models:
        return None
    k, target = r["k"], r.get("target_speedup", 2.5)

    def med(key: str) -> float:
        return statistics.median(m["speedup"][key] for m in models)

    def span(key: str) -> str:
        return (f"{min(m['speedup'][key] for m in models):.2f}-"
                f"{max(m['speedup'][key] for m in models):.2f}x")

    said = [f"{d}, {med(d + '_lean'):.2f}x ({span(d + '_lean')}) with the drafts by the lean "
            f"step against {med(d + '_pass'):.2f}x ({span(d + '_pass')}) by the decoding pass"
            for d in ("greedy", "sampled")]
    shares = [1 - m["lean_draft_ms"] / m["pass_draft_ms"] for m in models]
    top = max(med("greedy_lean"), med("sampled_lean"))
    low = min(med("greedy_lean"), med("sampled_lean"))
    verdict = ("both reach" if low >= target else
               f"{'one reaches, the other misses' if top >= target else 'both miss'} the "
               f"{target}x target (the lower by {target - low:.2f}x)")
    return (f"A drafted token's pass is mostly outside the field. The lean draft step "
            f"(decoding/lean_draft.py: the coarse solve written out op by op, caches of its "
            f"own, the same logits as the decoding pass) costs {min(shares):.0%}-"
            f"{max(shares):.0%} less per drafted token, and Euler x 1 drafts, k {k}, medians "
            f"of {len(models)} seeds against plain cached decoding timed beside them"
            + (" (plain decoding and each verification run the model's own solve through the "
               "lean step too)" if all(m.get("plain_by") == "lean step" for m in models)
               else "") + ", give "
            + "; ".join(said) + f": at this one setting {verdict}. Drafts that cost nothing "
            f"would give "
            + ", ".join(f"{m['bound_free']}x" for m in models)
            + " greedy (a round's verification alone against the plain tokens it makes).")
