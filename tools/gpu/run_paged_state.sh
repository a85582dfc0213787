#!/usr/bin/env bash
# Issue 26's paged GPU state and paranoid page ownership on one H200, one device call:
#   1. (STEPS with "kernels"; off by default because tools/gpu/run_gpu_tests.sh builds and runs
#      every kernel test, the paged cases included) kernels/cuda built there and the GPU tests of
#      the kernels that read or write paged entries run (KFILTER).
#   2. The packed engine_gpu_tests: the paged-state tests (Models/PagedStateTest.*: paged ==
#      slot layout bit for bit, 64 concurrent with page reuse == slot layout and == alone, short
#      pool, foreign page) and the runner's paranoid test, then every other engine GPU test.
#   3. The packed paged_state_bench: the capacity table (V4-Flash shapes, 8K / 32K / 128K
#      requests on one H200, slot layout vs paged), the plan vs engine pool bytes, and TPOT p50 /
#      p90 on models/kjv-v4-wide at batch 1 / 16 / 64 / 128, slot layout vs paged.
# Pack here (after building engine_gpu_tests, sampler_gpu_tests and paged_state_bench):
#   tools/gpu/pack_engine_tests.sh build .device-carry/gpu
#   tools/gpu/pack_binaries.sh .device-carry/paged build/bench/paged/paged_state_bench
# there, from the repository root (models/kjv-v4-wide and the fixtures in place):
#   OUT=$OUT tools/gpu/run_paged_state.sh
# Environment: PACK (.device-carry/gpu), BINS (.device-carry/paged), OUT (gpu-out/paged), STEPS
# ("paged engine bench"; add "kernels" for step 1), KFILTER. Logs under $OUT; a short table is
# printed last. Expected: about 1-2 min for "paged" + "bench", plus the other engine tests' time
# for "engine" (their own run_gpu_tests.sh budget, up to 500 s), plus ~3 min for "kernels".
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out/paged}
pack=${PACK:-.device-carry/gpu}
bins=${BINS:-.device-carry/paged}
steps=${STEPS:-paged engine bench}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

if [[ " $steps " == *" kernels "* ]]; then
  SKIP_KERNELS=0 OUT=$out/kernels PACK=/nonexistent \
    KFILTER=${KFILTER:-Compressor|SinkAttention|IndexerGeneric|Indexer|SparseDecode|LaunchCheck} \
    timeout 420 tools/gpu/run_gpu_tests.sh > "$out/kernels.txt" 2>&1
  row "kernel GPU tests (paged cases)" "$([ $? = 0 ] && grep -q '100% tests passed' "$out/kernels/kernels.log" && echo PASS || echo FAIL)" \
    "$(grep -E 'tests passed' "$out/kernels/kernels.log" 2>/dev/null | head -1) ($(elapsed))"
fi

if [ -f "$pack/libs.tar.xz" ]; then
  mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
  cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  chmod +x "$pack/bin/engine_gpu_tests"
  engine() {  # log name, gtest filter, seconds
    LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-} PDSERVE_SOURCE_DIR=$PWD \
      timeout "$3" "$pack/bin/engine_gpu_tests" --gtest_filter="$2" > "$out/$1.log" 2>&1
    local rc=$?
    row "engine GPU tests: $1" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")" \
      "$(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$out/$1.log" | tr '\n' ' ') $(grep -E '^paged:' "$out/$1.log" | tr '\n' ' ')($(elapsed))"
    grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/$1.log" | head -20 >&2
  }
  if [[ " $steps " == *" paged "* ]]; then
    engine paged "Models/PagedStateTest.*:*Paranoid*" 400
  fi
  if [[ " $steps " == *" engine "* ]]; then
    engine others "-Models/PagedStateTest.*:*Paranoid*" 500
  fi
else
  row "engine GPU tests" "SKIPPED" "no $pack/libs.tar.xz (tools/gpu/pack_engine_tests.sh)"
fi

if [[ " $steps " == *" bench "* ]]; then
  if [ -f "$bins/env.sh" ]; then
    # shellcheck disable=SC1091
    source "$bins/env.sh"
    timeout 400 paged_state_bench --flash-config tests/fixtures/v4_configs/flash \
      --model models/kjv-v4-wide --batches 1,16,64,128 --prompt 512 --steps 64 \
      > "$out/bench.md" 2> "$out/bench.err"
    row "paged_state_bench" "$([ $? = 0 ] && echo PASS || echo FAIL)" "tables below ($(elapsed))"
  else
    row "paged_state_bench" "SKIPPED" "no $bins/env.sh (tools/gpu/pack_binaries.sh)"
  fi
fi

echo
[ -f "$out/bench.md" ] && cat "$out/bench.md"
echo
echo "| step | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
