#!/usr/bin/env bash
# The hyper-connections' Sinkhorn projection in registers (kernels/cuda/sinkhorn.cu,
# SinkhornRegistersKernel, the default for n = 2 / 4 / 8), in one device call of at most ~300 s:
#   1. the Sinkhorn GPU tests (against the CPU reference, and the three kernels bit for bit
#      against each other), the grouped / W8A16 GEMM tests (their workspace arithmetic moved to
#      kernels/cuda/moe_gemm_workspace.h) and bench/cuda/sinkhorn_bench (each kernel inside a
#      CUDA graph);
#   2. the engine's whole GPU suite (logits against the CPU engine, graph == eager, PD pages);
#   3. tools/gpu/run_layer_profile.sh: one real-format V4-Flash layer's decode step kernel by
#      kernel under ncu at batch 1 and 32 (SinkhornKernel was 16 us a launch, 2 a layer, on an
#      H200 at 18:05 UTC 2026-12-05 before this change).
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests engine_gpu_tests gpu_decode_step_bench \
#     pdserve_sinkhorn_bench
#   tools/gpu/run_sinkhorn59.sh pack        # .device-carry/sinkhorn59.tar.xz (+ layer_profile's)
#   tools/gpu/device_tree.sh tests          # the tree fits a device call (restore afterwards)
# There (carry .device-carry/sinkhorn59.tar.xz and .device-carry/layer_profile.tar.xz):
#   OUT=<dir> bash tools/gpu/run_sinkhorn59.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  b=${BUILD:-build}
  tools/gpu/pack_binaries.sh "$tmp/sinkhorn59" "$b/tests/kernels_cuda/pdserve_kernels_cuda_tests" \
    "$b/tests/engine_gpu/engine_gpu_tests" "$b/bench/cuda/pdserve_sinkhorn_bench" > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - sinkhorn59 | xz -6 -T0) > .device-carry/sinkhorn59.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/sinkhorn59.tar.xz
  BUILD=$b tools/gpu/run_layer_profile.sh pack
  exit 0
fi
out=${OUT:-gpu-out/sinkhorn59}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ ! -x .device-carry/sinkhorn59/bin/engine_gpu_tests ]; then
  tar -xJf .device-carry/sinkhorn59.tar.xz -C .device-carry ||
    { echo "FAIL: no .device-carry/sinkhorn59.tar.xz (run '$0 pack' here first)"; exit 2; }
fi
# shellcheck disable=SC1091
source .device-carry/sinkhorn59/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
declare -A result
s=$SECONDS
# With the grouped-GEMM tests: the MoE workspace arithmetic moved to a shared header (plan59).
timeout -k 5 120 pdserve_kernels_cuda_tests \
  --gtest_filter='CudaSinkhorn*:CudaMoeGemm*:CudaW8a16*:MoeGemmWorkspace*' > "$out/sinkhorn.log" 2>&1
result[sinkhorn]="rc=$? $((SECONDS - s)) s $(passed "$out/sinkhorn.log")"
grep -E "^\[  FAILED|Failure" "$out/sinkhorn.log" | head -8
s=$SECONDS
timeout -k 5 60 pdserve_sinkhorn_bench > "$out/sinkhorn_bench.csv" 2>&1
result[bench]="rc=$? $((SECONDS - s)) s"
s=$SECONDS
PDSERVE_SOURCE_DIR=$PWD timeout -k 5 150 engine_gpu_tests > "$out/engine_gpu.log" 2>&1
result[engine]="rc=$? $((SECONDS - s)) s $(passed "$out/engine_gpu.log")"
grep -E "^\[  FAILED|Failure" "$out/engine_gpu.log" | head -8
s=$SECONDS
OUT="$out/profile" timeout -k 5 200 bash tools/gpu/run_layer_profile.sh > "$out/profile.log" 2>&1
result[profile]="rc=$? $((SECONDS - s)) s"
echo
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-26s %s\n' step result
printf '%-26s %s\n' "sinkhorn + MoE GPU tests" "${result[sinkhorn]}"
printf '%-26s %s\n' "sinkhorn bench" "${result[bench]}"
printf '%-26s %s\n' "engine GPU tests" "${result[engine]}"
printf '%-26s %s\n' "layer profile" "${result[profile]}"
grep -E "plain run|kernels a step|Sinkhorn" "$out/profile/table.md" 2>/dev/null
cat "$out/sinkhorn_bench.csv"
