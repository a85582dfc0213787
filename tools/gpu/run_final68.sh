#!/usr/bin/env bash
# The routed experts' down projection reusing the gate+up grouping (MoeMmaGrouping::kReuse) and
# the grouped o_a without a grouping kernel (kIdentity), in the engine (issue 25), one device call
# (<= ~420 s): the grouped-expert, W8A16, FP8, attention and top-k kernel GPU tests, the engine GPU
# suite, then tools/gpu/run_step67.sh (one real-format V4-Flash layer's decode step, this build
# against the build before, NAME / BASE as there).
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests engine_gpu_tests gpu_decode_step_bench
#   tools/gpu/run_final68.sh pack      # .device-carry/final68.tar.xz (the two test binaries)
#   (and the step packs as run_step67.sh's header says)
# There (carry final68 and the step packs): OUT=<dir> NAME=<pack> BASE=<pack> bash tools/gpu/run_final68.sh
# (SKIP_STEP=1: the tests alone, carrying final68 only; STEP_ONLY=1: the step alone, carrying the
# step packs only: the three packs with the tree passed the device tool's 64 MiB on 2026-12-06.)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry final68 build/tests/kernels_cuda/pdserve_kernels_cuda_tests \
    build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
out=${OUT:-gpu-out/final68}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=200
if [ -z "${STEP_ONLY:-}" ]; then
(
  unpack .device-carry/final68
  s=$(date +%s)
  timeout -k 5 "$(cap 90)" pdserve_kernels_cuda_tests \
    --gtest_filter='*Moe*:*W8a16*:*Fp8Gemm*:CudaSparseDecode*:CudaTopK*' > "$out/tests.log" 2>&1
  echo "| kernel tests | rc=$? | $(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ') |"
  grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10
  s=$(date +%s)
  PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(cap 100)" engine_gpu_tests > "$out/engine.log" 2>&1
  echo "| engine tests | rc=$? | $(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/engine.log" | tr '\n' ' ') |"
  grep -E '^\[  FAILED  \]' "$out/engine.log" | head -10
) > "$out/tests.md"
rm -rf .device-carry/final68
fi
if [ -z "${SKIP_STEP:-}" ]; then
  OUT="$out/step" BUDGET=${STEP_BUDGET:-230} bash tools/gpu/run_step67.sh
fi
cat "$out/tests.md" 2> /dev/null
