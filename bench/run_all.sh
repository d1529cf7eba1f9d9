#!/usr/bin/env bash
# Every benchmark behind docs/results.md, one after another (run together they compete for the
# cores and distort each other's timings). Training runs whose JSON exists are skipped, so an
# interrupted sweep resumes where it stopped; delete a JSON to redo that run.
#   bash bench/run_all.sh            # all of it (about 45 minutes on 2 CPU cores)
#   bash bench/run_all.sh micro      # only the kernel/solver benchmarks (about 10 minutes)
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../.venv/bin/python}
export CONTINUUMLM_DATA=${CONTINUUMLM_DATA:-$(cd ../.. && pwd)/shared/data}
$PY ode_cost.py
$PY ode_memory.py
$PY deltanet_kernels.py
$PY mixer_step.py
$PY decode_speed.py
if [ "${1:-all}" = all ]; then
  $PY train_seeds.py ../configs/shakespeare_char/transformer_baby.toml --seeds 1337 1 2
  for cfg in ode_euler ode_rk4 deltanet deltanet_conv cat_fourier ode_parallel ode_attention cat_cheb; do
    $PY train_seeds.py ../configs/shakespeare_char/$cfg.toml --seeds 1337
  done
fi
$PY render.py
