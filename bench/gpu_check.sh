#!/usr/bin/env bash
# Every GPU check in one command that ends inside 8 minutes whatever happens (465 s): the
# environment, the CUDA-marked tests (at most 45 s), then bench/gpu_bench.py (280 s, most
# valuable first: decoding with graph replay, DeltaNet's kernels against SDPA by GPU time, the
# GPT-2-small target rows, training tokens/s and MFU), each of its sections in a child process
# with its own budget, then the fla-marked CUDA tests (at most 45 s). Every row records the
# commit it measured ($GPU_CHECK_COMMIT when the tree has no git metadata:
# `GPU_CHECK_COMMIT=$(git rev-parse HEAD)` where it came from).
# Results go to $OUT (or bench/results/gpu/<device>, e.g. nvidia-h200: each kind of GPU adds
# its own record, and the results page shows one section per device), four files: env.txt,
# pytest-cuda.log, gpu_bench.json, gpu_bench.log; run folders stay in a temporary folder, so the check can be
# run again.
#
#   bash bench/gpu_check.sh --prepare   # here, with the package index: .gpu_data/ (the corpus)
#                                       # and .gpu_wheels/ (the fla-core wheel)
#   bash bench/gpu_check.sh             # on the GPU machine; carry .gpu_data and .gpu_wheels
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh   # the same plumbing on the CPU at toy size
#   bash bench/gpu_check.sh --plan      # the time limits it would use, and nothing else
#   bash bench/gpu_check.sh --resume    # on the GPU machine again: keeps the rows that
#       bench/results/gpu/<device>/gpu_bench.json (or $GPU_CHECK_RESUME_FROM) holds as done and measures
#       the rest; GPU_CHECK_SECTIONS (their order), GPU_CHECK_DEADLINE (s, the whole bench's,
#       in place of 280 x scale; the sections' budgets still scale), GPU_CHECK_TESTS_LIMIT
#       and GPU_CHECK_FLA_TESTS_LIMIT (s) fit it to the device time left
#
# It runs from src/ on PYTHONPATH with the machine's own packages: a GPU machine without network
# cannot `pip install -e .` (no setuptools>=77 there, and the dev extra needs lm-eval). The
# carried fla-core wheel (pure Python and Triton) is installed offline into a temporary folder
# (pip --no-index --no-deps --target), so the fla rows run; without it they are recorded as
# unavailable. The training rows read Tiny Shakespeare from $CONTINUUMLM_DATA, else .gpu_data/,
# else ../shared/data; without it they are recorded as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
FLA_CORE=0.6.0
TESTS_LIMIT=${GPU_CHECK_TESTS_LIMIT:-45}   # s, CUDA-marked tests but the fla ones
FLA_TESTS_LIMIT=${GPU_CHECK_FLA_TESTS_LIMIT:-45}  # s, the fla-marked ones, after the benchmark
BENCH_DEADLINE=280  # s, gpu_bench.py's own deadline (its DEADLINE)
resume=
if [ "${1:-}" = "--resume" ]; then resume=--resume; shift; fi
if [ "${1:-}" = "--prepare" ]; then
  src=${CONTINUUMLM_DATA:-../shared/data}/tinyshakespeare.txt
  [ -f "$src" ] || { echo "no $src: set CONTINUUMLM_DATA to the folder holding it" >&2; exit 2; }
  mkdir -p .gpu_data && cp "$src" .gpu_data/ && echo "copied $src to .gpu_data/"
  $PY -m pip download --quiet --no-deps --dest .gpu_wheels "fla-core==$FLA_CORE" ||
    { echo "could not download fla-core $FLA_CORE into .gpu_wheels/ (the fla rows will be" \
           "recorded as unavailable)" >&2; exit 1; }
  echo "fla-core wheel in .gpu_wheels/: carry .gpu_data and .gpu_wheels to the GPU machine"
  exit 0
fi
scale=${GPU_CHECK_BUDGET_SCALE:-1}
# the backstop around the benchmark (its own deadline, scaled, plus time to stop a section and
# mark its rows); a fractional scale is fine, anything else is refused
backstop=$($PY -c "import sys; s = float(sys.argv[1]); assert s > 0; print(round(($BENCH_DEADLINE + 30) * s))" "$scale" 2>/dev/null) ||
  { echo "GPU_CHECK_BUDGET_SCALE=$scale is not a positive number (e.g. 1 or 1.5)" >&2; exit 2; }
deadline_arg=()
if [ -n "${GPU_CHECK_DEADLINE:-}" ]; then
  backstop=$($PY -c "import sys; d = float(sys.argv[1]); assert d > 0; print(round(d + 30))" "$GPU_CHECK_DEADLINE" 2>/dev/null) ||
    { echo "GPU_CHECK_DEADLINE=$GPU_CHECK_DEADLINE is not a positive number of seconds" >&2; exit 2; }
  deadline_arg=(--deadline "$GPU_CHECK_DEADLINE")
fi
[[ "$TESTS_LIMIT" =~ ^[0-9]+$ ]] && [ "$TESTS_LIMIT" -gt 15 ] ||
  { echo "GPU_CHECK_TESTS_LIMIT=$TESTS_LIMIT is not a whole number of seconds above 15" >&2; exit 2; }
[[ "$FLA_TESTS_LIMIT" =~ ^[0-9]+$ ]] && [ "$FLA_TESTS_LIMIT" -gt 15 ] ||
  { echo "GPU_CHECK_FLA_TESTS_LIMIT=$FLA_TESTS_LIMIT is not a whole number of seconds above 15" >&2; exit 2; }
sections_arg=()
if [ -n "${GPU_CHECK_SECTIONS+set}" ]; then  # checked here, before any device time is spent
  read -r -a names <<< "$GPU_CHECK_SECTIONS"
  [ "${#names[@]}" -gt 0 ] || { echo "GPU_CHECK_SECTIONS is empty: name sections (gpt2 kernels training decoding)" >&2; exit 2; }
  for n in "${names[@]}"; do
    case "$n" in gpt2|kernels|training|decoding) ;; *)
      echo "GPU_CHECK_SECTIONS: '$n' is not a section; give some of: gpt2 kernels training decoding, separated by spaces" >&2; exit 2;;
    esac
  done
  sections_arg=(--sections "${names[@]}")
fi
# + kill graces, + environment and install
worst=$(( TESTS_LIMIT + 10 + backstop + 15 + FLA_TESTS_LIMIT + 10 + 30 ))
if [ "${1:-}" = "--plan" ]; then
  echo "tests ${TESTS_LIMIT} s, benchmark ${backstop} s at most (scale $scale), fla tests ${FLA_TESTS_LIMIT} s, whole command ${worst} s at most"
  exit 0
fi
if [ -z "${OUT:-}" ]; then  # a folder per device (gpu_page.device_folder names it the same way)
  if [ -n "${GPU_CHECK_DRY:-}" ]; then
    device=cpu-dry-run
  else
    device=$($PY -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))" 2>/dev/null) || device=unknown-gpu
  fi
  OUT=bench/results/gpu/$device
fi
mkdir -p "$OUT"
if [ -n "$resume" ]; then
  from=${GPU_CHECK_RESUME_FROM:-$OUT/gpu_bench.json}
  [ -f "$from" ] || { echo "--resume: no $from to resume (set GPU_CHECK_RESUME_FROM)" >&2; exit 2; }
  [ "$(realpath "$from")" = "$(realpath -m "$OUT/gpu_bench.json")" ] || cp "$from" "$OUT/gpu_bench.json"
fi
WORK=$(mktemp -d)
# whatever ends this script (its own end, a signal, the device's time limit), nothing it started
# keeps the GPU: every child process is stopped, and gpu_bench.py's sections die with it
cleanup() {
  if pkill -TERM -P $$ 2>/dev/null; then sleep 3; pkill -KILL -P $$ 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for d in "${CONTINUUMLM_DATA:-}" "$PWD/.gpu_data" "$PWD/../shared/data"; do
  if [ -n "$d" ] && [ -f "$d/tinyshakespeare.txt" ]; then export CONTINUUMLM_DATA=$d; break; fi
done
[ -f "${CONTINUUMLM_DATA:-/nonexistent}/tinyshakespeare.txt" ] ||
  echo "warning: no tinyshakespeare.txt found: the training rows will be skipped" \
       "(run 'bash bench/gpu_check.sh --prepare' first and carry .gpu_data)"
wheel=$(ls .gpu_wheels/fla_core-*.whl 2>/dev/null | head -n 1)
if [ -n "$wheel" ]; then
  if $PY -m pip install --quiet --no-index --no-deps --target "$WORK/site" "$wheel"; then
    export PYTHONPATH=$PYTHONPATH:$WORK/site
  else
    echo "warning: could not install $wheel offline: the fla rows will be recorded as unavailable"
  fi
else
  echo "note: no fla-core wheel in .gpu_wheels/ (bash bench/gpu_check.sh --prepare): the fla" \
       "rows will be recorded as unavailable"
fi
{
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S') UTC, bash bench/gpu_check.sh${GPU_CHECK_DRY:+ (GPU_CHECK_DRY=1)}"
  echo "# limits: tests ${TESTS_LIMIT} s, benchmark ${backstop} s (scale $scale), whole command ${worst} s at most"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  $PY - <<'EOF' 2>&1
import importlib
import platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "torchdiffeq", "fla"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:  # noqa: BLE001
        print(name, "unavailable:", type(e).__name__, str(e)[:200])
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
from continuumlm.mixers.deltanet import fla_status
print("fla for DeltaNet:", fla_status())
EOF
} > "$OUT/env.txt"
if [ -n "${GPU_CHECK_DRY:-}" ]; then
  dry=--dry
else
  dry=
  $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
fi
# the cuda-marked tests (they skip themselves on machines without a GPU), each named as it
# ends (-vv: pyproject adds -q); at the limit pytest gets SIGABRT, on which its faulthandler
# prints where it was (collection included), and SIGKILL 10 s later; a test still running 5 s
# before the limit dumps its stack from a thread too (faulthandler_timeout), in case SIGABRT
# is caught by something else. Those marked fla (fla's first call autotunes its Triton
# kernels for over a minute) run after the benchmark, whose kernels section has compiled them
# by then, within their own limit.
cuda_tests() {  # $1: marker expression, $2: limit (s)
  timeout -s ABRT -k 10 "$2" $PY -m pytest -vv -m "$1" -p no:cacheprovider \
    -o faulthandler_timeout=$(( $2 - 5 )) tests 2>&1 | tee -a "$OUT/pytest-cuda.log"
  return "${PIPESTATUS[0]}"
}
: > "$OUT/pytest-cuda.log"
cuda_tests "cuda and not fla" "$TESTS_LIMIT"
tests=$?
# a backstop only: gpu_bench keeps its own deadline and, stopped by this timeout, stops its
# running section and marks what it skipped
timeout -k 15 "$backstop" $PY bench/gpu_bench.py --out "$OUT" --budget-scale "$scale" $dry $resume \
  "${deadline_arg[@]}" "${sections_arg[@]}" 2>&1 |
  tee "$OUT/gpu_bench.log"
bench=${PIPESTATUS[0]}
cuda_tests "cuda and fla" "$FLA_TESTS_LIMIT"
fla_tests=$?
echo "cuda tests exit $tests, benchmark exit $bench, fla tests exit $fla_tests"
# pytest exits 5 when every cuda test was deselected or skipped (the dry run on a CPU)
[ -n "$dry" ] && [ "$tests" = 5 ] && tests=0
[ -n "$dry" ] && [ "$fla_tests" = 5 ] && fla_tests=0
exit $(( tests || bench || fla_tests ))
