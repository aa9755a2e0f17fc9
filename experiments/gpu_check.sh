#!/usr/bin/env bash
# The project's checks on a CUDA machine, in one run (about 3 minutes on one H200):
#   bash experiments/gpu_check.sh OUT_DIR [PYTHON]
# 1. the CUDA tests (pytest -m cuda; Ray's needs Ray installed, NCCL's two GPUs of one type),
# 2. a profile of each zoo job on the CUDA devices: OUT_DIR/<gpu type>-zoo-<job>.jsonl
#    (experiments/data/profiles/ keeps them: see its README),
# 3. the profiler's benchmark (profiling cost, timing against torch.utils.benchmark.Timer):
#    OUT_DIR/bench_profiler_*.json.
# Each step's log is OUT_DIR/<step>.log; a failing step does not stop the others, and the
# script exits non-zero if any failed.
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=0
run() {  # name, command...
  local name=$1; shift
  echo "== $name"
  if "$@" > "$out/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?): $out/$name.log"; failed=1; fi
  tail -n 3 "$out/$name.log"
}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" || exit 2
gpu=$("$py" -c "from profilers.devices import cuda_device_types; print(cuda_device_types()[0].gpu_type)")
run cuda-tests "$py" -m pytest -m cuda -q -rA -p no:cacheprovider tests
for job in mlp resnet transformer; do
  run "profile-$job" "$py" -m cli profile --zoo "$job" --devices cuda --out "$out/$gpu-zoo-$job.jsonl" --no-progress
done
run bench-profiler "$py" -m experiments.bench_profiler --out-dir "$out"
exit $failed
