#!/usr/bin/env bash
# Every GPU check in one run (about 5 minutes on one modern GPU): the CUDA-marked tests, then
# bench/gpu_bench.py. Needs a Python with a CUDA build of torch and this package's dependencies;
# results go to $OUT (or bench/results/gpu): pytest-cuda.log, gpu_bench.json, nvidia-smi.txt.
# The training benchmark reads Tiny Shakespeare: set CONTINUUMLM_DATA to a folder holding
# tinyshakespeare.txt where ../shared/data is absent (the CUDA tests need no corpus).
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CONTINUUMLM_DATA=${CONTINUUMLM_DATA:-$PWD/../shared/data}
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
[ -f "$CONTINUUMLM_DATA/tinyshakespeare.txt" ] ||
  echo "warning: no tinyshakespeare.txt in $CONTINUUMLM_DATA: the training benchmark needs it" \
       "in the user cache or a download"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
# the cuda-marked tests (they skip themselves on machines without a GPU)
timeout 180 $PY -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-cuda.log"
tests=${PIPESTATUS[0]}
timeout 300 $PY bench/gpu_bench.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
echo "cuda tests exit $tests, benchmark exit $bench"
exit $(( tests || bench ))
