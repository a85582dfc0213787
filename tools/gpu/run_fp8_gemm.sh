#!/usr/bin/env bash
# One device-machine call for the block-scaled FP8 / FP4 GEMMs (kernels/cuda/fp8_gemm.cuh,
# moe_gemm.cuh), from the repository root on a Hopper GPU with CUDA 13 and PyTorch: builds
# kernels/cuda standalone (`cmake -S kernels/cuda`), runs the new GPU tests, the FP8 / MoE GEMM
# benchmark against PyTorch (bench/cuda/compare.py --gemm-bench), then the other kernel tests
# (SKIP_OTHER_TESTS=1 skips them). Logs under $OUT (default ./gpu-out); the benchmark table is
# printed last.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-cuda}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
start=$SECONDS
if ! { cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" && cmake --build "$b" -j"$(nproc)"; } > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
# Which tensor-core instructions the GEMM kernels use (mma.sync e4m3 shows as HMMA ... E4M3).
cuobjdump --dump-sass "$b/libpdserve_kernels_cuda.a" 2>/dev/null |
  awk '/Function :/ {f = $3} /MMA/ {split($2, op, " "); print f, op[1]}' |
  grep -i "BlockScaled" | sort | uniq -c | sort -rn | head -12 > "$out/sass-mma.txt"
head -4 "$out/sass-mma.txt"
timeout 150 "$b/tests/pdserve_kernels_cuda_tests" --gtest_filter='CudaFp8Gemm*:CudaMoeGemm*' \
  > "$out/fp8-tests.log" 2>&1
echo "fp8/moe gemm tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/fp8-tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed" "$out/fp8-tests.log" | head -40
PYTHONUNBUFFERED=1 timeout 270 python3 bench/cuda/compare.py \
  --gemm-bench "$b/bench/pdserve_gemm_bench" > "$out/bench.md" 2>&1
echo "bench: rc=$?"
if [ "${SKIP_OTHER_TESTS:-0}" != 1 ]; then
  timeout 150 "$b/tests/pdserve_kernels_cuda_tests" --gtest_filter='-CudaFp8Gemm*:CudaMoeGemm*' \
    > "$out/other-tests.log" 2>&1
  echo "other kernel tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/other-tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED" "$out/other-tests.log" | head -10
fi
cat "$out/bench.md"
