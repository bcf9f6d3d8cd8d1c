#!/usr/bin/env bash
# Everything that needs a GPU, as steps that can be combined to fit a time-limited device command:
#
#   bash benchmarks/gpu_suite.sh tests           # GPU-marked tests (kernels, backends, graphs, overlap)
#   bash benchmarks/gpu_suite.sh kernels         # kernel micro-benchmarks (attention, the GEMM sweep)
#   bash benchmarks/gpu_suite.sh gemm            # the GEMM sweep alone: cuBLAS vs skinny-GEMM candidates
#   bash benchmarks/gpu_suite.sh profile         # where a decode step's time goes (diagnostic)
#   bash benchmarks/gpu_suite.sh decode offline  # decode-step table, offline table (+ plot)
#   bash benchmarks/gpu_suite.sh online          # online serving table with the platform ceiling (+ plots)
#   bash benchmarks/gpu_suite.sh ceiling         # the platform ceiling alone (no GPU used)
#   bash benchmarks/gpu_suite.sh offline8b online8b  # the same tables for the Qwen3-8B shape
#   bash benchmarks/gpu_suite.sh bench           # = decode offline online
#   bash benchmarks/gpu_suite.sh bench8b         # = offline8b online8b
#   bash benchmarks/gpu_suite.sh tests-tp2 offline-tp2 online-tp2  # tensor parallelism, 2 GPUs:
#       its GPU tests, the offline table at TP=1 and TP=2 (bounds of 1 and 2 GPUs), one online
#       level (concurrency 64) through tritonserver with TP=2 (issue 20)
#   bash benchmarks/gpu_suite.sh bench-tp2       # = offline-tp2 online-tp2
#
# Results go to $OUT (default /tmp/tritonllm-gpu): a BENCHMARKS.md with the new sections (copy
# them into the repository's), and results-<steps>-<time>.tar.gz with every log, JSON and plot
# (plots under benchmarks/plots/, where the sections' image links expect them), plus
# suite-summary.txt (step, exit status, seconds). The device tool brings back at most 8 files, so
# the packed originals are removed unless KEEP_FILES=1. On the offline GPU host of this project:
# `source .devpack/activate.sh` first, and point TRITONLLM_QWEN_TIKTOKEN at a carried copy of
# qwen.tiktoken (that host has no dashscope) so that the checkpoints can be built there.
#
# Time: every step is bounded by its own limit (STEP_TIMEOUT overrides them all) and by what is
# left of SUITE_SECONDS (default 570: under the device tool's 10-minute command, with time left to
# pack); a step with less than a minute left is skipped. A step is stopped with SIGINT, so that
# the benchmarks stop the servers they started, then SIGKILL 30 s later.
# ONLINE_ARGS, ONLINE8B_ARGS: extra flags of the online runs (default: none; 8B: 2 requests per
# client per level).
set -uo pipefail
cd "$(dirname "$0")/.."
usage() {
  echo "usage: $0 tests|kernels|gemm|profile|decode|offline|online|ceiling|offline8b|online8b|bench|bench8b|tests-tp2|offline-tp2|online-tp2|bench-tp2 ..." >&2
  exit 2
}
# Every step name is checked before anything is built or written.
[ $# -gt 0 ] || usage
for step in "$@"; do
  case "$step" in
  tests | kernels | gemm | profile | decode | offline | online | ceiling | offline8b | online8b | bench | bench8b) ;;
  tests-tp2 | offline-tp2 | online-tp2 | bench-tp2) ;;
  *) usage ;;
  esac
done
steps=()
for step in "$@"; do
  case "$step" in
  bench) steps+=(decode offline online) ;;
  bench8b) steps+=(offline8b online8b) ;;
  bench-tp2) steps+=(offline-tp2 online-tp2) ;;
  *) steps+=("$step") ;;
  esac
done
start=$(date +%s)
budget=${SUITE_SECONDS:-570}
out=${OUT:-/tmp/tritonllm-gpu}
case "$(realpath -m "$out")/" in
"$(pwd)/"*)
  echo "OUT ($out) must be outside the repository: the suite removes what it wrote there" >&2
  exit 2
  ;;
esac
mkdir -p "$out"
export PYTHONUNBUFFERED=1
md="$out/BENCHMARKS.md"
plots="$out/benchmarks/plots"
summary="$out/suite-summary.txt"
[ -f "$md" ] || cp BENCHMARKS.md "$md"
status=0
# What this run writes into $out besides BENCHMARKS.md and the summary: packed, then removed.
written=("$out/benchmarks" "$out/linear-sweep.json" "$out/profile" "$out/server.log"
  "$out/server-8b.log" "$out/ceiling-server.log" "$out/server-tp2.log")

# run STEP DEFAULT_LIMIT LOG COMMAND...: COMMAND under the step's time limit, output to LOG and
# the terminal; records the exit status (124/137: timed out) in the summary.
run() {
  local step=$1 limit=${STEP_TIMEOUT:-$2} log=$3
  shift 3
  written+=("$log")
  local left=$((budget - ($(date +%s) - start) - 20))
  if [ "$left" -lt 60 ]; then
    echo "--- $step: skipped, ${left}s left of SUITE_SECONDS=$budget" | tee -a "$summary"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local t0
  t0=$(date +%s)
  timeout -s INT -k 30 "$limit" "$@" 2>&1 | grep --line-buffered -v USDT | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "$step rc=$rc ${limit}s-limit $(($(date +%s) - t0))s" >>"$summary"
  status=$((status | (rc != 0)))
}

build() { # build SHAPE: the random-weight checkpoint models/SHAPE (skipped when complete)
  run "build-$1" 400 "$out/build.log" python3 -m tritonllm.build_model --shape "$1" --out "models/$1"
}

for step in "${steps[@]}"; do
  case "$step" in
  tests | profile | decode | offline | online | tests-tp2 | offline-tp2 | online-tp2)
    build qwen3-0.6b
    break
    ;;
  esac
done
for step in "${steps[@]}"; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case "$step" in
  tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu-tests.log"
    run tests 600 "$out/gpu-tests.log" python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/ >/dev/null
    tail -15 "$out/gpu-tests.log"
    ;;
  kernels)
    run attention 300 "$out/kernels.log" python3 -m kernels.bench_attention
    run gemm 300 "$out/gemm.log" python3 -m kernels.bench_linear --json "$out/linear-sweep.json"
    ;;
  gemm)
    run gemm 300 "$out/gemm.log" python3 -m kernels.bench_linear --json "$out/linear-sweep.json"
    ;;
  profile)
    run profile 600 "$out/profile.log" python3 -m benchmarks.profile_step --batch-sizes 1,64,256 --out "$out/profile"
    ;;
  decode)
    run decode 600 "$out/decode_step.log" python3 -m benchmarks.decode_step --benchmarks-md "$md" \
      --batch-sizes 1,64,256 --modes graph+overlap,eager
    ;;
  offline)
    run offline 600 "$out/offline.log" python3 -m benchmarks.offline --benchmarks-md "$md" \
      --model models/qwen3-0.6b --plots-dir "$plots"
    ;;
  online)
    # shellcheck disable=SC2086  # ONLINE_ARGS is a list of flags
    run online 600 "$out/online.log" python3 -m benchmarks.online --benchmarks-md "$md" \
      --model models/qwen3-0.6b --server-log "$out/server.log" --plots-dir "$plots" \
      --ceiling --ceiling-log "$out/ceiling-server.log" ${ONLINE_ARGS:-}
    ;;
  ceiling)
    run ceiling 240 "$out/ceiling.log" python3 -m benchmarks.ceiling --benchmarks-md "$md" \
      --ceiling-log "$out/ceiling-server.log"
    ;;
  tests-tp2)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu-tests-tp2.log"
    TRITONLLM_GPU_TEST_MODEL="$(pwd)/models/qwen3-0.6b" run tests-tp2 600 "$out/gpu-tests-tp2.log" \
      python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 tests/test_gpu_tp.py >/dev/null
    tail -15 "$out/gpu-tests-tp2.log"
    ;;
  offline-tp2)
    run offline-tp2 600 "$out/offline-tp2.log" python3 -m benchmarks.offline --benchmarks-md "$md" \
      --model models/qwen3-0.6b --hf-subset 0 --tensor-parallel-size 1,2 --plots-dir "$plots"
    ;;
  online-tp2)
    run online-tp2 600 "$out/online-tp2.log" python3 -m benchmarks.online --benchmarks-md "$md" \
      --model models/qwen3-0.6b --server-log "$out/server-tp2.log" --plots-dir "$plots" \
      --tensor-parallel-size 2 --concurrency 64
    ;;
  offline8b)
    build qwen3-8b
    run offline8b 420 "$out/offline-8b.log" python3 -m benchmarks.offline --benchmarks-md "$md" \
      --model models/qwen3-8b --hf-subset 0 --plots-dir "$plots"
    ;;
  online8b)
    build qwen3-8b
    # shellcheck disable=SC2086  # ONLINE8B_ARGS is a list of flags
    run online8b 600 "$out/online-8b.log" python3 -m benchmarks.online --benchmarks-md "$md" \
      --model models/qwen3-8b --server-log "$out/server-8b.log" --plots-dir "$plots" \
      ${ONLINE8B_ARGS:---prompts-per-client 2}
    ;;
  esac
done
echo "=== summary"
cat "$summary"
# One archive of everything this run left in $out (earlier archives excluded).
pack="results-$(
  IFS=-
  echo "${steps[*]}"
)-$(date -u +%H%M%S).tar.gz"
packed=()
declare -A seen=()
for path in "$out/BENCHMARKS.md" "$summary" "${written[@]}"; do
  [ -e "$path" ] && [ -z "${seen[$path]:-}" ] && packed+=("${path#"$out"/}")
  seen[$path]=1
done
tar czf "$out/$pack" -C "$out" "${packed[@]}" && ls -l "$out/$pack"
if [ "${KEEP_FILES:-0}" != 1 ]; then
  for path in "${written[@]}"; do rm -rf "$path"; done
fi
exit $status
