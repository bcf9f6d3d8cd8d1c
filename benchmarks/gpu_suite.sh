#!/usr/bin/env bash
# Everything that needs a GPU, in two steps that each fit a 10-minute device command:
#
#   bash benchmarks/gpu_suite.sh tests   # GPU-marked tests (kernels, backends, CUDA graphs, overlap)
#   bash benchmarks/gpu_suite.sh bench   # decode-step, offline and online benchmarks
#
# Logs and a BENCHMARKS.md with the new sections go to $OUT (default /tmp/tritonllm-gpu); copy
# the sections into the repository's BENCHMARKS.md. On the offline GPU host of this project:
# `source .devpack/activate.sh` first, and point TRITONLLM_QWEN_TIKTOKEN at a carried copy of
# qwen.tiktoken (that host has no dashscope) so the qwen3-0.6b checkpoint can be built there.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/tritonllm-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m tritonllm.build_model --shape qwen3-0.6b --out models/qwen3-0.6b >"$out/build.log" 2>&1 || {
  cat "$out/build.log"
  exit 1
}
case "${1:-}" in
tests)
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu-tests.log"
  ;;
bench)
  md="$out/BENCHMARKS.md"
  cp BENCHMARKS.md "$md"
  python3 -m benchmarks.decode_step --benchmarks-md "$md" 2>&1 | tee "$out/decode_step.log"
  python3 -m benchmarks.offline --benchmarks-md "$md" 2>&1 | tee "$out/offline.log"
  python3 -m benchmarks.online --benchmarks-md "$md" --server-log "$out/server.log" \
    --max-output-len 512 2>&1 | tee "$out/online.log"
  ;;
*)
  echo "usage: $0 tests|bench" >&2
  exit 2
  ;;
esac
