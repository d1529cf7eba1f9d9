"""Which part of the backsolve adjoint's state limits its step size: the reason the seminorm
adjoint does or does not save backward evaluations.

    python bench/adjoint_norm_parts.py      # writes bench/results/adjoint_norm_parts.json

torchdiffeq's backsolve adjoint integrates an augmented state backward in time: the time
gradient, the state y (solved again, backward), its adjoint a_y and the parameter adjoints.
Its step-size controller accepts a step when the norm of the error over that whole state, each
element scaled by its tolerance, is at most 1; the default norm is the largest of the parts'
norms, and the seminorm (Kidger et al. 2021) leaves the parameter adjoints out. The seminorm can
only save steps where the parameter adjoints hold the largest scaled error.

For each trained ODE checkpoint (seed 1337: ode_tsit5, ode_tsit5_rnode, when trained) and the
same model untrained, one training step (float32, dropout off) on 16 validation windows of
64 characters, with dopri5 and the backsolve adjoint at rtol 1e-3, atol 1e-4 (the setting of
bench/seminorm_run.py), under each norm. Every evaluation of the backward error norm is
recorded: the norm of each part, and which part is the largest. To see the parts, the script
wraps the norm torchdiffeq installs for the backward pass (``handle_adjoint_norm_`` in
torchdiffeq._impl.adjoint, read in torchdiffeq 0.2.5); the wrapper returns that norm's own
value, so the solve is unchanged (the backward NFE equal those of an unwrapped run: checked
below for every row).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys

from adaptive_solvers import CONTEXT, WINDOWS
from adaptive_solvers import _windows as windows  # the same 16 validation windows of 64
from common import RUNS, finished_run, markdown_table, write_json

MODELS = ["ode_tsit5", "ode_tsit5_rnode"]
PARTS = ("time", "state", "state adjoint", "parameter adjoints")
RTOL, ATOL = 1e-3, 1e-4


class PartsRecorder:
    """Wraps torchdiffeq's backward-norm installer so that every backward error norm also
    records the norm of each part of the augmented state."""

    def __init__(self):
        self.calls: list[dict[str, float]] = []

    def __enter__(self):
        from torchdiffeq._impl import adjoint as A
        from torchdiffeq._impl.misc import _mixed_norm

        self._module, self._original = A, A.handle_adjoint_norm_
        recorder = self

        def install(adjoint_options, shapes, state_norm):
            recorder._original(adjoint_options, shapes, state_norm)
            inner = adjoint_options["norm"]
            if shapes is not None:  # a tuple state: not this model's (one tensor per block)
                raise RuntimeError("adjoint_norm_parts.py expects a single-tensor ODE state")

            def norm(tensor_tuple):
                t, y, adj_y, *adj_params = tensor_tuple
                value = inner(tensor_tuple)
                recorder.calls.append({
                    "time": float(t.abs()), "state": float(state_norm(y)),
                    "state adjoint": float(state_norm(adj_y)),
                    "parameter adjoints": float(_mixed_norm(adj_params)) if adj_params else 0.0,
                    "value": float(value)})  # the norm the controller used
                return value

            adjoint_options["norm"] = norm

        A.handle_adjoint_norm_ = install
        return self

    def __exit__(self, *exc):
        self._module.handle_adjoint_norm_ = self._original
        return False


def _models():
    """(name, model) for each trained checkpoint, and the first one's config untrained."""
    import torch

    from continuumlm import LanguageModel
    from continuumlm.runs import load_model_and_tokenizer

    found = []
    for name in MODELS:
        run = RUNS / f"shakespeare_char-{name}_seed1337"
        if finished_run(run):
            model, _, _ = load_model_and_tokenizer(run, "last")
            found.append((name, model, run))
    if not found:
        sys.exit("no trained ode_tsit5 checkpoint under runs/bench/: train one first with "
                 "python bench/train_seeds.py configs/shakespeare_char/ode_tsit5.toml "
                 "--seeds 1337")
    torch.manual_seed(1337)
    found.append((f"{found[0][0]} (untrained)", LanguageModel(found[0][1].config), found[0][2]))
    return found


def step(model, norm: str, x, y, record: bool) -> tuple[int, int, list[dict]]:
    """Forward and backward NFE of one training step under ``norm``, and the recorded parts."""
    from continuumlm import LanguageModel

    cfg = dataclasses.replace(model.config, ode_solver="dopri5", ode_grad="adjoint",
                              ode_adjoint_norm=norm, ode_rtol=RTOL, ode_atol=ATOL, dropout=0.0)
    fresh = LanguageModel(cfg)
    fresh.load_state_dict(model.state_dict())
    fresh.train()
    with PartsRecorder() if record else contextlib.nullcontext() as rec:
        _, loss = fresh(x, y)
        loss.backward()
    return fresh.last_nfe, fresh.last_backward_nfe, rec.calls if record else []


def summarize(calls: list[dict]) -> dict:
    """How often each part is the largest, and each part's median norm."""
    import statistics

    largest = collections.Counter(max(PARTS, key=c.__getitem__) for c in calls)
    return {"norm_calls": len(calls),
            "largest": {p: largest.get(p, 0) for p in PARTS},
            "median": {p: statistics.median(c[p] for c in calls) for p in PARTS}}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    rows = []
    for name, model, run in _models():
        x, y = windows(run)
        for norm in ("default", "seminorm"):
            nfe, bnfe, calls = step(model, norm, x, y, record=True)
            _, bnfe_plain, _ = step(model, norm, x, y, record=False)
            if bnfe_plain != bnfe:
                sys.exit(f"{name}, {norm}: the recording changed the backward solve "
                         f"({bnfe} evaluations recorded, {bnfe_plain} without the recorder)")
            rows.append({"model": name, "norm": norm, "nfe": nfe, "backward_nfe": bnfe,
                         **summarize(calls)})
            print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["largest_cell"] = ", ".join(f"{p} {r['largest'][p]}" for p in PARTS if r["largest"][p])
        r["median_cell"] = ", ".join(f"{p} {r['median'][p]:.2g}" for p in PARTS[1:])
    table = markdown_table(rows, [("model", "trained as"), ("norm", "adjoint norm"),
                                  ("nfe", "forward NFE"), ("backward_nfe", "backward NFE"),
                                  ("norm_calls", "backward error norms"),
                                  ("largest_cell", "largest part (count)"),
                                  ("median_cell", "median scaled error per part")])
    for r in rows:
        del r["largest_cell"], r["median_cell"]
    print(table)
    write_json("adjoint_norm_parts", {
        "command": "python bench/adjoint_norm_parts.py",
        "setup": f"one training step, dopri5 with the backsolve adjoint at rtol {RTOL:g}, atol "
                 f"{ATOL:g}, float32, {WINDOWS} validation windows of {CONTEXT} characters; every "
                 "evaluation of the backward error norm (tolerance-scaled error) split by part",
        "rows": rows, "table": table})


if __name__ == "__main__":
    main()
