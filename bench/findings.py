"""The README's "What we found": one sentence per finding, each with its number (read from
bench/results/ here, so it cannot drift from the page), the anchor it is set against and a link
to its section of docs/results.md. bench/render.py writes it between the README's markers;
tests/test_bench_common.py checks the README holds exactly what it writes.

Only numbers come from the records; the wording is here, one function per finding, and a
finding whose records are missing is left out (said in the block)."""

from __future__ import annotations

import json
import math
import statistics

from common import RESULTS
from page import anchor

START = "<!-- findings: written by python bench/render.py from bench/results/; do not edit -->"
END = "<!-- /findings -->"
PAGE = "docs/results.md"
ZAREMBA_SMALL_TEST_PPL = 114.5  # Zaremba et al. 2014, small LSTM (2 x 200, no dropout), test


def _seeds(results: dict, stem: str) -> list[dict]:
    """The headline runs of ``stem`` (no overrides, no tag), one per seed."""
    return [r for k, r in sorted(results.items())
            if k.startswith(f"{stem}_seed") and not r.get("overrides") and not r.get("tag")]


def _mean_sd(xs: list[float], digits: int = 1) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def ptb(results: dict) -> str | None:
    ode, disc = _seeds(results, "ptb_std-ode_euler"), _seeds(results, "ptb_std-transformer")
    if not ode or not disc or not all("test_loss_full_split" in r for r in ode + disc):
        return None
    o = [math.exp(r["test_loss_full_split"]) for r in ode]
    d = [math.exp(r["test_loss_full_split"]) for r in disc]
    gap = 100 * (statistics.mean(o) / statistics.mean(d) - 1)
    return (f"**One shared-weight ODE block is within {gap:.1f}% of a 3-layer Transformer on "
            f"Penn Treebank's standard setup**: test perplexity {_mean_sd(o)} against "
            f"{_mean_sd(d)} ({len(o)} seeds each, 4.6 M parameters, 12 M tokens), both far "
            f"below Zaremba et al.'s small LSTM at the same budget "
            f"({ZAREMBA_SMALL_TEST_PPL}). [PTB]({PAGE}#penn-treebank-standard-setup)")


def cat(results: dict) -> str | None:
    rel = results.get("cat_protocol-cat_bias_relative_seed1337")
    rope = results.get("cat_protocol-softmax_rope_seed1337")
    cat_ = results.get("cat_protocol-cat_fourier_seed1337")
    if not (rel and rope and cat_):
        return None

    def ce(r, n):
        return next(c["loss"] for c in r["contexts"] if c["context"] == n)

    return (f"**A learned relative kernel as attention's positional prior extrapolates where "
            f"RoPE does not** on CAT's protocol (train at 256 characters): cross-entropy "
            f"{ce(rel, 128):.3f} vs RoPE's {ce(rope, 128):.3f} at 128 and {ce(rel, 5000):.3f} "
            f"vs {ce(rope, 5000):.3f} at 5,000; CAT's own continuous attention, made causal, "
            f"trails both ({ce(cat_, 128):.3f} at 128). "
            f"[CAT]({PAGE}#cats-context-length-protocol)")


def parallel(results: dict) -> str | None:
    par = _seeds(results, "shakespeare_char-ode_parallel")
    seq = _seeds(results, "shakespeare_char-ode_rk4")
    base = _seeds(results, "shakespeare_char-transformer_baby")
    if not (par and seq and base):
        return None

    def m(rs):
        return statistics.mean(r["val_loss_full_split"] for r in rs)

    return (f"**The parallel attention + MLP field of 2212.06011 is worse than the sequential "
            f"one for language modelling**: val loss {m(par):.3f} against {m(seq):.3f} on Tiny "
            f"Shakespeare at nanoGPT's CPU budget (means over the seeds run), where the discrete "
            f"baseline reaches {m(base):.3f}. [Tiny Shakespeare]({PAGE}#tiny-shakespeare-characters-nanogpts-cpu-budget)")


ELASTIC_RECIPE = "ode_elastic_dial_capped-cw1.0-kd1.0t5e-3-lr2e-3"  # depth_elasticity's name
ELASTIC_SWEEP = "elastic (cw1.0 + teacher at 5e-3)"  # the same recipe in lr_sweep


def _best_rate(results: dict, model: str, solve: str) -> float | None:
    """The seeds' mean val loss of ``model`` solved ``solve`` at its best learning rate in
    bench/lr_sweep.py's record (rates run on fewer than three seeds left out)."""
    by: dict[str, list[float]] = {}
    for r in (results.get("lr_sweep") or {}).get("rows", []):
        if r["model"] == model and r["solve"] == solve:
            by.setdefault(r["lr"], []).append(r["val_loss"])
    means = [statistics.mean(v) for v in by.values() if len(v) >= 3]
    return min(means) if means else None


def elastic(results: dict) -> str | None:
    rows = [r for r in (results.get("depth_elasticity") or {}).get("rows", [])
            if r["model"] == ELASTIC_RECIPE]
    best = {k: _best_rate(results, *k) for k in ((ELASTIC_SWEEP, "euler"), (ELASTIC_SWEEP, "rk4"),
                                                  ("ode_euler", "euler"), ("ode_rk4", "rk4"))}
    if not rows or None in best.values():
        return None
    rise = 0.0  # the largest rise between neighbouring solves of one seed and solver
    for seed in {r.get("seed", 1337) for r in rows}:
        for solver in ("euler", "rk4"):
            curve = [r["val_loss"] for r in sorted(rows, key=lambda r: r["nfe"])
                     if r["solver"] == solver and r.get("seed", 1337) == seed]
            rise = max([rise] + [b - a for a, b in zip(curve, curve[1:])])
    seeds = len({r.get("seed", 1337) for r in rows})
    nfe = sorted({r["nfe"] for r in rows})
    d4 = best[(ELASTIC_SWEEP, "euler")] - best[("ode_euler", "euler")]
    d16 = best[(ELASTIC_SWEEP, "rk4")] - best[("ode_rk4", "rk4")]

    def said(d):
        return f"{'better' if d < 0 else 'worse'} by {abs(d):.3f}"

    return (f"**One elastic ODE model serves every depth**: trained across solvers and step "
            f"counts and distilled from the NFE-4 model, on each of its "
            f"seeds the loss never rises by more than {rise:.3f} as the solve grows from {nfe[0]} to {nfe[-1]} field evaluations; against "
            f"fixed-depth models each at its best learning rate it is {said(d16)} at NFE 16 and "
            f"{said(d4)} at NFE 4 (Tiny Shakespeare, {seeds} seeds; the teacher is a second "
            f"training run). [Anytime depth]({PAGE}#anytime-depth)")


def mqar(results: dict) -> str | None:
    rows = {k: results.get(f"mqar-{k}") for k in ("deltanet_kv64", "softmax_kv64_mixed",
                                                  "ode_deltanet_kv64")}
    if not all(rows.values()):
        return None
    acc = {k: 100 * r["accuracy"] for k, r in rows.items()}
    cal = mqar_gpu_calibration()
    need = (f"that sweep, every rate of every row below the bar side by side on one "
            f"{cal['device']}, needs about {sweep_minutes(cal):.0f} minutes at the step times "
            f"measured there" if cal else "that sweep needs a GPU")
    return (f"**Associative recall at 64 key-value pairs (Zoology's MQAR)**: DeltaNet "
            f"{acc['deltanet_kv64']:.1f}% and softmax {acc['softmax_kv64_mixed']:.1f}% (trained "
            f"on mixed pair counts) pass the 99% bar; the ODE DeltaNet block stops at "
            f"{acc['ode_deltanet_kv64']:.1f}% after 20,000 steps at one learning rate (Zoology "
            f"reports the best of four; {need}). "
            f"[MQAR]({PAGE}#multi-query-associative-recall-mqar)")


MQAR_CALIBRATION = "gpu/mqar_calibration.json"  # under bench/results/


def mqar_gpu_calibration() -> dict | None:
    """bench/gpu_mqar_sweep.sh's calibration on a GPU (its logs/calibration.json, copied to
    bench/results/gpu/mqar_calibration.json); None without one or for a CPU dry run's."""
    path = RESULTS / MQAR_CALIBRATION
    cal = json.loads(path.read_text()) if path.is_file() else None
    return cal if cal and cal.get("device", "cpu") != "cpu" else None


def sweep_minutes(cal: dict) -> float:
    """Wall minutes for the sweep's runs, all side by side, to finish each config's whole
    schedule: the slowest row's measured seconds per step times its config's step limit."""
    return max(r["seconds_per_step"] * r["config_max_steps"] for r in cal["rows"].values()) / 60


def regularizers(results: dict, regularizer_runs: list[dict]) -> str | None:
    """``regularizer_runs``: render.py's reading of the table (the unregularized run first;
    each later one with ``fewer``, ``dloss`` and ``met``: >= 40% fewer NFE at <= 1% loss)."""
    runs = regularizer_runs[1:]
    within = [r for r in runs if r["dloss"] <= 0.01]
    if not within:
        return None
    best = max(within, key=lambda r: r["fewer"])
    verdict = ("meeting" if best["met"] else "short of")
    return (f"**RNODE's kinetic and Jacobian regularizers cut an adaptive solver's field "
            f"evaluations by {100 * best['fewer']:.0f}% at {100 * best['dloss']:+.2f}% loss** "
            f"(Tsit5 on Tiny Shakespeare), {verdict} the target of 40% fewer within 1%. "
            f"[Regularizers]({PAGE}#nfe-regularizers-on-an-adaptive-solver)")


def decoding(results: dict) -> str | None:
    d = results.get("decode_speed")
    if not d:
        return None
    speed = {r["mixer"]: r["cache_speedup"] for r in d["rows"]}
    parts = ", ".join(f"{m} {s:.1f}x" for m, s in sorted(speed.items()))
    parts += " faster than recomputing at 512 new tokens"
    at_2048 = {r["mixer"]: r["cache_speedup_2048"] for r in d["rows"]
               if "cache_speedup_2048" in r}
    how = "greedy, 2 CPU cores"
    if at_2048 and len(at_2048) == len(speed):
        parts += (", " + ", ".join(f"{m} {s:.0f}x" for m, s in sorted(at_2048.items()))
                  + " at 2048")
        how += "; recomputing 2048 tokens estimated from 9 timed lengths"
    compiled = ""
    rows = sorted(d["rows"], key=lambda r: r["mixer"])
    if all("compiled_vs_eager" in r and r.get("pays_from_warm") is not None for r in rows):
        compiled = (" Compiled (one graph per solver step), decoding runs at "
                    + ", ".join(f"{r['mixer']} {r['compiled_vs_eager']:.1f}x" for r in rows)
                    + " the eager tokens/s, and compiling pays from "
                    + ", ".join(f"{r['mixer']} {r['pays_from_warm']}" for r in rows)
                    + " new tokens with a warm compiler cache.")
    if compiled and not any("eager_by" in r for r in rows):
        compiled = compiled[:-1] + (" (eager through the decoding pass: measured before plain "
                                    "decoding ran the solve op by op).")
    lean = ""
    e1 = speculative_models(results, "speculative_euler1", "any_depth_kvblock_time_x1w0.5")
    ratio = against_pass(e1, "greedy") if e1 else None
    if ratio is not None:
        lean = (f" At batch 1 on a CPU, eager decoding now runs the model's own solve op by op "
                f"(the lean step, the same logits to 1e-10 in float64), at {ratio[1]:.2f}x the "
                f"decoding pass's tokens/s on the Shakespeare any-depth model (bench/"
                f"speculative.py's re-timed rows).")
        x1 = speculative_models(results, "speculative_layerskip_x1", "layerskip_x1")
        stack = against_pass(x1, "greedy") if x1 else None
        if stack is not None:
            lean = lean[:-1] + (f"; a discrete stack's layers run the same way, at "
                                f"{stack[1]:.2f}x on the LayerSkip-trained baby GPT.")
    return (f"**Cached decoding through ODE depth is exact** (every fixed-grid solver and mixer; "
            f"one cache per solver stage evaluation, equal to recomputing to 1e-4 in the logits, "
            f"tested), which the Julia seed ruled out; on a 4-block RK4 x 4 model it is "
            f"{parts} ({how}).{compiled}{lean} "
            f"[Decoding]({PAGE}#decoding-cached-vs-recompute)")


def gpu(results: dict) -> str | None:
    """From the first device's bench/results/gpu/<device>/gpu_bench.json (bench/gpu_check.sh
    on a GPU machine)."""
    import gpu_page

    r = gpu_page.load()
    rows = {x["row"]: x for x in (r or {}).get("gpt2", {}).get("rows", [])}
    ratio = (r or {}).get("gpt2", {}).get("ode_evaluation_vs_layer")
    if ratio is None or not all(rows.get(k, {}).get("mfu") for k in ("discrete", "ode_euler")):
        return None
    dec = gpu_page.eager_decoding(r)
    decoding = (f"; cached decoding of the small RK4 x 4 model, 64 field evaluations of small "
                f"matrices per token, is launch-bound there ({dec[0]:.0f} tokens/s, "
                f"{dec[1]:.2f}x recomputing)" if dec else "")
    long = gpu_page.long_kernels(r)
    clock = "" if gpu_page.kernels_timed_by_gpu(long) else " by the host's clock (not yet GPU time)"
    kernels = (f"; over SDPA's time, DeltaNet's fastest chunkwise kernel (forward and backward, "
               f"bf16) takes {gpu_page.kernel_ratios(long)}{clock}" if long else "")
    return (f"**On one {r['device']} a field evaluation costs what a layer does**: at GPT-2-small's "
            f"shape (bf16, compiled) one evaluation of the shared ODE block takes {ratio:.2f}x a "
            f"discrete layer, and the models train at {100 * rows['ode_euler']['mfu']:.1f}% "
            f"(ODE, Euler x 12) and {100 * rows['discrete']['mfu']:.1f}% (12 layers) MFU"
            f"{kernels}{decoding}. [GPU]({PAGE}#{anchor(gpu_page.heading(r))})")


def threads(results: dict) -> str | None:
    r = results.get("threads")
    rows = {x["work"]: x for x in (r or {}).get("rows", [])
            if x["work"] == "demo_train" and x["load"] == "loaded"} if r else {}
    by = {(x["work"], x["load"], x["policy"]): x["tokens_per_s"] for x in (r or {}).get("rows", [])}
    if not rows or not all(("demo_train", "loaded", p) in by for p in ("default", "auto")):
        return None
    quiet = by.get(("demo_train", "quiet", "auto"))
    return (f"**On a machine shared with other jobs, torch's thread per core is the bottleneck**: "
            f"beside two busy processes on 2 cores, the demo trained at "
            f"{by[('demo_train', 'loaded', 'default')]:,.0f} tokens/s with torch's default "
            f"and {by[('demo_train', 'loaded', 'auto')]:,.0f} with ContinuumLM's thread policy "
            f"(`--threads auto`, the default; {quiet:,.0f} on the quiet machine), which takes "
            f"the cores other processes leave idle. [Threads]"
            f"({PAGE}#threads-on-a-quiet-and-a-shared-machine)")


def speculative_best(m: dict, decoding: str, mode: str = "eager"
                     ) -> tuple[dict, float, float]:
    """(the fastest row of ``decoding`` and ``mode`` (eager or compiled; records without the
    field are eager) for model record ``m``, its speed-up over plain cached decoding's
    median rate across the model's rows of that mode and decoding, that median). Plain
    decoding is timed beside every row, and its rate moves by +-15% between rows on a shared
    2-core machine, so the median is the steadier reference; plain sampling is slower than
    plain greedy decoding (the softmax, top-k and draw per token), so each is its own
    reference."""
    import statistics

    rows = [x for x in m["rows"] if x.get("mode", "eager") == mode
            and x["decoding"] == decoding]
    plain = statistics.median(x["plain_tok_s"] for x in rows)
    best = max(rows, key=lambda x: x["tok_s"])
    return best, best["tok_s"] / plain, plain


def exit_choices(rows: list[dict], model) -> tuple[dict | None, dict, dict | None]:
    """For one run of a bench/gate_exit.py record (``model``: its rows' name; None in records
    of one run without it): its full-depth row, each criterion's most saving row within 0.5%
    of full depth's loss (None where none is), and the gate's most saving row."""
    mine = [x for x in rows if x.get("model") == model]
    full = next((x for x in mine if x["criterion"] == "full"), None)
    best: dict = {}
    for c in ("gate", "state"):
        ok = [x for x in mine if x["criterion"] == c and full is not None
              and x["val_loss"] <= full["val_loss"] * 1.005]
        best[c] = max(ok, key=lambda x: x["fewer_evaluations"]) if ok else None
    most = max((x for x in mine if x["criterion"] == "gate"),
               key=lambda x: x["fewer_evaluations"], default=None)
    return full, best, most


def ladder_choices(rows: list[dict], model: str, within: float = 0.005
                   ) -> tuple[dict | None, list[dict], dict[str, dict | None]]:
    """For one run of a bench/exit_ladder.py record: its own-solve row, each coarse solve
    alone, and per exit (a ladder, or the solver steps) its most saving row within ``within``
    of the own solve's loss (None where none is)."""
    mine = [x for x in rows if x.get("model") == model]
    full = next((x for x in mine if x["criterion"] == "full"), None)
    fixed = [x for x in mine if x["criterion"] == "fixed"]
    best: dict[str, dict | None] = {}
    for x in mine:
        if x["criterion"] in ("full", "fixed"):
            continue
        # the solver steps' criteria apart ("solver steps, state"); a ladder's criterion is one
        exit_ = x["exit"] if x["exit"].endswith(" then own") else f"{x['exit']}, {x['criterion']}"
        ok = full is not None and x["val_loss"] <= full["val_loss"] * (1 + within)
        now = best.get(exit_)
        if ok and (now is None or x["fewer_evaluations"] > now["fewer_evaluations"]):
            best[exit_] = x
        else:
            best.setdefault(exit_, None)
    return full, fixed, best


def kept_for(tokens: float, k: int) -> float | None:
    """The probability p of keeping each draft, position by position independently, at which
    a round of k drafts yields ``tokens`` tokens on average (1 + p + ... + p^k); None when
    more than k + 1 are asked."""
    if tokens > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(k + 1)) < tokens:
            lo = mid
        else:
            hi = mid
    return hi


def speculative_bound(m: dict, target: float) -> str | None:
    """What ``target`` asks of the drafts, from the record's measured pass costs
    (bench/speculative.py pass_costs): for the fastest greedy row of a fixed k, a round's k
    draft passes and one verification against plain decoding's pass per token, the tokens
    per verification the target needs and the chance of keeping each draft that gives them."""
    costs = m.get("pass_costs")
    if not costs:
        return None
    rows = [x for x in m["rows"] if x.get("mode", "eager") == "eager"
            and x["decoding"] == "greedy" and x["k"] != "auto" and not x.get("confidence")
            and x["draft"] in costs["draft_ms"] and str(x["k"]) in costs["verify_ms"]]
    if not rows:
        return None
    best = max(rows, key=lambda x: x["tok_s"])
    k, plain = best["k"], costs["plain_ms"]
    draft, verify = costs["draft_ms"][best["draft"]], costs["verify_ms"][str(best["k"])]
    rnd = k * draft + verify
    need = target * rnd / plain
    p = kept_for(need, k)
    asks = (f"each draft kept with probability {100 * p:.0f}% position by position"
            if p is not None else f"more than the k + 1 = {k + 1} a round can give")
    lean = " (the own solve by the lean step, as decoding runs it)" if costs.get(
        "own_by") == "lean step" else ""
    return (f"{m['name']}, greedy ({best['draft']}, k {k}): a round costs {k} draft passes of "
            f"{draft:.2f} ms and one verification of {k + 1} tokens, {verify:.2f} ms, "
            f"against {plain:.2f} ms per plain token{lean}, so {target}x needs {need:.1f} tokens "
            f"per verification ({asks}); it makes {best['tokens_per_verification']}")


def k_of(row: dict) -> str:
    """A bench/speculative.py row's drafts per round as the page says it: k, and the draft
    confidence a round stops below where the row has one (Draft.confidence)."""
    c = row.get("confidence")
    return f"{row['k']}" + (f" stopping below {c}" if c else "")


def speculative_models(results: dict, record: str, prefix: str) -> list[dict]:
    """The models of a bench/speculative.py record whose names start with ``prefix`` (one per
    seed of a run family)."""
    return [m for m in (results.get(record) or {}).get("models", [])
            if m["name"].startswith(prefix)]


def confirmed_speedup(m: dict, decoding: str, mode: str = "eager") -> float:
    """A model record's speed-up for ``decoding``: its fastest row re-timed, the median
    (bench/speculative.py --confirm) where the record has it, else speculative_best's."""
    again = (m.get("confirmed") or {}).get(f"{mode} {decoding}")
    return again["speedup"] if again else speculative_best(m, decoding, mode)[1]


def median_seed(models: list[dict], decoding: str, mode: str = "eager"
                ) -> tuple[float, float, float, dict]:
    """(the median over ``models`` (one record per seed) of each one's best speed-up for
    ``decoding`` (confirmed_speedup), the lowest, the highest, the median seed's best row)."""
    best = sorted((confirmed_speedup(m, decoding, mode), i) for i, m in enumerate(models))
    speedup, i = best[(len(best) - 1) // 2]
    return speedup, best[0][0], best[-1][0], speculative_best(models[i], decoding, mode)[0]


def against_pass(models: list[dict], decoding: str) -> tuple[float, float] | None:
    """Where every record (one per seed) re-timed its fastest ``decoding`` row against plain
    decoding through the decoding pass too (bench/speculative.py confirmed, Decoder(lean=
    False)): (the median over the seeds of that speed-up, the median of plain decoding's own
    rate through the lean step over its rate through the decoding pass); else None."""
    again = [(m.get("confirmed") or {}).get(f"eager {decoding}") for m in models]
    if not again or any(a is None or "against_pass" not in a or a.get("plain_by") != "lean step"
                        for a in again):
        return None  # not re-timed so, or plain decoding did not run through the lean step
    if any(x.get("verified_by") != "lean step" for m in models for x in m["rows"]
           if x["decoding"] == decoding):
        return None
    lean_over_pass = [statistics.median(p / r for p, r in zip(a["against_pass_ratios"],
                                                             a["ratios"])) for a in again]
    return (statistics.median(a["against_pass"] for a in again),
            statistics.median(lean_over_pass))


def median_model(models: list[dict], decoding: str) -> dict:
    """The model record (one per seed) whose best ``decoding`` speed-up is median_seed's."""
    best = median_seed(models, decoding)[3]
    return next(m for m in models if speculative_best(m, decoding)[0] is best)


def speculative_modes(m: dict) -> list[str]:
    """The modes (eager, compiled, pipelined) a speculative model record has rows of, eager
    first."""
    return [mode for mode in ("eager", "compiled", "pipelined")
            if any(x.get("mode", "eager") == mode for x in m["rows"])]


def speculative(results: dict) -> str | None:
    r = results.get("speculative")
    trained = [m for m in (r or {}).get("models", []) if m["name"] != "untrained"]
    if not trained:
        return None
    m = trained[0]
    (g, gx, plain), (s, sx, _) = (speculative_best(m, d)
                                  for d in ("greedy", "sampled"))
    target = r.get("target_speedup", 2.5)
    verdict = "met" if max(gx, sx) >= target else "missed"
    others = "".join(f"; a model trained for RK4 x 4 alone ({o['name']}) keeps "
                     f"{100 * speculative_best(o, 'greedy')[0]['acceptance']:.0f}% "
                     f"of its drafts and gains nothing"
                     for o in trained[1:] if max(speculative_best(o, d)[1]
                                                 for d in ("greedy", "sampled")) < 1)
    compiled = ""
    cm = next((c for c in (results.get("speculative_compiled") or {}).get("models", [])
               if c["name"] == m["name"]), None)
    if cm is not None:
        (cg, cgx, cplain), (cs, csx, _) = (speculative_best(cm, d, "compiled")
                                           for d in ("greedy", "sampled"))
        compiled = (f"; compiled, against plain compiled decoding ({cplain:.0f} tokens/s), "
                    f"{cgx:.2f}x greedy and {csx:.2f}x sampled")
    return (f"**Self-speculative decoding through depth**: the same weights integrated by a "
            f"coarser solve draft tokens and the model's own solve verifies them in one pass; "
            f"on the distilled elastic model ({g['plain_nfe_per_token']} field evaluations per "
            f"token) it decodes at {gx:.2f}x plain cached decoding greedy (the same tokens; "
            f"{g['draft']} drafts, {100 * g['acceptance']:.0f}% kept) and {sx:.2f}x sampled "
            f"(distributed as the model's own sampling; {s['draft']} drafts, "
            f"{100 * s['acceptance']:.0f}% kept){compiled}{others} (2 CPU cores; target "
            f"{target}x eager: "
            f"{verdict}). [Speculative]({PAGE}#self-speculative-decoding-through-depth)")


def ode_kv(results: dict) -> str | None:
    r = results.get("ode_kv")
    blocks = [v for v in (r or {}).get("verdicts", []) if v["ode_kv"] == "block"]
    if not blocks:
        return None
    parts = ", ".join(f"{v['group']} {100 * v['loss_change']:+.1f}%" for v in blocks)
    ratio = max(v["memory_ratio"] for v in blocks)
    return (f"**Decoding memory need not grow with the solve**: with the mixers' memory taken "
            f"from each ODE block's input (`model.ode_kv = \"block\"`, trained that way, exact "
            f"in decoding) an RK4 x 4 model keeps {ratio:.3g} of the cache of one per field "
            f"evaluation, a discrete layer's, for a loss change of {parts} (2 CPU cores; "
            f"target within 1%). [Decoding memory]"
            f"({PAGE}#decoding-memory-that-does-not-grow-with-the-solve)")


FINDINGS = [ptb, cat, elastic, parallel, mqar, regularizers, decoding, speculative, ode_kv,
            threads, gpu]


def block(results: dict, regularizer_runs: list[dict]) -> list[str]:
    """The README block between its markers (the markers included)."""
    lines = [START, "## What we found", ""]
    missing = []
    for f in FINDINGS:
        text = f(results, regularizer_runs) if f is regularizers else f(results)
        if text is None:
            missing.append(f.__name__)
        else:
            lines.append(f"- {text}")
    lines += ["", "![Tiny Shakespeare: validation loss against training time per token, every "
              "model family, with the Pareto front]"
              "(docs/img/findings_pareto.png)", ""]
    if missing:
        lines += [f"(Not yet measured: {', '.join(missing)}.)", ""]
    lines.append(END)
    return lines


def replace_block(readme: str, lines: list[str]) -> str:
    """``readme`` with its findings block replaced by ``lines``; a README without the markers
    is an error (the block's place is chosen by hand, once)."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no findings markers ({START} ... {END}); put them "
                         f"where the section belongs and run python bench/render.py again.")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + "\n".join(lines) + tail


def never_worse(drafts: list[dict]) -> bool:
    """Whether no solve of more field evaluations reads a higher loss than one of fewer (at
    the record's precision): agreement rows of one model."""
    return not any(b["loss"] > a["loss"] for a in drafts for b in drafts if b["nfe"] > a["nfe"])


def any_depth(results: dict) -> str | None:
    r = results.get("agreement")
    rows = {(x["model"], x["draft"]): x for x in (r or {}).get("rows", [])}
    if ("ode_any_depth", "euler:1") not in rows or ("ode_rk4", "euler:1") not in rows:
        return None
    a1, b1 = rows[("ode_rk4", "euler:1")], rows[("ode_any_depth", "euler:1")]
    a4, b4 = rows.get(("ode_rk4", "rk4:1")), rows.get(("ode_any_depth", "rk4:1"))
    spec = ""
    s = results.get("speculative_any_depth")
    m = next((m for m in (s or {}).get("models", []) if "any_depth" in m["name"]), None)
    # the committed kv-block recipe's seeds, where recorded: the figure the page leads with
    kv_seeds = speculative_models(results, "speculative_kvblock", "any_depth_kvblock")
    if kv_seeds:
        target = results["speculative_kvblock"].get("target_speedup", 2.5)
        gx, glo, ghi, _ = median_seed(kv_seeds, "greedy")
        sx, slo, shi, _ = median_seed(kv_seeds, "sampled")
        spec = (f"; self-speculative decoding on ode_any_depth_kvblock.toml's model runs at "
                f"{gx:.2f}x plain cached decoding greedy ({glo:.2f}-{ghi:.2f}x) and {sx:.2f}x "
                f"sampled ({slo:.2f}-{shi:.2f}x), the median of {len(kv_seeds)} seeds (target "
                f"{target}x: {'met' if min(gx, sx) >= target else 'missed'})")
    elif m is not None:
        import statistics

        (g, gx, _), (sm, sx, _) = (speculative_best(m, d) for d in ("greedy", "sampled"))
        target = s.get("target_speedup", 2.5)
        beside = statistics.median(x["speedup"] for x in m["rows"]
                                   if x["decoding"] == "greedy")
        spec = (f"; self-speculative decoding on ode_any_depth.toml's model runs at {gx:.2f}x plain cached decoding "
                f"greedy ({g['draft']} drafts, {100 * g['acceptance']:.0f}% kept; the fastest "
                f"row against plain decoding's median rate, {beside:.2f}x the median greedy "
                f"row against the plain decoding timed beside it) and {sx:.2f}x "
                f"sampled ({sm['draft']}, {100 * sm['acceptance']:.0f}% kept; target {target}x: "
                f"{'met' if max(gx, sx) >= target else 'missed'})")
    rk4 = (f", RK4 x 1 from {100 * a4['agreement']:.0f}% to {100 * b4['agreement']:.0f}%"
           if a4 and b4 else "")
    tuned, best = (rows.get(("ode_any_depth-w0.85-draws2-lr2e-3", d))
                   for d in ("euler:1", "rk4:1"))
    ref = rows.get(("ode_rk4-lr2e-3", "euler:1"))
    if tuned and best and ref:
        tuned_text = (f"; at ode_rk4's best lr (2e-3) with a KL weight of 0.85 and two "
                      f"drafts a step (ode_any_depth_tuned.toml), "
                      f"{100 * tuned['agreement']:.0f}% and "
                      f"{100 * best['agreement']:.0f}% at "
                      f"{100 * (tuned['own_loss'] / ref['own_loss'] - 1):+.2f}% loss against "
                      f"ode_rk4 at that lr ({tuned['seeds']} seeds each)")
    else:
        tuned_text = ""
    ladder = ""
    lr = results.get("exit_ladder")
    if lr:
        tops = []
        for name in dict.fromkeys(x["model"] for x in lr["rows"]):
            full, _, best = ladder_choices(lr["rows"], name)
            top = max((x for x in best.values()
                       if x is not None and x["exit"].endswith(" then own")),
                      key=lambda x: x["fewer_evaluations"], default=None)
            if full is not None and top is not None:
                tops.append(top)
        if tops:
            # the median seed's row (the lower middle of an even count)
            mid = sorted(tops, key=lambda x: x["fewer_evaluations"])[(len(tops) - 1) // 2]
            kv = rows.get(("ode_any_depth-kvblock-w0.5", "rk4:1"))
            kv1 = rows.get(("ode_any_depth-kvblock-w0.5", "euler:1"))
            agree = (f" at KL weight 0.5 (ode_any_depth_kvblock.toml) its coarse solves agree "
                     f"at {100 * kv1['agreement']:.0f}% (Euler x 1) and "
                     f"{100 * kv['agreement']:.0f}% (RK4 x 1) at "
                     f"{100 * (kv['own_loss'] / ref['own_loss'] - 1):+.2f}% loss, and"
                     if kv and kv1 and ref else "")
            ladder = (f"; with the memory from the block's input,{agree} exiting across whole "
                      f"solves "
                      f"({mid['exit']}, confident tokens stop at the coarse solve) saves "
                      f"{mid['fewer_evaluations']:.2f}x field evaluations at "
                      f"{mid['loss_change']} (the median of {len(tops)} seeds; target 2x; the "
                      f"coarse solve alone does as well, bench/exit_ladder.py)")
    euler1 = ""
    x1 = rows.get(("ode_any_depth-euler1", "euler:1"))
    if x1 and ref:
        euler1 = (f"; told the time, with Euler x 1 alone drafted (ode_any_depth_euler1.toml), "
                  f"Euler x 1 agrees at {100 * x1['agreement']:.0f}% at "
                  f"{100 * (x1['own_loss'] / ref['own_loss'] - 1):+.2f}% loss")
        e1_seeds = speculative_models(results, "speculative_euler1",
                                      "any_depth_kvblock_time_x1w0.5")
        if e1_seeds:
            target = results["speculative_euler1"].get("target_speedup", 2.5)
            gx, sx = (median_seed(e1_seeds, d)[0] for d in ("greedy", "sampled"))
            retimed = all(all(f"eager {d}" in (m.get("confirmed") or {})
                              for d in ("greedy", "sampled")) for m in e1_seeds)
            euler1 += (f" and self-speculative decoding runs at {gx:.2f}x greedy and {sx:.2f}x "
                       f"sampled (medians of {len(e1_seeds)} seeds"
                       f"{', each fastest row re-timed' if retimed else ''}; "
                       f"target {target}x: {'met' if min(gx, sx) >= target else 'missed'})")
            old = [against_pass(e1_seeds, d) for d in ("greedy", "sampled")]
            if None not in old:
                euler1 += (f" against plain decoding that runs the own solve op by op (the lean "
                           f"step, as the drafts and verifications), itself {old[0][1]:.2f}x the decoding "
                           f"pass's tokens/s greedy; against plain decoding through the decoding "
                           f"pass, {old[0][0]:.2f}x greedy and {old[1][0]:.2f}x sampled")
        euler1 += _pipelined(results, "speculative_pipelined", "any_depth_kvblock_time_x1w0.5")
        ptb = [x for (m, _), x in rows.items() if m == "ptb_ode_any_depth-euler1"]
        ptb_ref, ptb_e1 = rows.get(("ptb_ode_rk4", "euler:1")), \
            rows.get(("ptb_ode_any_depth-euler1", "euler:1"))
        if ptb and ptb_ref and ptb_e1:
            euler1 += (f"; on Penn Treebank words (1 seed) the same recipe's own solve reads "
                       f"{ptb_e1['own_loss']:.4f} against {ptb_ref['own_loss']:.4f} for ode_rk4, "
                       f"Euler x 1 agreeing at {100 * ptb_e1['agreement']:.0f}%, and "
                       + ("no finer solve reads worse, NFE 1 to "
                          f"{max(x['nfe'] for x in ptb)}" if never_worse(ptb)
                          else "a finer solve reads worse"))
    nfe4 = ""
    e4, fixed = (rows.get(("ode_any_depth-kvblock-euler4-lr5e-3", "euler:4")),
                 rows.get(("ode_euler-lr5e-3", "euler:4")))
    e4_1 = rows.get(("ode_any_depth-kvblock-euler4-lr5e-3", "euler:1"))
    w1 = rows.get(("ode_any_depth-kvblock-euler4-w1-lr5e-3", "euler:1"))
    if e4 and fixed and e4_1:
        gap = e4["own_loss"] - fixed["own_loss"]
        nfe4 = (f"; with Euler x 4 as its own solve (ode_any_depth_nfe4.toml) NFE 4 reads "
                f"{e4['own_loss']:.4f} against {fixed['own_loss']:.4f} for Euler x 4 trained "
                f"alone ({gap:+.4f}; target within 0.01: {'met' if gap <= 0.01 else 'missed'}) "
                f"with Euler x 1 agreeing at {100 * e4_1['agreement']:.0f}%"
                + (f" ({100 * w1['agreement']:.0f}% at KL weight 1, "
                   f"{w1['own_loss'] - fixed['own_loss']:+.4f})" if w1 else "")
                + ", though its finer solves get worse")
    return (f"**One run teaches the coarse solves to agree with the model's own solve**: "
            f"with train.any_depth (a KL term toward the RK4 x 4 solve's own distribution for "
            f"a drawn Euler x 1, Euler x 2 or RK4 x 1 solve, no teacher run) the greedy token "
            f"of Euler x 1 matches RK4 x 4's at {100 * b1['agreement']:.0f}% of positions "
            f"against {100 * a1['agreement']:.0f}% for the model trained for RK4 x 4 "
            f"alone{rk4}, for {b1['own_loss'] - a1['own_loss']:+.4f} in the own solve's "
            f"validation loss (Tiny Shakespeare; {b1['seeds']} seeds of the recipe against "
            f"{a1['seeds']} of the model trained alone){tuned_text}"
            f"{ladder + spec if kv_seeds else spec + ladder}{euler1}{nfe4} (2 CPU "
            f"cores). "
            f"[Any depth]({PAGE}#one-model-trained-to-be-turned)")


FINDINGS.insert(FINDINGS.index(speculative) + 1, any_depth)


def _pipelined(results: dict, record: str, prefix: str, target: float | None = None) -> str:
    """The pipelined record's medians over the seeds (Draft(pipeline=True), re-timed rows),
    as a clause of a finding; empty without the record."""
    seeds = speculative_models(results, record, prefix)
    if not seeds:
        return ""
    target = target or results[record].get("target_speedup", 2.5)
    gx, sx = (median_seed(seeds, d, "pipelined")[0] for d in ("greedy", "sampled"))
    text = (f"; with the drafts made ahead by a process of their own on the second core "
            f"(Draft(pipeline=True)), {gx:.2f}x greedy and {sx:.2f}x sampled (medians of "
            f"{len(seeds)} seeds; target {target}x: "
            f"{'met' if min(gx, sx) >= target else 'missed'})")
    native = speculative_models(results, record + "_native", prefix)
    if native:  # bench/speculative.py --onednn auto, as generate runs a float32 model
        gx, sx = (median_seed(native, d, "pipelined")[0] for d in ("greedy", "sampled"))
        text += (f", and {gx:.2f}x and {sx:.2f}x against the faster plain decoding of "
                 f"torch's own CPU kernels, as `generate` now runs (target "
                 f"{'met' if min(gx, sx) >= target else 'missed'})")
    return text


def layer_skip(results: dict) -> str | None:
    r = results.get("agreement")
    rows = {(x["model"], x["draft"]): x for x in (r or {}).get("rows", [])}
    a, b = rows.get(("transformer_baby", "layers:1")), rows.get(("transformer_layerskip",
                                                                 "layers:1"))
    if a is None or b is None:
        return None
    spec = ""
    seeds = speculative_models(results, "speculative_layerskip", "layerskip")
    if seeds:
        gx, glo, ghi, g = median_seed(seeds, "greedy")
        sx, slo, shi, _ = median_seed(seeds, "sampled")
        base = speculative_models(results, "speculative_layerskip", "transformer_baby")
        untrained = (f", against {speculative_best(base[0], 'greedy')[1]:.2f}x greedy for the "
                     f"stack trained without it" if base else "")
        spec = (f"; drafting with its first layers it decodes at {gx:.2f}x plain cached "
                f"decoding greedy (the same tokens; the median of {len(seeds)} seeds, "
                f"{glo:.2f}-{ghi:.2f}x; {g['draft']}, {100 * g['acceptance']:.0f}% kept) and "
                f"{sx:.2f}x sampled ({slo:.2f}-{shi:.2f}x){untrained} (target 1.5x: "
                f"{'met' if max(gx, sx) >= 1.5 else 'missed'})")
        first = speculative_models(results, "speculative_layerskip_x1", "layerskip_x1")
        one = rows.get(("transformer_layerskip-exit-at-1", "layers:1"))
        if first and one:
            fx, flo, fhi, _ = median_seed(first, "greedy")
            fs, fslo, fshi, _ = median_seed(first, "sampled")
            spec += (f"; with the whole exit loss after the first layer "
                     f"(transformer_layerskip_first.toml) that layer agrees at "
                     f"{100 * one['agreement']:.0f}% ({100 * (one['own_loss'] / a['own_loss'] - 1):+.1f}% "
                     f"loss) and drafting runs at {fx:.2f}x greedy ({flo:.2f}-{fhi:.2f}x) and "
                     f"{fs:.2f}x sampled ({fslo:.2f}-{fshi:.2f}x), the median of {len(first)} "
                     f"seeds (target 1.5x: {'met' if min(fx, fs) >= 1.5 else 'missed'})")
            taught = speculative_models(results, "speculative_layerskip_kl", "layerskip_x1kl1")
            kl = rows.get(("transformer_layerskip-exit-at-1-kl", "layers:1"))
            if taught and kl:
                kx = median_seed(taught, "greedy")[0]
                ks = median_seed(taught, "sampled")[0]
                spec += (f"; teaching it the stack's own distribution too (exit_kl, "
                         f"transformer_layerskip_kl.toml) lifts it to "
                         f"{100 * kl['agreement']:.0f}% "
                         f"({100 * (kl['own_loss'] / a['own_loss'] - 1):+.1f}% loss) and "
                         f"drafting to {kx:.2f}x greedy and {ks:.2f}x sampled (target 1.5x: "
                         f"{'met' if min(kx, ks) >= 1.5 else 'missed'})")
                spec += _pipelined(results, "speculative_pipelined_layerskip",
                                   "layerskip_x1kl1", 1.5)
            both = [against_pass(first, d) for d in ("greedy", "sampled")]
            if None not in both:
                (g, lean_g), (s, _) = both
                spec += (f"; plain decoding itself runs the stack op by op (the lean step) at "
                         f"{lean_g:.2f}x the decoding pass's tokens/s, against which drafting "
                         f"runs at {g:.2f}x greedy and {s:.2f}x sampled")
    return (f"**A discrete stack trained with LayerSkip's recipe drafts for itself**: with "
            f"train.layer_skip (layer dropout rising with depth, an early-exit loss through the "
            f"shared head) the first of the baby GPT's 4 layers gives the whole stack's greedy "
            f"token at {100 * b['agreement']:.0f}% of positions against "
            f"{100 * a['agreement']:.0f}% without it, for "
            f"{100 * (b['own_loss'] / a['own_loss'] - 1):+.1f}% in validation loss (Tiny "
            f"Shakespeare; {b['seeds']} seed{'s' * (b['seeds'] != 1)} each){spec} (2 CPU cores). "
            f"[Any depth]({PAGE}#one-model-trained-to-be-turned)")


FINDINGS.insert(FINDINGS.index(any_depth) + 1, layer_skip)


def _batched_pass(row: dict) -> bool:
    return row.get("path", "").startswith("batched pass")


def serve_rows(r: dict | None) -> tuple[dict, dict | None]:
    """(the serving record's rows at the model's own depth by client count, the one-client
    row a client alone gets; the one client through the batched pass, None if not recorded)."""
    rows = (r or {}).get("rows", [])
    return ({x["clients"]: x for x in rows if "NFE" not in x["depths"] and not _batched_pass(x)},
            next((x for x in rows if _batched_pass(x)), None))


def serve(results: dict) -> str | None:
    r = results.get("serve")
    rows, batched = serve_rows(r)
    if 1 not in rows or 16 not in rows:
        return None
    x, one = rows[16], rows[1]
    mixed = next((m for m in r["rows"] if "NFE" in m["depths"]), None)
    return (f"**A trained model serves many clients at once** (`continuumlm serve`, OpenAI's "
            f"completion API): 16 concurrent streaming clients get {x['vs_one_client']:.2f}x "
            f"one client's tokens/s ({x['tokens_per_s']:.0f} against "
            f"{one['tokens_per_s']:.0f}; target 4x: "
            f"{'met' if x['vs_one_client'] >= 4 else 'missed'}), each the text it gets alone, "
            f"at {x['itl_p99_vs_one']:.1f}x one client's p99 time between tokens (target 3x: "
            f"{'met' if x['itl_p99_vs_one'] <= 3 else 'missed'})"
            + (f"; one client alone decodes through the lean step, as generate does, at "
               f"{one['tokens_per_s'] / batched['tokens_per_s']:.2f}x its rate through the "
               f"batched pass, against which the 16 clients get {x['vs_one_batched']:.2f}x"
               if batched else "")
            + (f"; clients asking for 1, 4 and 16 field evaluations per token share the server "
               f"at {mixed['tokens_per_s']:.0f} tokens/s" if mixed else "")
            + f" (2 CPU cores). [Serving]({PAGE}#serving-many-clients-continuous-batching)")


FINDINGS.insert(FINDINGS.index(any_depth) + 1, serve)
