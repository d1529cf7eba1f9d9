"""Regenerate docs/results.md from the JSON files in bench/results/ (never typed by hand).

    python bench/render.py
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import conclusions
import findings
import gpu_page
import page
import tomllib
from common import (
    DOCS_DIR,
    RESULTS,
    ROOT,
    SHARED_CORES,
    canonical_overrides,
    forward_nfe,
    markdown_table,
    run_config,
    timed_runs,
)

DOCS = DOCS_DIR / "results.md"
# the README whose findings block is written: the repository's when the page is (records and
# page in their own folders), else only one named by CONTINUUMLM_README (a --quick run into
# other folders leaves the README alone)
_ROOT = Path(__file__).resolve().parents[1]
README_FILE = (Path(os.environ["CONTINUUMLM_README"]) if "CONTINUUMLM_README" in os.environ
               else _ROOT / "README.md" if (RESULTS.resolve() == (_ROOT / "bench" / "results")
                                            .resolve() and DOCS_DIR.resolve()
                                            == (_ROOT / "docs").resolve())
               else None)


def _load() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))}


def _fmt_mean(values: list[float], digits: int = 3) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def early_stopping_table(results: dict, prefix: str) -> str:
    """One row per run under ``prefix`` whose JSON has ``best_checkpoint``."""
    rows = []
    for r in results.values():
        best = r.get("best_checkpoint")
        if not best or not r.get("config", "").startswith(prefix):
            continue
        per_step = _tokens_per_step(r) or 0
        test = best.get("test_loss_full_split")
        rows.append({"config": config_cell(r["config"], r.get("overrides")), "seed": r["seed"],
                     "step": f"{best['step']} of {r['final_step']}",
                     "tokens": f"{best['step'] * per_step / 1e6:.2f} M",
                     "val": f"{math.exp(best['val_loss_full_split']):.1f}",
                     "last_val": f"{math.exp(r['val_loss_full_split']):.1f}",
                     "test": f"{math.exp(test):.1f}" if test is not None else "",
                     "last_test": (f"{math.exp(r['test_loss_full_split']):.1f}"
                                   if r.get("test_loss_full_split") is not None else "")})
    if not rows:
        return ""
    return markdown_table(rows, [("config", "config"), ("seed", "seed"),
                                 ("step", "best checkpoint (step)"), ("tokens", "tokens seen"),
                                 ("val", "val ppl"), ("test", "test ppl"),
                                 ("last_val", "val ppl, last step"),
                                 ("last_test", "test ppl, last step")])


def elastic_screening_table(results: dict) -> str:
    """The elastic models' whole-split val loss at their training solve (RK4 x 4) against
    ode_rk4 trained on the same seed: every untagged elastic run with several seeds, and every
    tagged one (a recipe tried with --set)."""
    sh = "configs/shakespeare_char/"
    def shared(r: dict) -> tuple:
        """The overrides a recipe shares with its reference (the learning rates): a recipe
        run at another rate is set against ode_rk4 run at that rate."""
        return tuple(sorted(o for o in r.get("overrides") or ()
                            if o.split("=")[0] in ("train.lr", "train.min_lr")))

    ref = {(r["seed"], shared(r)): r["val_loss_full_split"] for r in results.values()
           if r.get("config") == f"{sh}ode_rk4.toml"
           and len(shared(r)) == len(r.get("overrides") or ())}
    runs = [r for r in results.values()
            if r.get("config", "").startswith(f"{sh}ode_elastic_dial") and "seed" in r]
    multi = {c for c in {r["config"] for r in runs if not r.get("tag")}
             if sum(1 for r in runs if r["config"] == c and not r.get("tag")) > 1}
    groups = defaultdict(list)  # recipe (config and overrides) -> its runs
    for r in sorted(runs, key=lambda r: (r["config"], r.get("tag") or "", str(r["seed"]))):
        if r.get("tag") or r["config"] in multi:  # a recipe under either spelling
            groups[(r["config"], canonical_overrides(row_overrides(r)))].append(r)
    rows = []
    for group in groups.values():
        cell = config_cell(group[0]["config"], row_overrides(group[0]))
        gaps = []
        for r in group:
            base = ref.get((r["seed"], shared(r)))
            gap = None if base is None else r["val_loss_full_split"] - base
            gaps += [] if gap is None else [gap]
            rows.append({"config": cell, "seed": r["seed"],
                         "val": f"{r['val_loss_full_split']:.4f}",
                         "ref": "" if base is None else f"{base:.4f}",
                         "gap": "" if gap is None else f"{gap:+.4f}"})
        if len(gaps) > 1 and len(gaps) == len(group):  # a mean over seed-matched gaps only
            rows.append({"config": cell, "seed": f"mean of {len(gaps)}", "val": "", "ref": "",
                         "gap": f"**{statistics.mean(gaps):+.4f}**"})
    if not rows:
        return ""
    return markdown_table(rows, [("config", "elastic recipe"), ("seed", "seed"),
                                 ("val", "val loss, RK4 x 4"),
                                 ("ref", "ode_rk4, same seed (and learning rate)"),
                                 ("gap", "gap (target <= 0.02)")])


def harness_checkpoints_note(r: dict, results: dict[str, dict]) -> list[str]:
    """bench/hf_harness.py trains its own checkpoints of each config: say where one is not the
    model of the training tables (its loss at the trained solve differs from that run's), so
    its by-depth figures are not read as that run's."""
    from hf_harness import PLAN

    differ = []
    for name, (config, seed, split, _) in PLAN.items():
        stem = f"{Path(config).parent.name}-{Path(config).stem}_seed{seed}"
        run = results.get(stem)
        if run is None:
            continue
        cfg = run_config(run)
        key = (f"{name}:{cfg.model.ode_solver}x{cfg.model.ode_steps}"
               if cfg.model.depth == "ode" else f"{name}:trained")
        theirs = run.get(f"{split}_loss_full_split")
        row = r["rows"].get(key)
        if row is None or theirs is None:
            continue
        if abs(row["ours_loss"] - theirs) > 1e-3:
            differ.append(f"`{name}` ({row['ours_loss']:.4f} here, {theirs:.4f} in "
                          f"`bench/results/{stem}.json`)")
    if not differ:
        return []
    return [f"These checkpoints are the script's own trainings of their configs "
            f"(`runs/bench/hf_harness/`). Where one scores another loss at its trained solve "
            f"than the run of the training tables, it is a separate training of that config, "
            f"and its figures by depth are not that run's: {'; '.join(differ)}. Each row still "
            f"compares the harness with `continuumlm eval` on one checkpoint. Deleting "
            f"`runs/bench/hf_harness/` and the JSON and running the command again retrains "
            f"them.", ""]


def _tokens_per_step(r: dict) -> int | None:
    """Training tokens per optimizer step of a run: its config with its --set options."""
    try:
        t = run_config(r).train
    except (OSError, ValueError):  # a config since removed or changed past reading
        return None
    return t.batch_size * t.seq_len * t.grad_accum


def run_setting(r: dict, key: str, default=None):
    """A run's value of ``key`` ("train.lr"): its --set option if it ran with one, else its config
    file's (the value as written, a string from --set), else ``default``. A key is found under
    either spelling (train.kinetic_weight, now train.regularize.kinetic_weight): records keep
    the spelling of their day."""
    from continuumlm.config import canonical_key

    key = canonical_key(key)
    for o in r.get("overrides") or ():
        name, _, value = o.partition("=")
        if canonical_key(name) == key:
            return value
    raw = tomllib.loads((ROOT / r["config"]).read_text())
    value = raw
    for part in key.split("."):  # [train.regularize] kinetic_weight = ..., train.lr = ...
        value = value.get(part) if isinstance(value, dict) else None
    if value is not None:
        return value
    section = key.partition(".")[0]
    for name, value in raw.get(section, {}).items():  # a flat key of an earlier spelling
        if canonical_key(f"{section}.{name}") == key:
            return value
    return default


def row_overrides(r: dict) -> tuple:
    """A run's --set options, a teacher trained on the run's own seed written with `{seed}`
    (train.distill_from=..._seed1 in the run of seed 1), so the seeds of one recipe share a
    row, and the cell is what train_seeds.py takes (it fills in {seed})."""
    return tuple(re.sub(rf"^(train\.(?:distill_from|distill\.teacher)=.*_seed){r.get('seed')}$",
                        r"\1{seed}", o)
                 for o in r.get("overrides") or ())


def config_cell(config: str, overrides: list[str] | tuple | None) -> str:
    """A results row's config, with the --set options it ran with (rows that differ only in
    them are separate rows)."""
    return " ".join([f"`{config}`", *(f"`--set {o}`" for o in overrides or ())])


def _tail(runs: list[dict]) -> str:
    """The mark of figures made by the evaluation that left a split's tail unscored, or of a
    score on at most N windows (train_seeds.py --max-windows, smoke tests), not the split."""
    windows = {r["max_windows"] for r in runs if r.get("max_windows")}
    tail = "" if all(r.get("eval_every_target") for r in runs) else " †"
    if windows:
        return f" ({max(windows)} windows at most, not the whole split){tail}"
    return tail


def _nfe_cell(runs: list[dict]) -> str:
    """Forward NFE: a fixed grid's count, or the mean of a run whose NFE varies (elastic draws:
    the expected NFE of the draw set; adaptive solvers: the last tenth of training), marked ~;
    "varies" for an adaptive run recorded before that mean was."""
    nfes = [forward_nfe(r, run_config(r)) for r in runs]
    if any(varies for _, varies in nfes):
        means = [n for n, _ in nfes if n is not None]
        return f"~{statistics.mean(means):.1f}" if means else "varies"  # an old record
    return str(nfes[0][0]) if nfes else ""


def _regularizer_runs(results: dict[str, dict]) -> list[dict]:
    """The unregularized Tsit5 run, then ode_tsit5_rnode.toml as written and the runs that
    change only its weights (strongest first), each with ``what`` (its weights in words),
    ``dloss`` (relative val loss against the unregularized run), ``fewer`` (fraction of forward
    NFE saved) and ``met`` (the target: >= 40% fewer at <= 1% higher loss). Empty when there is
    nothing to compare."""
    from continuumlm.config import canonical_key

    base = results.get("shakespeare_char-ode_tsit5_seed1337")
    if base is None:
        return []
    config = "configs/shakespeare_char/ode_tsit5_rnode.toml"
    names = ("train.regularize.kinetic_weight", "train.regularize.jacobian_weight",
             "train.regularize.steer")

    def weights(r: dict) -> tuple[float, ...]:
        return tuple(float(run_setting(r, n, 0.0)) for n in names)

    # the config as written and runs that change only its regularizers (other --set runs
    # compare something else); strongest weights first, STEER after the same weights without
    reg = sorted(((weights(r), r) for r in results.values()
                  if r.get("config") == config and r.get("seed") == 1337
                  and all(canonical_key(o.partition("=")[0]) in names
                          for o in r.get("overrides") or [])),
                 key=lambda wr: (-wr[0][0], -wr[0][1], wr[0][2]))
    if not reg:
        return []
    runs = [{"r": base, "what": "unregularized", "dloss": 0.0, "fewer": 0.0, "met": None}]
    for (kin, jac, steer), r in reg:
        dloss = r["val_loss_full_split"] / base["val_loss_full_split"] - 1
        fewer = 1 - r["nfe_mean_last_tenth"] / base["nfe_mean_last_tenth"]
        what = (f"kinetic + Jacobian, {kin:g} each" if kin == jac
                else f"kinetic {kin:g}, Jacobian {jac:g}")
        runs.append({"r": r, "what": what + (f"; STEER {steer:g}" if steer else ""),
                     "dloss": dloss, "fewer": fewer, "met": fewer >= 0.40 and dloss <= 0.01})
    return runs


def regularizer_table(results: dict[str, dict]) -> str:
    """Tsit5 without and with RNODE's regularizers (the config's weights and any tried with
    ``--set``, strongest first): val loss and NFE against the unregularized run, and the
    target (>= 40% fewer forward NFE at <= 1% higher val loss)."""
    runs = _regularizer_runs(results)
    if not runs:
        return ""
    rows = []
    for i, run in enumerate(runs):
        r = run["r"]
        rows.append({"config": config_cell(r["config"], r.get("overrides")), "what": run["what"],
                     "val": f"{r['val_loss_full_split']:.4f}",
                     "dloss": "" if i == 0 else f"{100 * run['dloss']:+.2f}%",
                     "nfe": f"{r['nfe_mean_last_tenth']:.1f}",
                     "fewer": "" if i == 0 else f"{100 * run['fewer']:.2f}%",
                     "target": "" if i == 0 else ("met" if run["met"] else "not met"),
                     "bnfe": "" if r.get("nfe_backward_mean_last_tenth") is None
                     else f"{r['nfe_backward_mean_last_tenth']:.1f}",
                     "wall": f"{r['wall_seconds']:.0f}" if r.get("wall_seconds") else ""})
    return markdown_table(rows, [("config", "config"), ("what", "regularizer"),
                                 ("val", "val loss (whole split)"), ("dloss", "vs unregularized"),
                                 ("nfe", "forward NFE (last tenth of training)"),
                                 ("fewer", "fewer NFE"), ("target", "target"),
                                 ("bnfe", "backward NFE"), ("wall", "wall s")])


def regularizer_verdict(results: dict[str, dict]) -> str:
    """One sentence on the regularizer table: the weights that meet the target, or, when none
    does, the most NFE saved within the loss bound and what the strongest saving cost."""
    runs = _regularizer_runs(results)[1:]
    if not runs:
        return ""

    def said(run: dict) -> str:
        return f"{100 * run['fewer']:.2f}% fewer at {100 * run['dloss']:+.2f}% ({run['what']})"

    met = [run for run in runs if run["met"]]
    if met:
        return "Target met by " + "; ".join(said(run) for run in met) + "."
    within = [run for run in runs if run["dloss"] <= 0.01]
    most = max(runs, key=lambda run: run["fewer"])
    text = f"No setting tried meets the target ({len(runs)} tried). "
    if within:
        best = max(within, key=lambda run: run["fewer"])
        text += f"Within 1% of the unregularized loss the most saved is {said(best)}"
        text += "." if best is most else f"; the most saved by any setting is {said(most)}."
    else:
        text += f"Every setting costs more than 1%; the most saved is {said(most)}."
    return text


def seminorm_why(run: dict, norm_parts: dict | None) -> list[str]:
    """Below the seminorm training table: where the seminorm saved backward steps in that run,
    and, from bench/adjoint_norm_parts.py, which part of the adjoint's state set its steps."""
    curves = run.get("curves") or {}
    default, semi = curves.get("default"), curves.get("seminorm")
    out = []
    if default and semi:
        fewer = [d[0] for d, m in zip(default, semi) if m[3] < d[3]]
        more = sum(m[3] > d[3] for d, m in zip(default, semi))
        early = sum(step <= 10 for step in fewer)
        out += [f"Per step, the seminorm took fewer backward evaluations in {len(fewer)} of "
                f"{min(len(default), len(semi))} steps ({early} of the first 10) and more in "
                f"{more}.", ""]
    if norm_parts:
        rows = norm_parts["rows"]
        saved = []
        for r in rows:
            if r["norm"] != "seminorm":
                continue
            base = next(d for d in rows if d["model"] == r["model"] and d["norm"] == "default")
            fewer = 1 - r["backward_nfe"] / base["backward_nfe"]
            saved.append(f"{r['model']} {100 * fewer:.1f}%")
        out += ["Why (`" + norm_parts["command"] + "` — " + norm_parts["setup"] + "): the "
                "backsolve adjoint integrates the state again, backward, beside its adjoint "
                "and the parameter adjoints, and rejects a step when the largest "
                "tolerance-scaled error over these parts exceeds 1; the seminorm leaves only the "
                "parameter adjoints out. It saves steps only where they hold the largest error "
                "(in the seminorm rows they are recorded but left out of the decision). "
                "Backward evaluations saved by the seminorm in this step: " + ", ".join(saved)
                + ". Exact gradients through the accepted steps (`ode_grad = \"checkpoint\"`) "
                "have no backward solve to control: the backward replays the forward's steps "
                "(section \"Gradients of adaptive solves\").", "", norm_parts["table"], ""]
    return out


def training_table(results: dict[str, dict], folder: str, test: bool = False,
                   keep=lambda r: True) -> str:
    """One row per config and --set options under ``folder`` (the runs ``keep`` accepts),
    its seeds' mean ± sd."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results.values():
        if "val_loss_full_split" in r and r["config"].startswith(folder) and keep(r):
            if r.get("split", "val") != "val":
                raise SystemExit(f"{r['config']} seed {r['seed']}: its JSON scores the "
                                 f"{r['split']} split under val_loss_full_split "
                                 f"(train_seeds.py --split); the tables read the validation "
                                 f"split. Move that JSON out of the results folder.")
            groups[(r["config"], canonical_overrides(row_overrides(r)))].append(r)
    rows = []
    # rows in the order of the options as the records spell them
    for runs in sorted(groups.values(), key=lambda g: (g[0]["config"], row_overrides(g[0]))):
        runs.sort(key=lambda r: r["seed"])
        config, overrides = runs[0]["config"], row_overrides(runs[0])
        timed, mark = timed_runs(runs)
        tps = statistics.mean(r["tokens_per_s_median"] for r in timed)
        per_step = _tokens_per_step(runs[0])
        rows.append({
            "config": config_cell(config, overrides),
            "seeds": ", ".join(str(r["seed"]) for r in runs),
            "params": f"{runs[0]['parameters'] / 1e6:.3f} M",
            "nfe": _nfe_cell(runs),
            "val": _fmt_mean([r["val_loss_full_split"] for r in runs]) + _tail(runs),
            "tps": f"{tps:.0f}" + mark,
            "ms_step": f"{per_step / tps * 1000:.0f}" if per_step else "",
            "ppl": _fmt_mean([math.exp(r["val_loss_full_split"]) for r in runs], 1),
            "test": _fmt_mean([math.exp(r["test_loss_full_split"]) for r in runs
                               if "test_loss_full_split" in r], 1) + _tail(runs)
            if any("test_loss_full_split" in r for r in runs) else "",
            "wall": _fmt_mean([r["wall_seconds"] for r in timed if r["wall_seconds"]], 0)
            if any(r["wall_seconds"] for r in timed) else "",
            "tokens": f"{runs[0]['final_step'] * per_step / 1e6:.2f} M"
            if per_step and runs[0].get("final_step") else "",
        })
    cols = [("config", "config"), ("seeds", "seeds"), ("params", "parameters"), ("nfe", "NFE"),
            ("val", "val loss (nats/token, whole split)")]
    if test:
        cols += [("ppl", "val ppl"), ("test", "test ppl (once, at the end)"),
                 ("tokens", "tokens seen")]
    cols += [("ms_step", "ms / step"), ("tps", "train tokens/s"), ("wall", "wall s (whole run)")]
    return markdown_table(rows, cols)


def verdict(results: dict[str, dict], folder: str, baseline: str, ppl: bool,
            skip=lambda stem: False) -> list[str]:
    """One sentence, computed from the JSON, on where each ODE row stands against its discrete
    counterpart (quality and time per token), so the page says so when they lose."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for r in results.values():  # each config as written: runs with --set options are other rows
        if ("val_loss_full_split" in r and r["config"].startswith(folder)
                and not r.get("overrides") and not skip(Path(r["config"]).stem)):
            runs[Path(r["config"]).stem].append(r)

    def score(name):  # as the table shows it: the seeds' mean loss, or mean perplexity
        return statistics.mean(math.exp(r["val_loss_full_split"]) if ppl
                               else r["val_loss_full_split"] for r in runs[name])

    def show(x):
        return f"{x:.1f}" if ppl else f"{x:.3f}"

    clauses, untimed = [], []
    for n in sorted(x for x in runs if x.startswith("ode_")):
        # a variant (BitNet precision, Dynamic Tanh) against the same model without it
        variant = next((v for v in ("_bitnet", "_dyt") if n.endswith(v)), None)
        ref = (n.removesuffix(variant) if variant else
               "deltanet" if "deltanet" in n and "deltanet" in runs else baseline)
        if ref not in runs:
            continue
        loss, ref_loss = score(n), score(ref)
        # a time ratio only from runs measured alone: shared runs' tokens/s are understated
        timing = ""
        (mine, mark), (theirs, ref_mark) = timed_runs(runs[n]), timed_runs(runs[ref])
        if not mark and not ref_mark:
            slower = (statistics.mean(r["tokens_per_s_median"] for r in theirs)
                      / statistics.mean(r["tokens_per_s_median"] for r in mine))
            timing = f", {slower:.1f}x the time per token"
        else:
            untimed.append(n)
        clauses.append(f"`{n}` {show(loss)} vs `{ref}` {show(ref_loss)} "
                       f"({'better' if loss < ref_loss else 'worse'}{timing})")
    if not clauses:
        return []
    what = "val perplexity" if ppl else "val loss"
    note = (" Time per token is compared only between runs measured alone (unmarked rows); "
            f"{'none of these pairs' if len(untimed) == len(clauses) else 'not every pair'} "
            "qualifies; the cost-per-evaluation and training-step tables below time the "
            "models under control."
            if untimed else "")
    if any(n.endswith("_bitnet") and n.removesuffix("_bitnet") in runs for n in runs):
        what = f"a BitNet row against the same model in full precision; {what}"
    if any(n.endswith("_dyt") and n.removesuffix("_dyt") in runs for n in runs):
        what = f"a Dynamic Tanh row against the same model with LayerNorm; {what}"
    return [f"ODE rows against their discrete counterparts ({what}): " + "; ".join(clauses)
            + "." + note, ""]


def mqar_records(results: dict[str, dict]) -> list[dict]:
    """One record per MQAR config: the plain one, or, when a learning-rate sweep
    (bench/mqar_sweep.py) has summarized it, the record of its best rate, marked with
    ``shown_lr`` ("best of N"). Records of single sweep rates (tagged) are not rows."""
    out = []
    for key, r in results.items():
        if not key.startswith("mqar-") or r.get("tag"):
            continue
        if "lr_sweep" in r:
            best = next(x for x in r["lr_sweep"] if x["lr"] == r["lr_best"])
            shown = results.get(best["record"].removesuffix(".json"))
            if shown is None:  # shown as the best rate, it would be another rate's record
                raise SystemExit(f"{key}.json names {best['record']} as the record of its best "
                                 f"learning rate, and bench/results/ has no such file: run "
                                 f"`python bench/mqar_sweep.py {r['config']}` again.")
            ranked = sum(1 for x in r["lr_sweep"] if x.get("ranked", True))
            r = {**shown, "lr_sweep": r["lr_sweep"],
                 "shown_lr": f"{r['lr_best']:g} (best of {ranked})"}
        out.append(r)
    return sorted(out, key=lambda r: (r["num_kv_pairs"], r["config"]))


def mqar_lr(r: dict) -> str:
    if "shown_lr" in r:
        return r["shown_lr"]
    lr = run_setting(r, "train.lr", "")
    return f"{float(lr):g}" if lr != "" else ""


def mqar_sweep_table(results: dict[str, dict]) -> str:
    """Held-out recall at every learning rate of each swept config."""
    recs = [r for r in mqar_records(results) if r.get("lr_sweep")]
    if not recs:
        return ""
    rows = []
    for r in recs:
        for x in r["lr_sweep"]:
            if x.get("record") is None:  # stopped before its first evaluation
                rows.append({"config": config_cell(r["config"], []), "lr": f"{x['lr']:g}",
                             "acc": "none (stopped before its first evaluation)",
                             "fresh": "", "steps": "0"})
                continue
            rows.append({"config": config_cell(r["config"], []), "lr": f"{x['lr']:g}",
                         "acc": f"{100 * x['accuracy']:.1f}%",
                         "fresh": "" if x.get("fresh_accuracy") is None
                         else f"{100 * x['fresh_accuracy']:.2f}%",
                         "steps": f"{x['steps']} of {x['max_steps']}"
                         + ("" if x["complete"] else " (unfinished)")
                         + ("" if x.get("ranked", True) else
                            " (another step limit than the config's: not ranked)")})
    return markdown_table(rows, [("config", "config"), ("lr", "learning rate"),
                                 ("acc", "recall (last evaluation)"),
                                 ("fresh", "final model, fresh set"), ("steps", "steps")])


def mqar_table(results: dict[str, dict]) -> str:
    rows = []
    for r in mqar_records(results):
        rows.append({"config": config_cell(r["config"], r.get("overrides")), "mixer": r["mixer"],
                     "lr": mqar_lr(r),
                     "depth": r["depth"],
                     "pairs": str(r["num_kv_pairs"]) + (
                         f" (trained on {', '.join(map(str, r['train_kv_pairs']))})"
                         if r.get("train_kv_pairs") else ""), "acc": f"{100 * r['accuracy']:.1f}%",
                     "best": f"{100 * r['best_accuracy']:.1f}%",
                     "fresh": f"{100 * r['fresh_accuracy']:.2f}%" if "fresh_accuracy" in r
                     else "",
                     "steps": f"{r['steps']} of {r['max_steps']}"
                     + ("" if r.get("complete", True) else " (unfinished)"),
                     "min": f"{r['seconds'] / 60:.0f}"})
    return markdown_table(rows, [("config", "config"), ("mixer", "mixer"), ("depth", "depth"),
                                 ("pairs", "key-value pairs"), ("lr", "learning rate"),
                                 ("acc", "recall (last evaluation)"),
                                 ("best", "best"), ("fresh", "final model, fresh set"), ("steps", "steps"), ("min", "minutes")])


def mqar_distance_table(results: dict[str, dict]) -> str:
    """Recall split by how far a query lies after its key-value pair, one row per record that
    carries the split (the same evaluation as the main table's last one)."""
    recs = [r for r in mqar_records(results) if r.get("recall_by_distance")]
    if not recs:
        return ""
    buckets = [(b["from"], b["to"]) for b in recs[0]["recall_by_distance"]]
    cols = [("config", "config"), ("steps", "step")]
    for lo, hi in buckets:
        cols.append((f"{lo}", f"{lo}–{hi - 1}" if hi is not None else f"≥ {lo}"))
    rows = []
    for r in recs:
        row = {"config": config_cell(r["config"], r.get("overrides")), "steps": str(r["steps"])}
        for b in r["recall_by_distance"]:
            if (b["from"], b["to"]) in buckets:
                row[f"{b['from']}"] = ("–" if b["accuracy"] is None else
                                       f"{100 * b['accuracy']:.1f}% ({b['queries']})")
        rows.append(row)
    return markdown_table(rows, cols)


def ptb_dropout_sweep(results: dict[str, dict]) -> list[str]:
    """The standard setup's dropout sweep at a quarter of the budget (the runs tagged
    ``sweep_dropoutD``): whole-split validation perplexity per model and rate, with each
    model's best rate named (judged on the validation split only)."""
    sweep: dict[str, dict[str, float]] = {}
    for r in results.values():
        tag = r.get("tag") or ""
        if (r.get("config", "").startswith("configs/ptb_std/") and tag.startswith("sweep_dropout")
                and r.get("seed") == 1):  # the sweep is one seed's
            sweep.setdefault(Path(r["config"]).stem, {})[tag[len("sweep_dropout"):]] = (
                math.exp(r["val_loss_full_split"]))
    if not sweep:
        return []
    rates = sorted({d for ppl in sweep.values() for d in ppl}, key=float)
    rows, best = [], []
    for model, ppl in sorted(sweep.items()):
        top = min(ppl, key=ppl.get)
        rows.append({"model": model, **{d: (f"**{ppl[d]:.1f}**" if d == top else f"{ppl[d]:.1f}")
                                        if d in ppl else "not run" for d in rates}})
        missing = [d for d in rates if d not in ppl]
        best.append(f"{model} {top}" + (f" (of {len(ppl)} rate{'s' if len(ppl) > 1 else ''}; "
                                        f"{', '.join(missing)} not run yet)" if missing else ""))
    table = markdown_table(rows, [("model", "model")] + [(d, f"dropout {d}") for d in rates])
    return ["The dropout sweep (validation perplexity, whole split, seed 1, a quarter of the "
            "budget; best in bold): best rate " + "; ".join(best) + ".", "", table, ""]


def ptb_std_targets(results: dict[str, dict]) -> list[str]:
    """The standard setup's two targets, from the headline runs (the configs as written, test
    split at the last step): the discrete model's test perplexity against Zaremba-small's
    114.5, and the ODE model's within 5% of the discrete one's, seed-matched where both ran."""
    test = {}
    for r in results.values():
        if (r.get("config") in ("configs/ptb_std/transformer.toml",
                                "configs/ptb_std/ode_euler.toml")
                and not r.get("overrides") and "test_loss_full_split" in r):
            test.setdefault(Path(r["config"]).stem, {})[r["seed"]] = math.exp(
                r["test_loss_full_split"])
    disc, ode = test.get("transformer", {}), test.get("ode_euler", {})
    out = []
    if disc:
        mean = statistics.mean(disc.values())
        out.append(f"Targets: the discrete model's test perplexity, {mean:.1f} (mean of "
                   f"{len(disc)} seed{'s' if len(disc) > 1 else ''}), is "
                   f"{'at or below' if mean <= 114.5 else 'above'} Zaremba-small's 114.5.")
    both = sorted(set(disc) & set(ode))
    if both:
        gaps = [ode[s] / disc[s] - 1 for s in both]
        gap = statistics.mean(gaps)
        out.append(f"The ODE model's is {gap:+.1%} against the discrete model's on the same "
                   f"seed ({', '.join(f'seed {s}: {ode[s]:.1f} vs {disc[s]:.1f}' for s in both)}"
                   f"; target within 5%: {'met' if gap <= 0.05 else 'not met'}"
                   f"{'' if len(both) >= 3 else f', {len(both)} of the 3 seeds'}).")
    return [" ".join(out), ""] if out else []


def teacher_cost(r: dict) -> list[str]:
    """The distilled recipe's whole cost against the 1.3x target: its own steps and, when the
    teacher is trained for it alone, the teacher's (the same number of ode_euler steps)."""
    ratio = {row["config"]: row["ratio"] for row in r["rows"]}
    kd, euler = ratio.get("ode_elastic_dial_capped-cw1.0-kd1.0"), ratio.get("ode_euler")
    if kd is None or euler is None:
        return []
    total = kd + euler
    return [f"The distilled recipe costs {kd:.2f}x ode_rk4 per step, the teacher's forward pass "
            f"included (target 1.3x: {'met' if kd <= 1.3 else 'not met'}). Its teacher is a "
            f"second run, ode_euler for as many steps ({euler:.2f}x): counted in, "
            f"{total:.2f}x ({'within' if total <= 1.3 else 'above'} the target); when the "
            f"teacher is the NFE-4 model one trains anyway, only the first figure is extra.", ""]


def baseline_sentence(results: dict[str, dict]) -> list[str]:
    base = [r["val_loss_full_split"] for r in results.values()  # the config as written
            if r.get("config") == "configs/shakespeare_char/transformer_baby.toml"
            and "val_loss_full_split" in r and not r.get("overrides")]
    if not base:
        return []
    mean = statistics.mean(base)
    verdict = "matches" if mean <= 1.89 else "is above"
    return [f"The discrete baseline's mean over {len(base)} seed(s), {mean:.3f}, {verdict} the "
            f"target of 1.89 set from nanoGPT's reported 1.886 (an estimate from 20 random "
            f"batches, itself uncertain by about ±0.02). nanoGPT was not run on this machine.", ""]


def context_table(results: dict[str, dict], folder: str) -> str:
    rows = []
    for r in sorted(results.values(), key=lambda r: r.get("config", "")):
        if not (r.get("contexts") and r["config"].startswith(folder)):
            continue
        row = {"config": f"`{r['config']}`"}
        for c in r["contexts"]:
            row[c["context"]] = (f"{c['loss']:.3f} ({c['ppl']:.2f}){_tail([r])}" if "loss" in c
                                 else "unsupported")
        loss = {c["context"]: c["loss"] for c in r["contexts"] if "loss" in c}
        if 1024 in loss and 5000 in loss:
            row["rise"] = f"{loss[5000] - loss[1024]:+.3f}"
        rows.append(row)
    contexts = sorted({k for row in rows for k in row if isinstance(k, int)})
    rise = [("rise", "CE at 5000 - CE at 1024")] if any("rise" in row for row in rows) else []
    return markdown_table(rows, [("config", "config")] +
                          [(c, f"context {c}: CE (ppl)") for c in contexts] + rise) if rows else ""


ABLATIONS = DOCS_DIR / "ablations.md"
# the elastic-depth config the main table shows; the other ode_elastic* configs are variants
ELASTIC_CHOSEN = "configs/shakespeare_char/ode_elastic_dial_capped.toml"
# the elastic recipe the anytime-depth section shows (trained as in lr_sweep's best rows)
ELASTIC_RECIPE = findings.ELASTIC_RECIPE
# the models of the anytime-depth section (table and figure); the others are on the ablations page
ANYTIME_SHOWN = ("ode_euler", "ode_rk4", "ode_euler-lr2e-3", "ode_rk4-lr2e-3",
                 "ode_elastic_dial_capped", ELASTIC_RECIPE)
# the agreement section's own rows: the four models the comparison is about, the drafts of
# bench/agreement.py's default list; the rest on the ablations page
AGREEMENT_DISTILLED = "ode_elastic_dial_capped-cw1.0-kd1.0t5e-3-lr2e-3"
AGREEMENT_DRAFTS = ("euler:1", "euler:2", "euler:4", "rk4:1", "rk4:2")
# the discrete stacks of the agreement section (first-layers drafts), a table of their own
LAYERED = ("transformer_baby", "transformer_layerskip")
# bench/<key>.py records shown as one section each: (key, title); their prose is
# bench/pages/results/bench.md plus bench/pages/results/<key>.md when there is one
BENCH_SECTIONS = (("ode_cost", "Cost per function evaluation"),
                  ("ode_memory", "Memory and time vs solver steps"),
                  ("deltanet_kernels", "DeltaNet kernels vs causal softmax attention"),
                  ("mixer_step", "Training step by mixer at equal depth and NFE"),
                  ("decode_speed", "Decoding: cached vs recompute"),
                  ("speculative", "Self-speculative decoding through depth"),
                  ("agreement", "One model trained to be turned"),
                  ("gate_exit", "Per-token exit through a learned gate"),
                  ("exit_ladder", "Per-token exit across whole solves"),
                  ("truncated_backprop", "Truncated backpropagation through depth"),
                  ("serve", "Serving many clients: continuous batching"),
                  ("ode_kv", "Decoding memory that does not grow with the solve"),
                  ("depth_elasticity", "Anytime depth"),
                  ("depth_exit", "Per-token adaptive depth"),
                  ("elastic_cost", "Training cost of elastic depth"),
                  ("adaptive_grads", "Gradients of adaptive solves"),
                  ("adaptive_solvers", "Adaptive solvers on trained fields"),
                  ("seminorm_run", "The seminorm adjoint in training"),
                  ("scale", "Training throughput: processes and compile"),
                  ("keep_freed_memory", "CPU training: keeping freed memory"),
                  ("threads", "Threads on a quiet and a shared machine"),
                  ("cpu_kernels", "Decoding on the CPU: oneDNN's kernels or torch's own"),
                  ("mfu", "Model FLOPs utilization"),
                  ("data_scale", "Corpora at scale: prepare and memory-mapped training"),
                  ("hf_generate", "Hugging Face generate vs ContinuumLM's own decoding"),
                  ("hf_harness", "lm-evaluation-harness on trained checkpoints, by depth"))


def speculative_table(r: dict) -> str:
    """The fastest row per model and decoding, its speed-up taken against plain cached
    decoding's median rate over that model's rows (findings.speculative_best), as the
    conclusion reads it."""
    rows = []
    for m in r.get("models", []):
        modes = findings.speculative_modes(m)
        for mode in modes:
            for decoding in ("greedy", "sampled"):
                best, speedup, plain = findings.speculative_best(m, decoding, mode)
                again = (m.get("confirmed") or {}).get(f"{mode} {decoding}")
                rows.append({"model": m["name"], **best, "mode": mode,
                             "plain_median": round(plain, 1),
                             "speedup_median": round(speedup, 2),
                             "again": (f"{again['speedup']} ({min(again['ratios']):.2f}-"
                                       f"{max(again['ratios']):.2f})") if again else None})
    with_modes = any(row["mode"] != "eager" for row in rows)
    again = any(row["again"] for row in rows)
    return markdown_table(rows, [
        ("model", "model"), *([("mode", "mode")] if with_modes else []),
        ("decoding", "decoding"), ("draft", "draft solve"), ("k", "k"),
        *([("confidence", "stops below")] if any(row.get("confidence") for row in rows)
          else []),
        ("acceptance", "drafts kept"), ("tokens_per_verification", "tokens per verification"),
        ("nfe_per_token", "field evaluations per token"),
        ("plain_nfe_per_token", "... plain"), ("tok_s", "tokens/s"),
        ("plain_median", "plain tokens/s (median over the rows)"),
        ("speedup_median", "speed-up"),
        *([("again", "re-timed: median (range)")] if again else []),
        ("same_tokens", "same tokens (greedy)")])


def model_tables(*records: dict) -> list[str]:
    """Each model's every-row table of bench/speculative.py records, headed by its name and
    setup (for the ablations page)."""
    return [f"{m['name']} ({m['setup']}):\n\n{m['table']}"
            for r in records for m in r.get("models", [])]


def ladder_table(r: dict) -> str:
    """A bench/exit_ladder.py record's rows the results page shows: per run, the own solve,
    each coarse solve alone, each exit's most saving row within 0.5% of the own solve (the
    two-solve ladders, rungs before the own, on the ablations page only)."""
    chosen = set()
    for m in dict.fromkeys(x["model"] for x in r["rows"]):
        full, fixed, best = findings.ladder_choices(r["rows"], m)
        chosen |= {(m, x["exit"], x["criterion"], str(x["tau"] or ""))
                   for x in (full, *fixed, *best.values())
                   if x is not None and "+" not in x["exit"]}
    return page.split_table(r["table"], lambda c: tuple(c[:4]) in chosen)[0]


def _shakespeare_variant(r: dict) -> bool:
    """A Tiny Shakespeare run the main table leaves to the ablations page: one with --set
    options, or an elastic-depth config other than the chosen one."""
    config = r.get("config", "")
    return bool(r.get("overrides")) or (Path(config).stem.startswith("ode_elastic")
                                        and config != ELASTIC_CHOSEN)


def _notes(table: str) -> dict:
    return {"tail_note": page.fill("notes/tail") if "†" in table else ""}


def results_page(results: dict[str, dict], figures: list[str]) -> tuple[list[str], list[str]]:
    """The lines of docs/results.md and of docs/ablations.md."""
    recorded = {r.get("machine", "") for r in results.values()} - {""}
    # older records carry a shorter form of the same description; keep the fullest one
    machines = sorted(m for m in recorded if not any(o != m and o.startswith(m) for o in recorded))
    reg_runs = _regularizer_runs(results)
    busy = page.fill("notes/busy", shared_cores=SHARED_CORES)
    main = page.fill("results/intro", machines="; ".join(machines),
                     summary=conclusions.summary_table(results, reg_runs))
    extra = page.fill("ablations/intro")

    def ablation(part: str, **values) -> str:
        """Add an ablations section; its address from the results page."""
        nonlocal extra
        lines = page.fill(f"ablations/{part}", **values)
        extra += lines
        return "ablations.md#" + page.anchor(page.heading(lines))

    def opening(text: str | None) -> str:
        return text or ""

    # Tiny Shakespeare: the configs as written; variants to the ablations page
    variants = training_table(results, "configs/shakespeare_char/", keep=_shakespeare_variant)
    shakespeare = training_table(results, "configs/shakespeare_char/",
                                 keep=lambda r: not _shakespeare_variant(r))
    if shakespeare.count("\n") > 1:
        variants_at = (ablation("shakespeare", table=variants, busy_note=busy, **_notes(variants))
                       if variants.count("\n") > 1 else "#tiny-shakespeare-characters-nanogpts-"
                                                           "cpu-budget")
        main += page.fill("results/shakespeare",
                          conclusion=opening(conclusions.shakespeare(results)),
                          variants=variants_at, table=shakespeare, busy_note=busy,
                          baseline=baseline_sentence(results),
                          verdict=verdict(results, "configs/shakespeare_char/", "transformer_baby",
                                          ppl=False, skip=lambda stem: _shakespeare_variant(
                                              {"config": f"configs/shakespeare_char/{stem}.toml"})),
                          **_notes(shakespeare))
    cat = context_table(results, "configs/cat_protocol/")
    if cat:
        main += page.fill("results/cat_protocol",
                          conclusion=opening(conclusions.cat_protocol(results)), table=cat,
                          length5120=("The run tagged `length5120` trains with positions "
                                      "scaled to 5120 (`--set model.continuous.length=5120`) "
                                      "instead." if any("length5120" in k for k in results)
                                      else ""), **_notes(cat))
    ptb = training_table(results, "configs/ptb/", test=True)
    if ptb.count("\n") > 1:
        main += page.fill("results/ptb", conclusion=opening(conclusions.ptb(results)), table=ptb,
                          verdict=verdict(results, "configs/ptb/", "transformer", ppl=True),
                          ngram=page.fill("results/ptb.ngram", table=results["ptb-ngram"]["table"])
                          if "ptb-ngram" in results else "", **_notes(ptb))

    def dropout_sweep(r: dict) -> bool:
        return (r.get("tag") or "").startswith("sweep_")

    std = training_table(results, "configs/ptb_std/", test=True,
                         keep=lambda r: not dropout_sweep(r))
    if std.count("\n") > 1:
        swept = training_table(results, "configs/ptb_std/", test=True, keep=dropout_sweep)
        sweep_at = (ablation("ptb_dropout", table=swept, sweep=ptb_dropout_sweep(results))
                    if swept else "#penn-treebank-standard-setup")
        early = early_stopping_table(results, "configs/ptb_std/")
        main += page.fill("results/ptb_std", conclusion=opening(conclusions.ptb_std(results)),
                          table=std, sweep=sweep_at, targets=ptb_std_targets(results),
                          early=page.fill("results/ptb_std.early", table=early) if early else "")
    mq = mqar_table(results)
    if mq.count("\n") > 1:
        sweep = mqar_sweep_table(results)
        sweep_at = ablation("mqar_sweep", table=sweep) if sweep else "#multi-query-associative-recall-mqar"
        md = mqar_distance_table(results)
        main += page.fill("results/mqar", conclusion=opening(conclusions.mqar(results)),
                          table=mq, sweep=sweep_at,
                          distance=page.fill("results/mqar.distance", table=md) if md else "")
    reg = regularizer_table(results)
    if reg:
        main += page.fill("results/regularizers",
                          conclusion=opening(conclusions.regularizers(results, reg_runs)),
                          table=reg, verdict=regularizer_verdict(results))
    for key, title in BENCH_SECTIONS:
        if key not in results:
            continue
        r = results[key]
        table, notes = r["table"], []
        if key == "elastic_cost":
            notes += teacher_cost(r)
        if key == "seminorm_run":
            notes += seminorm_why(r, results.get("adjoint_norm_parts"))
        if key == "hf_harness":
            notes += harness_checkpoints_note(r, results)
        if key == "depth_elasticity":
            table, others = page.split_table(r["table"], lambda cells: cells[0] in ANYTIME_SHOWN)
            checks, other_checks = page.split_table(
                r.get("checks_table", ""), lambda cells: cells[0] in ANYTIME_SHOWN)
            if checks:
                notes += page.fill("results/depth_elasticity.checks", table=checks)
            if others:
                others_at = ablation("anytime", table=others, command=r["command"],
                                     checks=other_checks)
                screening = elastic_screening_table(results)
                screening_at = (ablation("screening", table=screening) if screening
                                else others_at)
                notes += page.fill("results/depth_elasticity", chosen=ELASTIC_RECIPE,
                                   others=others_at, screening=screening_at)
            sweep = results.get("lr_sweep")
            if sweep:
                sweep_at = ablation("lr_sweep", command=sweep["command"], setup=sweep["setup"],
                                    table=sweep["table"], gaps=sweep["gaps_table"])
                if sweep.get("best_table"):
                    notes += page.fill("results/depth_elasticity.best", sweep=sweep_at,
                                       table=sweep["best_table"])
        if key == "agreement":
            shown = ("ode_rk4", "ode_elastic_dial", AGREEMENT_DISTILLED, "ode_any_depth")
            table, others = page.split_table(
                r["table"], lambda cells: cells[0] in shown and cells[2] in AGREEMENT_DRAFTS)
            # the discrete stacks drafting with their first layers: a table of their own
            layered, others = page.split_table(others, lambda cells: cells[0] in LAYERED)
            if others:
                notes += [f"Every other model and draft: [the ablations page]"
                          f"({ablation('agreement', table=others, command=r['command'])}).", ""]
        if key == "gate_exit" and len({x.get("model") for x in r.get("rows", [])}) > 1:
            # per run: full depth, each criterion's most saving row within 0.5% of it, and the
            # gate's most saving row; every row on the ablations page
            chosen = set()
            for m in dict.fromkeys(x["model"] for x in r["rows"]):
                full, best, most = findings.exit_choices(r["rows"], m)
                chosen |= {(m, x["criterion"], str(x["tau"] or ""))
                           for x in (full, *best.values(), most) if x is not None}
            table, others = page.split_table(r["table"], lambda c: tuple(c[:3]) in chosen)
            notes += page.fill("results/gate_exit",
                               rows=ablation("gate_exit", table=r["table"], command=r["command"]))
        if key == "exit_ladder":
            table = ladder_table(r)
            notes += page.fill("results/exit_ladder", decode_setup=r["decode_setup"],
                               decode=r["decode_table"],
                               rows=ablation("exit_ladder", table=r["table"],
                                             command=r["command"]))
            nfe4 = results.get("exit_ladder_nfe4")
            if nfe4:
                notes += page.fill("results/exit_ladder.nfe4", command=nfe4["command"],
                                   setup=nfe4["setup"], table=ladder_table(nfe4),
                                   conclusion=" ".join(filter(None, (
                                       conclusions.exit_ladder(nfe4, results),
                                       conclusions.ladder_against_chance(nfe4)))),
                                   decode_setup=nfe4["decode_setup"],
                                   decode=nfe4["decode_table"],
                                   rows=ablation("exit_ladder_nfe4", table=nfe4["table"],
                                                 command=nfe4["command"]))
        if key == "depth_exit":
            chosen = {tuple(c[:3]) for c in _table_cells(r.get("decoding_table", ""))}
            table, others = page.split_table(
                r["table"], lambda cells: cells[1] == "full" or tuple(cells[:3]) in chosen)
            if others:
                notes += page.fill("results/depth_exit",
                                   others=ablation("depth_exit", table=r["table"],
                                                   command=r["command"]))
        if r.get("decoding_table"):
            notes += page.fill("results/depth_exit.decoding", table=r["decoding_table"])
        if key == "speculative":
            table = speculative_table(r)
            tables = model_tables(r)
            notes += page.fill("results/speculative", rows=ablation(
                "speculative", command=r["command"], tables="\n\n".join(tables)))
            compiled = results.get("speculative_compiled")
            if compiled:
                tables = model_tables(compiled)
                notes += page.fill(
                    "results/speculative.compiled", command=compiled["command"],
                    setup=compiled["setup"], table=speculative_table(compiled),
                    conclusion=conclusions.speculative_compiled(compiled),
                    rows=ablation("speculative_compiled", command=compiled["command"],
                                  tables="\n\n".join(tables)))
        if key == "agreement" and results.get("speculative_any_depth"):
            spec = results["speculative_any_depth"]
            tables = model_tables(spec)
            notes += page.fill("results/agreement", command=spec["command"],
                               setup=spec["setup"], table=speculative_table(spec),
                               outside=outside_field(spec),
                               rows=ablation("speculative_any_depth", command=spec["command"],
                                             tables="\n\n".join(tables)))
        if key == "agreement" and results.get("speculative_kvblock"):
            spec = results["speculative_kvblock"]
            specs = [x for x in (spec, results.get("speculative_kvblock_compiled"),
                                 results.get("speculative_euler1"),
                                 results.get("speculative_pipelined"),
                                 results.get("speculative_pipelined_native"),
                                 results.get("speculative_kvblock_x1w2")) if x]
            tables = model_tables(*specs)
            notes += page.fill("results/agreement.kvblock", command=spec["command"],
                               setup=spec["setup"], table=speculative_table(spec),
                               conclusion=conclusions.kvblock_speculative(results),
                               rows=ablation("speculative_kvblock",
                                             command=" && ".join(x["command"] for x in specs),
                                             tables="\n\n".join(tables)))
        if key == "agreement" and results.get("draft_cost"):
            cost = results["draft_cost"]
            notes += page.fill("results/agreement.draft_cost", command=cost["command"],
                               setup=cost["setup"], table=cost["table"],
                               conclusion=conclusions.draft_cost(cost))
        if key == "agreement" and layered:
            spec = results.get("speculative_layerskip")
            said = ""
            if spec:
                # the 4-layer stacks here; the 12-layer ones (speculative_layerskip12) with
                # every row on the ablations page
                specs = [x for x in (spec, results.get("speculative_layerskip12"),
                                     results.get("speculative_layerskip_variants"),
                                     results.get("speculative_layerskip_x1"),
                                     results.get("speculative_layerskip_kl"),
                                     results.get("speculative_layerskip_kl3"),
                                     results.get("speculative_pipelined_layerskip"),
                                     results.get("speculative_pipelined_layerskip_native"))
                         if x]
                tables = model_tables(*specs)
                said = (f"What it buys when generating, the fastest row per model and decoding "
                        f"against plain cached decoding's median rate (`{spec['command']}` — "
                        f"{spec['setup']}):\n\n{speculative_table(spec)}\n\n"
                        f"Every row, the recipe's variants (the exit loss after the first "
                        f"layer on each seed, and with its KL term) and the 12-layer stacks: [the "
                        f"ablations page]("
                        + ablation("speculative_layerskip",
                                   command=" && ".join(x["command"] for x in specs),
                                   tables="\n\n".join(tables)) + ").")
            notes += page.fill("results/agreement.layerskip", table=layered,
                               conclusion=conclusions.layer_skip(r, results) or "",
                               speculative=said)
        if key == "cpu_kernels":
            notes += ["GELU alone, microseconds per call on rows of 512:", "",
                      r["gelu_table"], ""]
        if key == "serve":
            notes += page.fill("results/serve", depth_table=r["depth_table"],
                               turn_table=r["turn_table"], **serve_notes(r))
        said = getattr(conclusions, key)
        conclusion = said(r) if key in ("ode_cost", "ode_memory", "deltanet_kernels",
                                        "mixer_step") else said(r, results)
        main += page.fill("results/bench", title=title, conclusion=opening(conclusion),
                          command=r["command"], setup=r["setup"], table=table, notes=notes)
    for gpu in gpu_page.records():  # one section per device
        main += gpu_page.section(gpu)
    if figures:
        main += page.fill("results/figures", figures=[f + "\n" for f in figures])
    return main, extra


def outside_field(spec: dict) -> str:
    """What share of a token's time the fastest rows spend outside the field evaluations
    (embedding, head, sampling, the solver's combinations, caches, Python), drafted and
    plain, where the record measured it."""
    parts = []
    for m in spec.get("models", []):
        for d in ("greedy", "sampled"):
            best = m["best"].get(f"eager {d}")
            if best and "outside_field" in best:
                parts.append(f"{m['name']} {d} ({best['draft']}, k {findings.k_of(best)}): "
                             f"{100 * best['outside_field']:.0f}% drafted, "
                             f"{100 * best['plain_outside_field']:.0f}% plain")
    if not parts:
        return ""
    text = ("Time outside the field evaluations, in the fastest rows (every row has it on "
            "the ablations page): " + "; ".join(parts) + ". Drafting cuts the evaluations "
            "per token, not what surrounds them, so that share grows with the speed-up and "
            "bounds it.")
    bounds = [b for m in spec.get("models", [])
              if (b := findings.speculative_bound(m, spec.get("target_speedup", 2.5)))]
    if bounds:
        text += (" What the target asks, from one cached forward pass timed alone (embedding "
                 "to logits, before sampling and a round's bookkeeping): " + "; ".join(bounds)
                 + ".")
    return text


def serve_notes(r: dict) -> dict:
    """The serving section's figures beside its tables: transformers' generate at batch 1,
    and the server's memory over many requests."""
    hf, mem = r["hf_generate"], r["memory"]
    turns = r["engine_turns"]
    served = {x["clients"]: x for x in r["rows"] if "NFE" not in x["depths"]}
    top = turns[-1]["batch"]
    return {"engine_gain": f"{turns[-1]['tokens_per_s'] / turns[0]['tokens_per_s']:.1f}",
            "top_rows": top, "engine_top": f"{turns[-1]['tokens_per_s']:.0f}",
            "served_top": f"{served[top]['tokens_per_s']:.0f}" if top in served else "n/a",
            "hf_tokens_per_s": f"{hf['tokens_per_s']:.0f}", "hf_same": hf["same_tokens"],
            "one_client": f"{r['rows'][0]['tokens_per_s']:.0f}",
            "requests": f"{mem['requests']:,}", "rss_100": f"{mem['rss_after_100_mib']:.1f}",
            "rss_all": f"{mem['rss_after_all_mib']:.1f}"}


def _table_cells(table: str) -> list[list[str]]:
    """The cells of a Markdown table's rows (header and rule left out)."""
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip("\n").split("\n")[2:]] if table else []


def main() -> None:
    # the page and its figures are one: without matplotlib nothing is written (a page without
    # its Figures section, or with figures of older results, would be a page that lies)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("bench/render.py draws the page's figures with matplotlib, which is not "
              "installed; nothing was written. Install it with pip install 'continuumlm[plot]' "
              "(or the dev extra) and run python bench/render.py again.", file=sys.stderr)
        raise SystemExit(2) from None
    results = _load()
    main_lines, ablation_lines = results_page(results, plots(results))
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    for path, lines in ((DOCS, main_lines), (ABLATIONS, ablation_lines)):
        path.write_text("\n".join(lines))
        print(f"wrote {path}")
    # the README's "What we found" (bench/findings.py), from the same records
    if README_FILE is not None:
        readme = README_FILE.read_text()
        found = findings.replace_block(readme,
                                       findings.block(results, _regularizer_runs(results)))
        if found != readme:
            README_FILE.write_text(found)
            print(f"wrote {README_FILE} (What we found)")


def _family(stem: str) -> str:
    if stem.startswith("cat_"):
        return "continuous attention (CAT)"
    if "deltanet" in stem:
        return "DeltaNet"
    if stem.startswith("ode_"):
        return "ODE (softmax attention)"
    return "discrete Transformer"


def _shakespeare_summary(results: dict[str, dict]) -> list[dict]:
    """One point per Shakespeare config: mean val loss over its seeds, training time per token
    (from the runs measured alone when any was), parameters."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results.values():
        if r.get("config", "").startswith("configs/shakespeare_char/") and not r.get("tag") \
                and "val_loss_full_split" in r and not r.get("overrides"):
            groups[r["config"]].append(r)
    out = []
    for config, runs in sorted(groups.items()):
        timed, mark = timed_runs(runs)
        tps = statistics.mean(r["tokens_per_s_median"] for r in timed)
        stem = Path(config).stem
        # a time measured while other work shared the cores is understated: not plotted
        out.append({"name": stem, "family": _family(stem),
                    "us_per_token": 1e6 / tps if not mark else None,
                    "parameters": runs[0]["parameters"],
                    "val": statistics.mean(r["val_loss_full_split"] for r in runs)})
    return out


def _pareto(rows: list[dict], key: str) -> list[dict]:
    """The rows no other row beats on both ``key`` (lower) and val loss (lower)."""
    front, best = [], float("inf")
    for r in sorted(rows, key=lambda r: (r[key], r["val"])):
        if r["val"] < best:
            front.append(r)
            best = r["val"]
    return front


def plots(results: dict[str, dict]) -> list[str]:
    """PNG figures in docs/img from the same JSON; returns markdown lines linking them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    img = DOCS.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    lines = []

    def save(fig, name: str, alt: str, suptitle: str | None = None) -> None:
        """Write img/<name>.png and link it."""
        if suptitle:
            fig.suptitle(suptitle)
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        fig.savefig(img / f"{name}.png", dpi=110)
        plt.close(fig)
        lines.append(f"![{alt}](img/{name}.png)")

    curves = {r["config"]: r["curve"] for r in results.values()
              if r.get("curve") and r.get("seed") == 1337 and not r.get("tag")
              and r["config"].startswith("configs/shakespeare_char/")
              and not _shakespeare_variant(r)}
    families = {"discrete Transformer": [], "ODE (softmax attention)": [],
                "DeltaNet": [], "continuous attention (CAT)": []}
    for config in sorted(curves):
        families[_family(Path(config).stem)].append(config)
    styles = ["-", "--", "-.", ":"]
    for kind, ylabel in (("val", "val loss (nats/char)"), ("train", "train loss (nats/char)")):
        if not curves:
            break
        fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True, sharey=True)
        for ax, (family, configs) in zip(axes.flat, families.items()):
            colors = plt.cm.tab20.colors if len(configs) > 10 else plt.cm.tab10.colors
            for i, config in enumerate(configs):
                c = curves[config]
                if c.get(kind):
                    steps, vals = zip(*c[kind])
                    ax.plot(steps, vals, color=colors[i % len(colors)],
                            ls=styles[(i // len(colors)) % 4],
                            marker="o" if kind == "val" else None, ms=2.5,
                            lw=1 if kind == "train" else 1.4, label=Path(config).stem)
            ax.set(title=family, ylim=(1.6, 2.8))
            ax.grid(alpha=0.3)
            if configs:
                ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                          frameon=False)
        for ax in axes[-1]:
            ax.set_xlabel("optimizer step (batch 12 x 64 characters)")
        for ax in axes[:, 0]:
            ax.set_ylabel(ylabel)
        save(fig, f"shakespeare_{kind}_curves", f"{kind} curves",
             f"Tiny Shakespeare, baby-GPT budget: {kind} loss by model family (seed 1337)")
    summary = _shakespeare_summary(results)

    def pareto_panel(ax, key: str, xlabel: str, fontsize: float, ylim: tuple) -> None:
        """Loss against ``key`` by family, the Pareto front named; rows above ``top`` drawn
        on the upper edge with their loss written beside them (one outlier would otherwise
        flatten every other row into a band)."""
        markers = dict(zip(families, "osD^"))
        top = ylim[1] - 0.02
        known = [r for r in summary if r[key] is not None]
        for family in families:
            pts = [r for r in known if r["family"] == family]
            if pts:
                ax.scatter([r[key] for r in pts], [min(r["val"], top) for r in pts],
                           marker=markers[family], s=40, label=family, alpha=0.85)
        front = _pareto(known, key)
        ax.plot([r[key] for r in front], [r["val"] for r in front], color="k", lw=1,
                ls="--", label="Pareto front")
        # the front and the discrete baseline named; alternate sides (neighbours are close)
        best = [min((r for r in known if r["family"] == f), key=lambda r: r["val"])
                for f in families if any(r["family"] == f for r in known)]
        named = front + [r for r in known if (r["family"] == "discrete Transformer" or r in best)
                         and r not in front]
        ax.set_ylim(*ylim)
        ax.set(xscale="log")
        renderer = ax.figure.canvas.get_renderer()
        taken = []  # label boxes placed so far, in pixels: a label goes where none is
        for r in named:
            for dx, dy, ha in ((6, 4, "left"), (6, -12, "left"), (-6, 4, "right"),
                               (-6, -12, "right"), (6, 14, "left"), (6, -22, "left"),
                               (-6, 14, "right"), (-6, -22, "right")):
                label = ax.annotate(r["name"], (r[key], r["val"]), fontsize=fontsize,
                                    xytext=(dx, dy), textcoords="offset points", ha=ha)
                box = label.get_window_extent(renderer)
                if not any(box.overlaps(b) for b in taken):
                    break
                label.remove()
            else:  # nowhere free: the first place
                label = ax.annotate(r["name"], (r[key], r["val"]), fontsize=fontsize,
                                    xytext=(6, 4), textcoords="offset points")
                box = label.get_window_extent(renderer)
            taken.append(box)
        for r in known:
            if r["val"] > top:
                ax.annotate(f"{r['name']} {r['val']:.2f} (off scale)", (r[key], top),
                            fontsize=fontsize, xytext=(-8, -12), textcoords="offset points",
                            ha="right")
        ax.set(xscale="log", xlabel=xlabel)
        # plain numbers at 1, 2 and 5 per decade: one label per decade cannot be read
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: f"{v:,.0f}" if v < 1e5 else f"{v / 1e6:g} M"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)

    if summary:
        vals = sorted(r["val"] for r in summary
                      if r["us_per_token"] is not None or r["parameters"] is not None)
        top = min(vals[-1] + 0.02, statistics.median(vals) + 0.3)
        cost = "training time per token (µs, 2 CPU cores; runs measured alone)"
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
        for ax, key, xlabel in ((axes[0], "us_per_token", cost),
                                (axes[1], "parameters", "parameters")):
            pareto_panel(ax, key, xlabel, 6.5, (vals[0] - 0.03, top + 0.02))
        axes[0].set_ylabel("val loss, whole split (nats/char, mean over seeds)")
        axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        save(fig, "shakespeare_pareto", "loss against cost",
             "Tiny Shakespeare: loss against training cost and size, every row")
        # the README's figure: one panel, sized for a page about 880 pixels wide
        fig, ax = plt.subplots(figsize=(8, 5.2), layout="constrained")
        timed = sorted(r["val"] for r in summary if r["us_per_token"] is not None)
        top = min(timed[-1] + 0.02, statistics.median(timed) + 0.3)
        pareto_panel(ax, "us_per_token", cost, 8, (timed[0] - 0.03, top + 0.02))
        ax.set_ylabel("val loss (nats/char)")
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3,
                   fontsize=8.5, frameon=False)
        save(fig, "findings_pareto", "loss against training cost",
             "Tiny Shakespeare at nanoGPT's CPU budget: every model family")
        lines.pop()  # the README links it; the page shows the two-panel figure

    def series(name, rows, series_of, x, y, label, family=None, **axes):
        """One line per series (rows grouped by series_of(row)), saved as img/<name>.png.
        With ``family`` (series key -> family key), a family's series share one colour and
        differ in line style (several seeds of one config)."""
        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        styles = ["-", "--", "-.", ":"]
        keys = list(dict.fromkeys(series_of(r) for r in rows))
        groups = list(dict.fromkeys(family(k) for k in keys)) if family else keys
        for key in keys:
            g = groups.index(family(key) if family else key)
            # within a family: the n-th member's style; otherwise tab10 repeats every ten
            n = [k for k in keys if family(k) == family(key)].index(key) if family else g // 10
            pts = sorted((x(r), y(r)) for r in rows if series_of(r) == key and y(r) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3.5, ls=styles[n % 4],
                        color=plt.cm.tab10.colors[g % 10], label=label(key))
        ax.set(**axes)
        if axes.get("xscale") == "log":  # minor labels (3x10^2, 4x10^2, ...) overprint
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        save(fig, name, axes["title"])

    if "ode_memory" in results:
        series("ode_memory", results["ode_memory"]["rows"], lambda r: (r["grad"], r["solver"]),
               lambda r: r["steps"], lambda r: r["peak_mb"], lambda k: f"{k[0]} ({k[1]})",
               xscale="log", xlabel="solver steps", ylabel="peak MB (one training step)",
               title="Memory vs steps per gradient mode")
    if "deltanet_kernels" in results:
        kernels = {"recurrent_ms": "recurrent (token loop)", "chunkwise_ms": "chunkwise",
                   "sdpa_ms": "causal SDPA"}
        rows = [{"T": r["T"], "kernel": k, "ms": r.get(k)}
                for r in results["deltanet_kernels"]["rows"] for k in kernels]
        series("deltanet_kernels", rows, lambda r: r["kernel"], lambda r: r["T"],
               lambda r: r["ms"], kernels.get, xscale="log", yscale="log", xlabel="T",
               ylabel="ms (forward + backward)", title="DeltaNet kernels, B=4 H=4 D=64")
    ctx = [r for r in results.values() if r.get("contexts")]
    if ctx:
        rows = [{"config": Path(r["config"]).stem, "context": c["context"], "loss": c.get("loss")}
                for r in ctx for c in r["contexts"]]
        series("cat_context", rows, lambda r: r["config"], lambda r: r["context"],
               lambda r: r["loss"], str, xscale="log", xlabel="evaluation context (chars)",
               xticks=sorted({r["context"] for r in rows}),
               xticklabels=[str(c) for c in sorted({r["context"] for r in rows})],
               ylabel="cross-entropy (nats/char)",
               title="CAT protocol: trained at 256, evaluated longer")
    ptb = [r for r in results.values() if r.get("config", "").startswith("configs/ptb/")
           and r.get("curve")]
    if ptb:
        rows = [{"run": (Path(r["config"]).stem, r["seed"]),
                 "tokens": s * _tokens_per_step(r) / 1e6, "ppl": math.exp(v)}
                for r in ptb if not r.get("tag") for s, v in r["curve"]["val"] if s > 0]
        series("ptb_val_curves", rows, lambda r: r["run"], lambda r: r["tokens"],
               lambda r: r["ppl"], lambda k: f"{k[0]}, seed {k[1]}", family=lambda k: k[0],
               yscale="log", xlabel="tokens seen (millions)",
               ylabel="val perplexity (in-training estimate)", title="PTB validation curves")
    std = [r for r in results.values() if r.get("config", "").startswith("configs/ptb_std/")
           and r.get("curve")]
    if std:
        # two panels, so that the full-budget runs and the quarter-budget dropout sweep never
        # share a label: one colour per model, line style by seed (left) or by dropout (right)
        fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.8), sharey=True)
        models = sorted({Path(r["config"]).stem for r in std})
        colors = dict(zip(models, plt.cm.tab10.colors))
        styles = ["-", "--", ":", "-."]
        for ax, sweep in ((axes[0], False), (axes[1], True)):
            runs = [r for r in std if (r.get("tag") or "").startswith("sweep_") == sweep]
            dropouts = sorted({float(run_setting(r, "model.dropout", 0.0)) for r in runs})
            seeds = sorted({r["seed"] for r in runs})
            for r in sorted(runs, key=lambda r: (Path(r["config"]).stem, r.get("tag") or "",
                                                 r["seed"])):
                model, dropout = Path(r["config"]).stem, float(run_setting(r, "model.dropout", 0.0))
                pts = [(s * _tokens_per_step(r) / 1e6, math.exp(v))
                       for s, v in r["curve"]["val"] if s > 0]
                variant = not sweep and bool(r.get("tag"))  # a full-budget run with --set
                if sweep:  # line style by dropout rate
                    ls, label = styles[dropouts.index(dropout) % 4], f"{model}, dropout {dropout:g}"
                    label += f", seed {r['seed']}" if len(seeds) > 1 else ""
                elif variant:
                    ls, label = "-.", f"{model}, dropout {dropout:g}, seed {r['seed']}"
                else:  # headline runs: line style by seed
                    ls, label = styles[seeds.index(r["seed"]) % 3], \
                        f"{model}, headline (dropout {dropout:g}), seed {r['seed']}"
                ax.plot(*zip(*pts), color=colors[model], ls=ls, marker="x" if variant else "o",
                        ms=3.5, lw=1.3, alpha=0.55 if variant else 1.0, label=label)
            ax.set(yscale="log", xlabel="tokens seen (millions)",
                   title="quarter budget: dropout sweep" if sweep
                   else "full budget (about 12 M tokens)")
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_yticks([100, 120, 150, 200, 300])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.15),
                      frameon=False, ncol=2)
        axes[0].set_ylabel("val perplexity (in-training estimate, 40 batches)")
        save(fig, "ptb_std_val_curves", "PTB, standard setup: validation curves",
             "PTB, standard setup: validation curves")
    if "depth_elasticity" in results:
        # one panel per evaluation solver, one colour per trained model; a model with a clamped
        # step-size range also drawn with the clamp lifted (dashed: its own points where they
        # differ, the clamped model's elsewhere, since inside the range the two are one model)
        rows = [r for r in results["depth_elasticity"]["rows"] if r.get("seed", 1337) == 1337]
        # the section's models (every other is on the ablations page), each with more than
        # one solve (a learning-rate check at one NFE is a point, not a curve)
        models = [m for m in dict.fromkeys(r["model"] for r in rows) if m in ANYTIME_SHOWN
                  and sum(r["model"] == m for r in rows) > 1]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, solver in zip(axes, ("euler", "rk4")):
            for i, model in enumerate(models):
                # tab10 repeats after ten models; tab20's pairs keep every model's own colour
                palette = plt.cm.tab10.colors if len(models) <= 10 else plt.cm.tab20.colors
                color = palette[i % len(palette)]
                own = {r["nfe"]: r["val_loss"] for r in rows
                       if r["model"] == model and r["solver"] == solver}
                lifted = {r["nfe"]: r["val_loss"] for r in rows
                          if r["model"] == f"{model}, unclamped" and r["solver"] == solver}
                if own:
                    ax.plot(*zip(*sorted(own.items())), marker="o", ms=3.5, color=color,
                            label=model)
                if lifted:
                    ax.plot(*zip(*sorted({**own, **lifted}.items())), marker="x", ms=5,
                            color=color, ls="--", label=f"{model}, clamp lifted")
            ax.set(xscale="log", xlabel="field evaluations per forward (NFE)",
                   title=f"evaluated with {solver}")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            nfes = sorted({r["nfe"] for r in rows if r["solver"] == solver})
            ax.set_xticks(nfes, [str(n) for n in nfes])
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("val loss (nats/char, 400 windows)")
        axes[0].set_ylim(top=min(2.6, axes[0].get_ylim()[1]))  # the one-step solves go far up
        axes[1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        save(fig, "depth_elasticity", "Anytime depth: one trained field, other solvers",
             "Anytime depth: loss against NFE, by the solver it is evaluated with")
    if "depth_exit" in results:
        # one colour per model, one line style per criterion, full depth as a star; the right
        # panel zooms on the region the target asks about (within 2% of each model's full depth)
        rows = results["depth_exit"]["rows"]
        models = list(dict.fromkeys(r["model"] for r in rows))
        fulls = {r["model"]: r for r in rows if r["criterion"] == "full"}
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for ax, zoom in zip(axes, (False, True)):
            for i, model in enumerate(models):
                color = plt.cm.tab10.colors[i % 10]
                full = fulls.get(model)
                for criterion, ls in (("state", "-"), ("kl", "--")):
                    pts = sorted((r["nfe_per_token"], r["val_loss"]) for r in rows
                                 if r["model"] == model and r["criterion"] == criterion)
                    if zoom and full:
                        pts = [p for p in pts if p[1] <= full["val_loss"] * 1.02]
                    if pts:
                        ax.plot(*zip(*pts), ls=ls, marker="o", ms=3.5, color=color,
                                label=f"{model}, exit on {criterion}")
                if full:
                    ax.plot([full["nfe_per_token"]], [full["val_loss"]], marker="*", ms=11,
                            color=color, ls="none", label=f"{model}, full depth")
            ax.set(xlabel="field evaluations per token (mean)", ylabel="val loss (nats/char, 400 windows)",
                   title="within 2% of each model's full depth" if zoom else "every threshold")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        save(fig, "depth_exit", "Per-token exit: loss vs mean depth",
             "Per-token exit: loss vs mean depth")
    return lines


if __name__ == "__main__":
    main()
