"""Per-token adaptive depth: val loss against mean field evaluations per token as the exit
threshold tau varies, for both exit criteria, and the cached-decoding speed it gives.

    python bench/depth_exit.py      # writes bench/results/depth_exit.json

Uses the checkpoints that bench/train_seeds.py left in runs/bench/ (seed 1337): ode_rk4 (one
shared block, trained at RK4 x 4, NFE 16) and, where trained, ode_elastic and
ode_elastic_consistency (trained across solvers and step counts, the latter with the
shortcut-consistency term) and ode_rk4_readout (ode_rk4 trained with the read-out of every
intermediate step supervised, train.regularize.step_readout_weight = 0.5;
ode_rk4_readout_light: 0.1) and the distilled elastic recipe (ode_elastic_dial_capped-cw1.0-kd1.0-lr2e-3, saved with RK4 x 4).
Each is evaluated at its trained solver with `continuumlm eval
--exit-threshold TAU --exit-criterion C` on 400 evenly spread validation windows of 64
characters. Rows already in the JSON are kept, so a model whose run folder is gone keeps its
recorded figures.

Decoding: greedy cached generation of one 64-character window (8 prompt characters, 56 new),
batch 1, eager, tokens per second at full depth and at the tau of each criterion with the
fewest evaluations whose val loss is within 0.5% of full depth's, timed in 5 rounds that take
every setting in turn (median round); the greedy text is compared with full depth's.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, RUNS, OtherLoad, finished_run, markdown_table, write_json

CLI = str(Path(sys.executable).parent / "continuumlm")
MODELS = ["ode_rk4", "ode_elastic", "ode_elastic_consistency", "ode_rk4_readout",
          "ode_rk4_readout_light",
          # the elastic recipe at lr 2e-3 distilled from ode_euler (bench/lr_sweep.py), good at
          # every uniform step count: does that carry over to per-token exits?
          "ode_elastic_dial_capped-cw1.0-kd1.0-lr2e-3"]
# spanning what the criteria measure on ode_rk4 (10-90% of tokens: a relative change of 0.35-0.85
# per step, a KL of 0.005-2.8 between successive read-outs)
TAUS = {"state": (0.05, 0.1, 0.2, 0.3, 0.4, 0.45, 0.5, 0.6),
        "kl": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 5e-2, 0.1)}
LOSS_SLACK = 0.005  # "at <= 0.5% higher val loss than full depth"


def evaluate(run: Path, tau: float | None, criterion: str) -> dict:
    extra = [] if tau is None else ["--exit-threshold", repr(tau), "--exit-criterion", criterion]
    out = subprocess.run([CLI, "eval", "--checkpoint", str(run), "--which", "last",
                          "--max-windows", "400", "--json", *extra],
                         check=True, capture_output=True, text=True)
    r = json.loads(out.stdout)
    row = r["results"][0]
    return {"val_loss": row["loss"], "nfe_per_token": row.get("nfe_per_token", r["nfe"])}


def decode_speeds(run: Path, picks: list[tuple[str, float | None]], rounds: int = 5) -> list:
    """Greedy cached decoding at each (criterion, tau) of ``picks`` (tau None: full depth),
    timed in ``rounds`` rounds that go through every setting in turn, so that other work
    slows them alike; tokens/s from the median round of each."""
    from continuumlm.runs import load_model_and_tokenizer

    model, tok, _ = load_model_and_tokenizer(run, "last")
    prompt = torch.tensor([tok.encode("ROMEO:\nO")])
    new = model.config.max_seq_len - prompt.shape[1]
    times = {k: [] for k in picks}
    # through the decoding pass, as the exits decode (the lean step, plain decoding's default
    # at batch 1 on a CPU, refuses per-token exit): the settings compared on one path
    from continuumlm.decoding import Decoder

    decoder = Decoder(model, lean=False)
    outs, totals = {}, {}
    with OtherLoad() as others:
        for r in range(rounds + 1):  # the first round warms up, untimed
            for criterion, tau in picks:
                model.set_exit(tau, criterion if tau is not None else "state")
                t = time.perf_counter()
                outs[(criterion, tau)] = decoder.generate(prompt, new, greedy=True)
                if r:
                    times[(criterion, tau)].append(time.perf_counter() - t)
                totals[(criterion, tau)] = model.depth.exit_totals if tau is not None else None
    result = []
    for key in picks:
        done = totals[key]
        result.append({"tokens_per_s": new / statistics.median(times[key]), "new_tokens": new,
                       "nfe_per_token": done[0] / done[1] if done and done[1] else None,
                       "text": tok.decode(outs[key][0].tolist()),
                       # cores other work kept busy meanwhile (the speeds are understated
                       # above 0.2; the ratios hold, the settings having shared the load)
                       "other_cores": others.cores})
    return result


def main() -> None:
    path = RESULTS / "depth_exit.json"
    old = json.loads(path.read_text()) if path.is_file() else {"rows": [], "decoding": []}
    have = {(r["model"], r["criterion"], r["tau"]): r for r in old["rows"]}
    rows, decoding = [], {(d["model"], d["criterion"], d["tau"]): d for d in old["decoding"]}
    for model in MODELS:
        run = RUNS / f"shakespeare_char-{model}_seed1337"
        trained = finished_run(run)
        if not trained and not any(k[0] == model for k in have):
            print(f"{model}: not trained (bench/train_seeds.py "
                  f"configs/shakespeare_char/{model}.toml --seeds 1337)", file=sys.stderr)
            continue
        for criterion, taus in [("full", (None,))] + list(TAUS.items()):
            for tau in taus:
                key = (model, criterion, tau)
                if key in have or not trained:
                    if key in have:
                        rows.append(have[key])
                    continue
                rows.append({"model": model, "criterion": criterion, "tau": tau,
                             **evaluate(run, tau, criterion)})
                print(rows[-1], flush=True)
        full = next((r for r in rows if r["model"] == model and r["criterion"] == "full"), None)
        if full is None or not trained:
            continue
        picks = [("full", None)]
        for criterion in TAUS:
            ok = [r for r in rows if r["model"] == model and r["criterion"] == criterion
                  and r["val_loss"] <= full["val_loss"] * (1 + LOSS_SLACK)]
            if ok:
                picks.append((criterion, min(ok, key=lambda r: r["nfe_per_token"])["tau"]))
        if any((model, c, t) not in decoding for c, t in picks):
            for (criterion, tau), speed in zip(picks, decode_speeds(run, picks)):
                decoding[(model, criterion, tau)] = {"model": model, "criterion": criterion,
                                                     "tau": tau, **speed}
                print(decoding[(model, criterion, tau)], flush=True)
    if not rows:
        sys.exit("no trained model in runs/bench/ and nothing recorded: run bench/train_seeds.py "
                 "on configs/shakespeare_char/ode_rk4.toml first; nothing was written.")
    fulls = {r["model"]: r for r in rows if r["criterion"] == "full"}
    table_rows = []
    for r in rows:
        f = fulls.get(r["model"])
        table_rows.append({
            "model": r["model"], "criterion": r["criterion"],
            "tau": "-" if r["tau"] is None else f"{r['tau']:g}",
            "nfe": f"{r['nfe_per_token']:.2f}", "loss": f"{r['val_loss']:.4f}",
            "saving": f"{f['nfe_per_token'] / r['nfe_per_token']:.2f}x" if f else "",
            "rise": f"{100 * (r['val_loss'] / f['val_loss'] - 1):+.2f}%" if f else ""})
    table = markdown_table(table_rows, [
        ("model", "model"), ("criterion", "exit criterion"), ("tau", "tau"),
        ("nfe", "field evals / token"), ("saving", "fewer evals"), ("loss", "val loss"),
        ("rise", "loss vs full")])
    dec = list(decoding.values())
    dec_rows = []
    for d in dec:
        base = decoding.get((d["model"], "full", None))
        dec_rows.append({
            "model": d["model"], "criterion": d["criterion"],
            "tau": "-" if d["tau"] is None else f"{d['tau']:g}",
            "nfe": "" if d["nfe_per_token"] is None else f"{d['nfe_per_token']:.2f}",
            "tps": f"{d['tokens_per_s']:.0f}",
            "speedup": f"{d['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "",
            "same": "yes" if base and d["text"] == base["text"] else "no"})
    dec_table = markdown_table(dec_rows, [
        ("model", "model"), ("criterion", "exit criterion"), ("tau", "tau"),
        ("nfe", "field evals / token"), ("tps", "tokens/s"), ("speedup", "vs full depth"),
        ("same", "same greedy text")])
    print(table)
    print(dec_table)
    write_json("depth_exit", {
        "command": "python bench/depth_exit.py",
        "setup": "per-token exit in each ODE block after every solver step (criterion below "
                 "tau); val loss on 400 validation windows of 64 characters; decoding: greedy, "
                 "cached, eager, batch 1, 56 new characters, median of 5",
        "rows": rows, "decoding": dec, "table": table, "decoding_table": dec_table})


if __name__ == "__main__":
    main()
