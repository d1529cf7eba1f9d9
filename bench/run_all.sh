#!/usr/bin/env bash
# Every benchmark behind docs/results.md, one after another (run together they compete for the
# cores and distort each other's timings). Training runs whose JSON exists are skipped, so an
# interrupted sweep resumes where it stopped; delete a JSON to redo that run.
#   bash bench/run_all.sh            # everything (about 2 hours on 2 CPU cores)
#   bash bench/run_all.sh micro      # kernel, solver, memory and decoding benchmarks (~10 min)
#   bash bench/run_all.sh train      # the training runs and what is measured on them
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../.venv/bin/python}
export CONTINUUMLM_DATA=${CONTINUUMLM_DATA:-$(cd ../.. && pwd)/shared/data}
stage=${1:-all}
if [ "$stage" = all ] || [ "$stage" = micro ]; then
  $PY ode_cost.py
  $PY ode_memory.py
  $PY deltanet_kernels.py
  $PY mixer_step.py
  $PY decode_speed.py
fi
if [ "$stage" = all ] || [ "$stage" = train ]; then
  S=../configs/shakespeare_char
  $PY train_seeds.py $S/transformer_baby.toml --seeds 1337 1 2
  for cfg in ode_rk4 deltanet cat_fourier ode_euler deltanet_conv ode_parallel ode_attention cat_cheb; do
    $PY train_seeds.py $S/$cfg.toml --seeds 1337
  done
  $PY depth_elasticity.py
  for cfg in softmax_rope softmax_nope cat_fourier; do
    $PY train_seeds.py ../configs/cat_protocol/$cfg.toml --seeds 1337 --contexts 128,512,1024,5000
  done
  for cfg in transformer ode_rk4; do
    $PY train_seeds.py ../configs/ptb/$cfg.toml --seeds 42
  done
fi
$PY render.py
