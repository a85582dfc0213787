#!/usr/bin/env bash
# The fused hyper-connection pre-mix (branch hcpre59) merged with main, in one device call of at
# most ~560 s: tools/gpu/run_hcpre59.sh (its kernel tests, the engine GPU suite with the switch on
# and =pdl, the decode step off / on / pdl and ncu of the on steps), then what that script does not
# run: the engine's whole GPU suite with the switch off (the default path: the Sinkhorn row kernel
# now calls kernels/cuda/sinkhorn_rows.cuh), the whole kernel GPU suite and the sampler workspace check.
# Here: cmake --build build --target pdserve_kernels_cuda_tests engine_gpu_tests gpu_decode_step_bench \
#         sampler_gpu_tests
#       tools/gpu/run_hcpre59.sh pack      # .device-carry/hcpre59.tar.xz (carry it)
# There: OUT=<dir> bash tools/gpu/run_hc60.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:-gpu-out/hc60}
mkdir -p "$out"
out=$(cd "$out" && pwd)
s=$SECONDS
OUT="$out/hcpre59" timeout -k 5 210 bash tools/gpu/run_hcpre59.sh > "$out/hcpre59.log" 2>&1
hc="rc=$? $((SECONDS - s)) s"
# The binaries run_hcpre59.sh used: its unpacked carry, else a BUILD tree (as it falls back).
if [ -f .device-carry/hcpre59/env.sh ]; then
  # shellcheck disable=SC1091
  source .device-carry/hcpre59/env.sh
elif [ -n "${BUILD:-}" ] && [ -x "$BUILD/tests/engine_gpu/engine_gpu_tests" ]; then
  export PATH=$BUILD/tests/kernels_cuda:$BUILD/tests/engine_gpu:$BUILD/bench/engine:$PATH
else
  echo "FAIL: no .device-carry/hcpre59/env.sh and no BUILD tree: the steps below cannot run"
fi
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
s=$SECONDS
PDSERVE_FUSED_HC_PRE=0 PDSERVE_SOURCE_DIR=$PWD timeout -k 5 120 engine_gpu_tests \
  > "$out/engine_off.log" 2>&1
engine="rc=$? $((SECONDS - s)) s $(passed "$out/engine_off.log")"
s=$SECONDS
timeout -k 5 200 pdserve_kernels_cuda_tests > "$out/kernels_all.log" 2>&1
kernels="rc=$? $((SECONDS - s)) s $(passed "$out/kernels_all.log")"
# The memory plan's sampler workspace formula against what CUB asks on this device (plan60).
s=$SECONDS
timeout -k 5 60 sampler_gpu_tests --gtest_filter='SamplerGpuTest.WorkspaceBytes*' \
  > "$out/sampler_plan.log" 2>&1
sampler="rc=$? $((SECONDS - s)) s $(passed "$out/sampler_plan.log")"
echo "run_hcpre59.sh: $hc"
echo "engine GPU suite, switch off: $engine"
grep -E "^\[  FAILED  \]|: Failure$" "$out/engine_off.log" | head -6
echo "kernel GPU suite: $kernels"
grep -E "^\[  FAILED  \]|: Failure$" "$out/kernels_all.log" | head -6
echo "sampler workspace vs the plan's formula: $sampler"
grep -E ": Failure$" -A3 "$out/sampler_plan.log" | head -6
echo
tail -45 "$out/hcpre59.log"
