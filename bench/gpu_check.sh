#!/usr/bin/env bash
# Every GPU check in one run (under 8 minutes on one modern GPU: 100 s of tests, a 360 s bench): the CUDA-marked tests, then
# bench/gpu_bench.py (each of its sections in a child process with its own time budget).
# Results go to $OUT (or bench/results/gpu): gpu_bench.json, gpu_bench.log, pytest-cuda.log,
# nvidia-smi.txt; run folders stay in a temporary folder, so the check can be run again.
#
#   bash bench/gpu_check.sh --prepare   # here: copy tinyshakespeare.txt into .gpu_data/
#   bash bench/gpu_check.sh             # on the GPU machine (carry .gpu_data along)
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh   # the same plumbing on the CPU at toy size
#
# The training rows read Tiny Shakespeare from $CONTINUUMLM_DATA, else from .gpu_data/ in the
# repository (ignored by git), else ../shared/data; without it they are recorded as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ "${1:-}" = "--prepare" ]; then
  src=${CONTINUUMLM_DATA:-../shared/data}/tinyshakespeare.txt
  [ -f "$src" ] || { echo "no $src: set CONTINUUMLM_DATA to the folder holding it" >&2; exit 2; }
  mkdir -p .gpu_data && cp "$src" .gpu_data/ && echo "copied $src to .gpu_data/"
  exit 0
fi
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for d in "${CONTINUUMLM_DATA:-}" "$PWD/.gpu_data" "$PWD/../shared/data"; do
  if [ -n "$d" ] && [ -f "$d/tinyshakespeare.txt" ]; then export CONTINUUMLM_DATA=$d; break; fi
done
[ -f "${CONTINUUMLM_DATA:-/nonexistent}/tinyshakespeare.txt" ] ||
  echo "warning: no tinyshakespeare.txt found: the training rows will be skipped" \
       "(run 'bash bench/gpu_check.sh --prepare' first and carry .gpu_data)"
if [ -n "${GPU_CHECK_DRY:-}" ]; then
  dry=--dry
  tests_limit=120
else
  dry=
  tests_limit=100
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
  $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
fi
# the cuda-marked tests (they skip themselves on machines without a GPU); -k after the limit
timeout -k 10 $tests_limit $PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 |
  tee "$OUT/pytest-cuda.log"
tests=${PIPESTATUS[0]}
# a backstop only: gpu_bench keeps its own deadline (360 s on a GPU; GPU_CHECK_BUDGET_SCALE
# scales it) and, stopped by this timeout, stops its running section and marks what it skipped
timeout -k 30 $(( 420 * ${GPU_CHECK_BUDGET_SCALE:-1} )) $PY bench/gpu_bench.py --out "$OUT" $dry 2>&1 |
  tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "cuda tests exit $tests, benchmark exit $bench"
# pytest exits 5 when every cuda test was deselected or skipped (the dry run on a CPU)
[ -n "$dry" ] && [ "$tests" = 5 ] && tests=0
exit $(( tests || bench ))
