#!/usr/bin/env bash
# Everything that needs a GPU, as steps that can be combined to fit a time-limited device command:
#
#   bash benchmarks/gpu_suite.sh tests           # GPU-marked tests (kernels, backends, graphs, overlap)
#   bash benchmarks/gpu_suite.sh kernels         # kernel micro-benchmarks (attention, linear)
#   bash benchmarks/gpu_suite.sh profile         # where a decode step's time goes (diagnostic)
#   bash benchmarks/gpu_suite.sh decode offline  # decode-step table, offline table
#   bash benchmarks/gpu_suite.sh online          # online serving table
#   bash benchmarks/gpu_suite.sh bench           # = decode offline online
#
# Logs (at most 8 files, the device tool's limit), and a BENCHMARKS.md with the new sections, go to $OUT (default /tmp/tritonllm-gpu); copy
# the sections into the repository's BENCHMARKS.md. On the offline GPU host of this project:
# `source .devpack/activate.sh` first, and point TRITONLLM_QWEN_TIKTOKEN at a carried copy of
# qwen.tiktoken (that host has no dashscope) so the qwen3-0.6b checkpoint can be built there.
# STEP_TIMEOUT (seconds, default 600) bounds each step, so one slow step cannot eat the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() {
  echo "usage: $0 tests|kernels|profile|decode|offline|online|bench ..." >&2
  exit 2
}
# Every step name is checked before anything is built or written.
[ $# -gt 0 ] || usage
for step in "$@"; do
  case "$step" in
  tests | kernels | profile | decode | offline | online | bench) ;;
  *) usage ;;
  esac
done
steps=()
for step in "$@"; do
  if [ "$step" = bench ]; then steps+=(decode offline online); else steps+=("$step"); fi
done
out=${OUT:-/tmp/tritonllm-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
limit=${STEP_TIMEOUT:-600}
md="$out/BENCHMARKS.md"
[ -f "$md" ] || cp BENCHMARKS.md "$md"
python3 -m tritonllm.build_model --shape qwen3-0.6b --out models/qwen3-0.6b >/tmp/build.log 2>&1 || {
  cat /tmp/build.log
  exit 1
}
status=0
for step in "${steps[@]}"; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case "$step" in
  tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu-tests.log"
    timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/ \
      >>"$out/gpu-tests.log" 2>&1
    status=$((status | $?))
    tail -15 "$out/gpu-tests.log"
    ;;
  kernels)
    timeout "$limit" python3 -m kernels.bench_attention 2>&1 | tee "$out/kernels.log"
    timeout "$limit" python3 -m kernels.bench_linear 2>&1 | tee -a "$out/kernels.log"
    ;;
  profile)
    timeout "$limit" python3 -m benchmarks.profile_step --batch-sizes 1,64,256 --out "$out/profile" 2>&1 |
      grep -v USDT | tee "$out/profile.log"
    ;;
  decode)
    timeout "$limit" python3 -m benchmarks.decode_step --benchmarks-md "$md" \
      --batch-sizes 1,64,256 --modes graph+overlap,eager 2>&1 | tee "$out/decode_step.log"
    ;;
  offline)
    timeout "$limit" python3 -m benchmarks.offline --benchmarks-md "$md" 2>&1 | tee "$out/offline.log"
    ;;
  online)
    timeout "$limit" python3 -m benchmarks.online --benchmarks-md "$md" \
      --server-log "$out/server.log" 2>&1 | tee "$out/online.log"
    ;;
  esac
done
exit $status
