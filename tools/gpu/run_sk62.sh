#!/usr/bin/env bash
# The Sinkhorn projection's new default (kAuto = the one-entry-per-lane kernel at n = 2 and 4,
# kernels/cuda/sinkhorn.cu) in the engine, in one short device call (<= ~200 s): the Sinkhorn,
# hyper-connection and RMSNorm kernel tests, the engine's whole GPU suite on the default path
# (logits against the CPU engine, graph == eager, PD pages; PDSERVE_SOURCE_DIR=$PWD) and the whole
# kernel GPU suite while time is left; the table last. (The kernels' times: run_ipc60.sh.)
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests engine_gpu_tests gpu_decode_step_bench sampler_gpu_tests
#   tools/gpu/run_hcpre59.sh pack          # .device-carry/hcpre59.tar.xz (the same binaries)
#   tools/gpu/device_tree.sh tests         # (restore afterwards)
# There (carry .device-carry/hcpre59.tar.xz): OUT=<dir> [BUDGET=s] bash tools/gpu/run_sk62.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:-gpu-out/sk62}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
tar -xJf .device-carry/hcpre59.tar.xz -C .device-carry ||
  { echo "FAIL: no .device-carry/hcpre59.tar.xz (run 'tools/gpu/run_hcpre59.sh pack' here)"; exit 2; }
# shellcheck disable=SC1091
source .device-carry/hcpre59/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
# Seconds a step may take: at most $1, and what is left of BUDGET (default 190) s since the start.
budget() {
  local left=$((${BUDGET:-190} - (SECONDS - start)))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
declare -A result
s=$SECONDS
timeout -k 5 "$(budget 40)" pdserve_kernels_cuda_tests \
  --gtest_filter='CudaSinkhorn*:*HyperConnection*:*RmsNorm*' > "$out/kernels_hc.log" 2>&1
result[hc]="rc=$? $((SECONDS - s)) s $(passed "$out/kernels_hc.log")"
s=$SECONDS
PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(budget 120)" engine_gpu_tests > "$out/engine.log" 2>&1
result[engine]="rc=$? $((SECONDS - s)) s $(passed "$out/engine.log")"
s=$SECONDS
if [ "$(budget 60)" -gt 20 ]; then
  timeout -k 5 "$(budget 60)" pdserve_kernels_cuda_tests > "$out/kernels_all.log" 2>&1
fi
result[kernels]="rc=$? $((SECONDS - s)) s $(passed "$out/kernels_all.log")"
grep -E '^\[  FAILED  \]' "$out"/*.log | head -20
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-34s %s\n' step result
printf '%-34s %s\n' "Sinkhorn / hc / RMSNorm kernel tests" "${result[hc]}"
printf '%-34s %s\n' "engine GPU suite (default path)" "${result[engine]}"
printf '%-34s %s\n' "whole kernel GPU suite" "${result[kernels]}"
