"""Gradients of adaptive solves: the backsolve adjoint (torchdiffeq's default norm and the
seminorm), the accepted steps replayed (ode_grad = "checkpoint") and direct backpropagation,
for Tsit5 and Dormand-Prince 5(4): field evaluations forward and backward, peak memory, time,
and each gradient's distance from a reference.

    python bench/adaptive_grads.py      # writes bench/results/adaptive_grads.json

The field is the trained ode_rk4 checkpoint (runs/bench/shakespeare_char-ode_rk4_seed1337,
one sequential block) integrated with the adaptive solver at rtol 1e-4, atol 1e-6, on a batch
of 8 validation windows of 64 characters; without that run, the same model untrained (said in
the JSON). The reference gradient is direct backpropagation through Dormand-Prince 8 at rtol
1e-9 (float64). Each row runs in a fresh process (peak RSS growth during one forward and
backward, as bench/ode_memory.py measures it).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import RUNS, OtherLoad, finished_run, markdown_table, rss_now_kb, write_json

RUN = RUNS / "shakespeare_char-ode_rk4_seed1337"
ROWS = [(s, g, n) for s in ("tsit5", "dopri5")
        for g, n in (("direct", "default"), ("checkpoint", "default"), ("adjoint", "default"),
                     ("adjoint", "seminorm"))]


def _model(solver: str, grad: str, norm: str, rtol: float, atol: float, dtype):
    import dataclasses

    import torch

    from continuumlm import LanguageModel, ModelConfig

    if finished_run(RUN):
        from continuumlm.runs import load_model_and_tokenizer

        model, _, _ = load_model_and_tokenizer(RUN, "last")
        cfg = model.config
    else:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=65, hidden_size=128, num_heads=4, num_layers=1,
                          max_seq_len=64, position="learned", depth="ode")
        model = LanguageModel(cfg)
    new = dataclasses.replace(cfg, ode_solver=solver, ode_grad=grad, ode_adjoint_norm=norm,
                              ode_rtol=rtol, ode_atol=atol, dropout=0.0)
    fresh = LanguageModel(new)
    fresh.load_state_dict(model.state_dict())
    return fresh.to(dtype).train()


def _batch():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 65, (8, 65), generator=g)


def child(solver: str, grad: str, norm: str, out: str) -> None:
    import torch

    dtype = torch.float64
    model = _model(solver, grad, norm, 1e-4, 1e-6, dtype)
    data = _batch()
    x, y = data[:, :-1], data[:, 1:]
    _, loss = model(x[:1, :2], y[:1, :2])  # warm-up
    loss.backward()
    model.zero_grad(set_to_none=True)
    before = rss_now_kb()
    t0 = time.perf_counter()
    _, loss = model(x, y)
    nfe = model.last_nfe
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.save(grads, out)
    print(json.dumps({"nfe": nfe, "backward_nfe": model.last_backward_nfe,
                      "peak_mb": (peak - before) / 1024, "seconds": seconds}))


def reference(out: str) -> None:
    import torch

    model = _model("dopri8", "direct", "default", 1e-9, 1e-11, torch.float64)
    data = _batch()
    _, loss = model(data[:, :-1], data[:, 1:])
    loss.backward()
    torch.save(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]),
               out)


def main() -> None:
    import tempfile

    import torch

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref.pt"
        subprocess.run([sys.executable, __file__, "--reference", str(ref)], check=True, env=env)
        g_ref = torch.load(ref)
        rows = []
        for solver, grad, norm in ROWS:
            path = Path(tmp) / "g.pt"
            with OtherLoad() as others:
                r = subprocess.run([sys.executable, __file__, "--child", solver, grad, norm,
                                    str(path)], check=True, capture_output=True, text=True,
                                   env=env)
            row = {"solver": solver, "grad": grad, "adjoint_norm": norm if grad == "adjoint"
                   else "", **json.loads(r.stdout.strip().splitlines()[-1]),
                   "other_cores": others.cores}
            g = torch.load(path)
            row["grad_rel_error"] = ((g - g_ref).norm() / g_ref.norm()).item()
            rows.append(row)
            print(row, flush=True)
    table = markdown_table(rows, [("solver", "solver"), ("grad", "ode_grad"),
                                  ("adjoint_norm", "adjoint norm"), ("nfe", "forward NFE"),
                                  ("backward_nfe", "backward NFE"), ("peak_mb", "peak MB"),
                                  ("seconds", "s / step"),
                                  ("grad_rel_error", "gradient error vs reference"),
                                  ("other_cores", "other cores busy")])
    print(table)
    write_json("adaptive_grads", {
        "command": "python bench/adaptive_grads.py",
        "setup": ("the trained ode_rk4 field" if finished_run(RUN) else "an untrained field")
        + " integrated by an adaptive solver at rtol 1e-4, atol 1e-6, float64, batch 8 x 64; "
          "gradient error relative to direct backprop through dopri8 at rtol 1e-9; one "
          "training step per fresh process",
        "rows": rows, "table": table})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--reference":
        reference(sys.argv[2])
    else:
        main()
