#!/usr/bin/env bash
# Zoology's MQAR learning-rate sweep (bench/mqar_sweep.py's rates 1e-4, 4.6e-4, 2.2e-3, 1e-2;
# each config's own rate, 3e-3, is already recorded) for the rows below 99% recall, every rate
# of every row at once on one GPU, sized to finish: each row's example set is built once
# (bench/mqar_calibrate.py prepare), every rate of every row then runs side by side for a
# PROBE of 45 s to measure the step time, and each row's step limit, warm-up and evaluation
# interval are set from it (bench/mqar_calibrate.py calibrate: the config's schedule
# compressed, never longer than the config's) so that its runs end, stopped early at the
# config's recall or at that limit, inside BUDGET seconds (default 300). With the probe and
# the records after it, the whole script stays inside one 600 s device command. Then every
# rate's run is recorded, complete or as far as it got (bench/mqar_runs.py --snapshot), and
# each row summarized (bench/mqar_sweep.py --snapshot). The records (each names the GPU and
# the autocast precision it trained in: bf16 on CUDA, as train.dtype = "auto" does, and its
# calibrated --set values) and the logs (calibration.json among them) are packed into
# $OUT/gpu_mqar.tar.gz (default OUT: bench/results/gpu_mqar; one file, as the device tool
# returns few): `tar -xzf gpu_mqar.tar.gz`, copy results/*.json into bench/results/ and
# logs/calibration.json to bench/results/gpu/mqar_calibration.json (it names the GPU and the
# command; README's MQAR finding says from it how long the configs' whole schedules take
# there), run bench/render.py.
# The run folders (runs/gpu_mqar/, emptied first) stay on that machine: a rate cut short by the
# budget is recorded unfinished, not resumed.
#
#   bash bench/gpu_mqar_sweep.sh                 # on the GPU machine
#   GPU_MQAR_DRY=1 bash bench/gpu_mqar_sweep.sh  # the same plumbing on the CPU at toy size
#   GPU_MQAR_DRY=1 GPU_MQAR_DRY_STEPS=100000 GPU_MQAR_DRY_BUDGET=40 ...  # runs cut by the budget
#   ROWS="softmax_kv64" BUDGET=300 bash bench/gpu_mqar_sweep.sh   # fewer rows, less time
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench/results/gpu_mqar}
BUDGET=${BUDGET:-300}
PROBE=${PROBE:-45}  # s, before BUDGET: the step time measured with every rate running
ROWS=${ROWS:-softmax_kv64 ode_deltanet_kv64 ode_deltanet_kv64_mixed}
LRS="0.0001 0.00046 0.0022 0.01"  # as mqar_sweep.py tags them: lr{rate:g}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
# run folders inside the repository (runs/ is ignored by git), so the recorded commands name
# them relative to it, as every result file does
rm -rf runs/gpu_mqar
export CONTINUUMLM_RESULTS_DIR=$WORK/results CONTINUUMLM_RUNS_DIR=$PWD/runs/gpu_mqar
# every rate of a row trains on the same seeded example set: built once, memory-mapped by all
export CONTINUUMLM_MQAR_CACHE=$WORK/examples
mkdir -p "$CONTINUUMLM_RESULTS_DIR" "$CONTINUUMLM_RUNS_DIR" "$WORK/logs" "$WORK/probe" "$WORK/probe_results" "$OUT"
# whatever happens after this (a kill included), what was recorded comes back
trap 'tar -czf "$OUT/gpu_mqar.tar.gz" -C "$WORK" results logs; ls -l "$OUT"' EXIT
configs=configs/mqar
if [ -n "${GPU_MQAR_DRY:-}" ]; then
  # toy copies of the configs (inside the repository, as records name their config relative
  # to it; runs/ is ignored by git): a few steps on short sequences
  configs=runs/gpu_mqar_dry/configs
  mkdir -p "$configs"
  for name in $ROWS; do
    $PY - "configs/mqar/$name.toml" "$configs/$name.toml" "${GPU_MQAR_DRY_STEPS:-4}" <<'EOF' || exit 1
import sys
from continuumlm.config import dump_toml, load_config
sets = [f"train.max_steps={sys.argv[3]}", "train.eval_interval=2", "train.warmup_steps=1",
        "train.batch_size=4", "mqar.train_examples=32", "mqar.test_examples=16",
        "mqar.seq_len=32", "mqar.num_kv_pairs=4", "model.max_seq_len=32", "model.hidden_size=32"]
if load_config(sys.argv[1]).mqar.train_kv_pairs:  # a mixed row: pair counts that fit 32
    sets.append("mqar.train_kv_pairs=[2, 4]")
cfg = load_config(sys.argv[1], sets)
open(sys.argv[2], "w").write(dump_toml(cfg))
EOF
  done
  BUDGET=${GPU_MQAR_DRY_BUDGET:-120}
  PROBE=${GPU_MQAR_DRY_PROBE:-60}  # twelve processes importing torch on a few cores
else
  nvidia-smi > "$WORK/logs/nvidia-smi.txt" 2>&1 || true
  $PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
fi
# the config's own rate was recorded on the CPU: the summaries compare it too
for name in $ROWS; do cp "bench/results/mqar-$name.json" "$CONTINUUMLM_RESULTS_DIR/"; done
# 1. each row's example set, built once before anything is timed (the runs memory-map it)
pids=()
for name in $ROWS; do
  $PY bench/mqar_calibrate.py prepare "$configs/$name.toml" > "$WORK/logs/prepare-$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { tail -n 5 "$WORK"/logs/prepare-*.log; exit 1; }; done
# 2. the probe: every rate of every row side by side, as the sweep will run them, for PROBE
# seconds (logging every 5 steps, evaluating and saving every 50 to time that too), in run
# folders of its own
for name in $ROWS; do
  for lr in $LRS; do
    CONTINUUMLM_RUNS_DIR=$WORK/probe CONTINUUMLM_RESULTS_DIR=$WORK/probe_results \
      timeout -k 10 "$PROBE" $PY bench/mqar_runs.py "$configs/$name.toml" --set "train.lr=$lr" \
      --set train.max_steps=1000000 --set train.eval_interval=50 \
      --set train.log_interval=5 --tag "probe-lr$lr" > "$WORK/logs/probe-$name-lr$lr.log" 2>&1 &
  done
done
wait
# 3. each row's step limit, warm-up and evaluation interval from the measured step time, so
# its runs finish the config's schedule (compressed) inside BUDGET
cfgs=()
for name in $ROWS; do cfgs+=("$configs/$name.toml"); done
$PY bench/mqar_calibrate.py calibrate --probe-runs "$WORK/probe" --probe-seconds "$PROBE" \
  --probe-results "$WORK/probe_results" \
  --budget "$BUDGET" --out "$WORK/logs/calibration.json" "${cfgs[@]}" \
  > "$WORK/logs/calibration.txt" 2> "$WORK/logs/calibration.err" ||
  { cat "$WORK/logs/calibration.err"; exit 1; }
cat "$WORK/logs/calibration.err" "$WORK/logs/calibration.txt"
# 4. the sweep: every rate of every row that fits, side by side, each to its calibrated end
while read -r name sets; do
  extra=()
  for s in $sets; do extra+=(--set "$s"); done
  for lr in $LRS; do
    # timeout signals the whole process group: the trainer saves at the step it is in
    timeout -k 30 "$BUDGET" $PY bench/mqar_runs.py "$configs/$name.toml" \
      --set "train.lr=$lr" "${extra[@]}" --tag "lr$lr" \
      < /dev/null > "$WORK/logs/mqar-$name-lr$lr.log" 2>&1 &
  done
done < "$WORK/logs/calibration.txt"
wait
# the rows that ran are recorded side by side (each row's rates one after another, with the
# row's calibrated --set values, so a run cut short is read with the settings it trained with)
pids=()
while read -r name sets; do
  extra=()
  for s in $sets; do extra+=(--extra-set "$s"); done
  $PY bench/mqar_sweep.py --snapshot "${extra[@]}" "$configs/$name.toml" \
    < /dev/null > "$WORK/logs/summary-$name.log" 2>&1 &
  pids+=($!)
done < "$WORK/logs/calibration.txt"
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
tail -n 3 "$WORK"/logs/summary-*.log
exit $status
