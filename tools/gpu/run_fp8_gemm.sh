#!/usr/bin/env bash
# One device-machine call for the block-scaled FP8 / FP4 GEMMs (kernels/cuda/fp8_gemm.cuh,
# fp8_gemm_wgmma.cu, moe_gemm.cuh), from the repository root on a Hopper GPU with CUDA 13 and
# PyTorch: builds kernels/cuda standalone (`cmake -S kernels/cuda`), runs the FP8 / MoE GEMM GPU
# tests, then every other kernel test (SKIP_OTHER_TESTS=1 skips them), then the dense GEMM
# benchmark against PyTorch in the same run (bench/cuda/compare.py --gemm-bench): our wgmma path
# (default config), our mma.sync path, our cuBLASLt path, torch._scaled_mm and bf16 torch.matmul,
# plus the fp8_gemm_wgmma config sweep and the config it found best, and W8A16 wgmma vs mma.sync.
# Knobs: GEMM_PART=all adds the grouped MoE rows (about +2 min; default: dense only);
# PDSERVE_FP8_VARIANTS="w,s,t;w,s,t" replaces the swept configs (warpgroups 1|2, stages 2..8,
# target blocks); PDSERVE_FP8_WGMMA="w,s,t" sets the config fp8_gemm (and the wgmma column) uses;
# PDSERVE_FP8_GEMM=mma forces fp8_gemm's old path. Logs under $OUT (default ./gpu-out); the
# test summary and the tables are printed last. Expected run time: ~3-4 min (build ~1.5 min).
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
# Which tensor-core instructions the GEMM kernels use (wgmma e4m3 shows as HGMMA ... E4M3; mma.sync
# e4m3 as HMMA).
cuobjdump --dump-sass "$b/libpdserve_kernels_cuda.a" 2>/dev/null |
  awk '/Function :/ {f = $3} /GMMA|HMMA/ {split($2, op, " "); print f, op[1]}' |
  grep -iE "BlockScaled|Fp8Wgmma" | sed -E 's/_ZN7pdserve[^ ]*(Fp8WgmmaKernel|BlockScaledGemmKernel)I(L[^ ]*)/\1<\2>/' |
  sort | uniq -c | sort -rn > "$out/sass-mma.txt"
tests="$b/tests/pdserve_kernels_cuda_tests"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
# The new kernel's tests first and alone: a hang or a device fault there (timeout rc 124) must not
# take the other tests and the benchmark with it; then fp8_gemm runs its old path (and the bench
# skips the wgmma rows).
timeout 90 "$tests" --gtest_filter='CudaFp8GemmTest.Wgmma*:CudaW8a16GemmTest.Wgmma*' \
  > "$out/wgmma-tests.log" 2>&1
wgmma_rc=$?
wgmma_broken=0
if [ "$wgmma_rc" -ge 124 ] ||
   grep -qiE "illegal (memory|instruction)|launch failure|misaligned|an illegal" "$out/wgmma-tests.log"; then
  wgmma_broken=1
  export PDSERVE_FP8_GEMM=mma PDSERVE_BENCH_NO_WGMMA=1
fi
timeout 120 "$tests" \
  --gtest_filter='CudaFp8Gemm*:CudaMoeGemm*:CudaW8a16*:-CudaFp8GemmTest.Wgmma*:CudaW8a16GemmTest.Wgmma*' \
  > "$out/fp8-tests.log" 2>&1
fp8_rc=$?
if [ "${SKIP_OTHER_TESTS:-0}" != 1 ]; then
  timeout 120 "$tests" --gtest_filter='-CudaFp8Gemm*:CudaMoeGemm*:CudaW8a16*' \
    > "$out/other-tests.log" 2>&1
  other_rc=$?
fi
part=dense
[ "${GEMM_PART:-dense}" = all ] && part=
PYTHONUNBUFFERED=1 timeout 200 python3 bench/cuda/compare.py \
  --gemm-bench "$b/bench/pdserve_gemm_bench" --gemm-part "$part" > "$out/bench.md" 2>&1
bench_rc=$?
echo "== SASS tensor-core instructions (top):"
head -6 "$out/sass-mma.txt"
echo "== fp8_gemm_wgmma / fp8_gemm_w8a16_wgmma tests: rc=$wgmma_rc $(summary "$out/wgmma-tests.log")"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$out/wgmma-tests.log" | head -30
if [ "$wgmma_broken" = 1 ]; then
  echo "wgmma tests hung or faulted: the rest ran with PDSERVE_FP8_GEMM=mma, bench without wgmma"
fi
echo "== other fp8 / w8a16 / moe gemm tests: rc=$fp8_rc $(summary "$out/fp8-tests.log")"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$out/fp8-tests.log" | head -20
if [ "${SKIP_OTHER_TESTS:-0}" != 1 ]; then
  echo "== other kernel tests: rc=$other_rc $(summary "$out/other-tests.log")"
  grep -E "^\[  FAILED" "$out/other-tests.log" | head -10
fi
echo "== bench: rc=$bench_rc (total $((SECONDS - start)) s)"
cat "$out/bench.md"
