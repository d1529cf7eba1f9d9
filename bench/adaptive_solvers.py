"""Adaptive solvers on trained fields: Tsit5 against Dormand-Prince 5(4) (and Bogacki-Shampine
3(2), Dormand-Prince 8) at equal tolerance and at equal error.

    python bench/adaptive_solvers.py      # writes bench/results/adaptive_solvers.json

Each trained ODE checkpoint in runs/bench/ (seed 1337: ode_rk4, and ode_tsit5 and
ode_tsit5_rnode when trained; the elastic models read a fixed step size, which an adaptive
solver does not have) is integrated, without retraining, by each adaptive method at
rtol 1e-2 ... 1e-6 (atol = rtol / 10) in float64, on 16 evenly spread validation windows of 64
characters, batch 16. Error: the relative L2 distance of the logits from a reference solve
(Dormand-Prince 8 at rtol 1e-10, atol 1e-12); NFE: field evaluations of the block's solve
(rejected steps included). "NFE at error <= e" is the fewest evaluations among the tolerances
whose error is at most e. A model without a finished run folder keeps the rows recorded for
it earlier. The adaptive controller takes one error norm over the whole batch, so these solves
are not exactly causal (that is why training uses fixed grids by default).
"""

from __future__ import annotations

import dataclasses
import json
import sys

from common import RESULTS, RUNS, finished_run, markdown_table, say_untrained, write_json

MODELS = ["ode_rk4", "ode_tsit5", "ode_tsit5_rnode"]
SOLVERS = ["tsit5", "dopri5", "bosh3", "dopri8"]
RTOLS = [1e-2, 1e-3, 1e-4, 1e-5, 1e-6]
ERRORS = [1e-3, 1e-5]
WINDOWS, CONTEXT = 16, 64


def _windows(run):
    import numpy as np
    import torch

    from continuumlm.data import prepare_data
    from continuumlm.runs.checkpoint import load_run_config, resolve_checkpoint

    cfg = load_run_config(resolve_checkpoint(run, "last"))
    tokens = np.asarray(prepare_data(cfg.data).splits["val"])
    starts = np.linspace(0, len(tokens) - CONTEXT - 2, WINDOWS).astype(int)
    data = torch.tensor(np.stack([tokens[s:s + CONTEXT + 1] for s in starts]), dtype=torch.long)
    return data[:, :-1], data[:, 1:]


def _solve(model, solver: str, rtol: float, atol: float, x, y):
    """Logits, loss and NFE of the trained weights integrated by ``solver`` at (rtol, atol)."""
    import torch

    from continuumlm import LanguageModel

    cfg = dataclasses.replace(model.config, ode_solver=solver, ode_grad="direct",
                              ode_rtol=rtol, ode_atol=atol, dropout=0.0)
    fresh = LanguageModel(cfg)
    fresh.load_state_dict(model.state_dict())
    fresh = fresh.double().eval()
    with torch.no_grad():
        logits, loss = fresh(x, y)
    return logits, loss.item(), fresh.last_nfe


def main() -> None:
    import logging

    from continuumlm.runs import load_model_and_tokenizer

    logging.getLogger("continuumlm").setLevel(logging.ERROR)
    rows, missing = [], []
    for name in MODELS:
        run = RUNS / f"shakespeare_char-{name}_seed1337"
        if not finished_run(run):
            missing.append(name)
            continue
        model, _, _ = load_model_and_tokenizer(run, "last")
        x, y = _windows(run)
        ref, ref_loss, ref_nfe = _solve(model, "dopri8", 1e-10, 1e-12, x, y)
        for solver in SOLVERS:
            for rtol in RTOLS:
                logits, loss, nfe = _solve(model, solver, rtol, rtol / 10, x, y)
                err = ((logits - ref).norm() / ref.norm()).item()
                rows.append({"model": name, "solver": solver, "rtol": rtol, "nfe": nfe,
                             "error": err, "val_loss": loss, "reference_loss": ref_loss,
                             "reference_nfe": ref_nfe})
                print(rows[-1], flush=True)
    old = RESULTS / "adaptive_solvers.json"
    rows, missing = keep_recorded(rows, missing,
                                  json.loads(old.read_text())["rows"] if old.exists() else [])
    say_untrained(missing)
    if not rows:
        sys.exit("no trained ODE checkpoint in runs/bench/: run `continuumlm experiment "
                 "shakespeare` first; nothing was written.")
    table = markdown_table(summary(rows), [
        ("model", "trained as"), ("solver", "solver"),
        *[(f"nfe{r:g}", f"NFE at rtol {r:g}") for r in (1e-3, 1e-5)],
        *[(f"err{r:g}", f"error at rtol {r:g}") for r in (1e-3, 1e-5)],
        *[(f"at{e:g}", f"NFE at error <= {e:g}") for e in ERRORS]])
    print(table)
    write_json("adaptive_solvers", {
        "command": "python bench/adaptive_solvers.py",
        "setup": f"trained fields integrated by each adaptive method at rtol {RTOLS} (atol = "
                 f"rtol / 10), float64, {WINDOWS} validation windows of {CONTEXT} characters; "
                 "error = relative L2 distance of the logits from dopri8 at rtol 1e-10",
        "rows": rows, "missing": missing, "table": table})


def keep_recorded(rows: list[dict], missing: list[str],
                  recorded: list[dict]) -> tuple[list[dict], list[str]]:
    """A model without a finished run folder (gone, or being trained again) keeps its recorded
    rows (from the previous JSON); the rows in MODELS order, and the models still without any."""
    kept = [r for r in recorded if r["model"] in missing]
    if kept:
        print(f"kept from the previous record: the rows of "
              f"{', '.join(dict.fromkeys(r['model'] for r in kept))}", file=sys.stderr)
    rows = sorted(kept + rows, key=lambda r: MODELS.index(r["model"]))
    return rows, [m for m in missing if m not in {r["model"] for r in kept}]


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for solver in SOLVERS:
            mine = [r for r in rows if r["model"] == model and r["solver"] == solver]
            if not mine:
                continue
            at = {r["rtol"]: r for r in mine}
            row = {"model": model, "solver": solver}
            for rtol in (1e-3, 1e-5):
                row[f"nfe{rtol:g}"] = at[rtol]["nfe"] if rtol in at else ""
                row[f"err{rtol:g}"] = f"{at[rtol]['error']:.1e}" if rtol in at else ""
            for e in ERRORS:
                ok = [r["nfe"] for r in mine if r["error"] <= e]
                row[f"at{e:g}"] = min(ok) if ok else f"> {max(r['nfe'] for r in mine)}"
            out.append(row)
    return out


if __name__ == "__main__":
    main()
