#!/usr/bin/env bash
# The continuous-depth benchmarks of docs/results.md, one after another (they compete for cores
# if run together). Skips training runs whose JSON exists; re-run to resume after interruption.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-../.venv/bin/python}
$PY ode_cost.py
$PY ode_memory.py
for cfg in transformer_baby ode_rk4 ode_euler ode_parallel ode_attention; do
  seeds="1337"
  [ "$cfg" = transformer_baby ] && seeds="1337 1 2"
  $PY train_seeds.py ../configs/shakespeare_char/$cfg.toml --seeds $seeds
done
$PY render.py
