#!/usr/bin/env bash
# One device-machine call for issue 25's prefill experts (the routed experts' grouped GEMM on the
# Hopper warpgroup MMA, moe_grouped_gemm_wgmma). From the repository root on a Hopper GPU with
# CUDA 13: builds kernels/cuda standalone (the kernels, the GPU tests, bench/cuda/gemm_bench.cu),
# runs the new path's tests first (multicast_activations apart), then the old grouped GEMM tests (mma.sync path; and once more
# through moe_grouped_gemm with PDSERVE_MOE_GEMM=wgmma, FP8 / FP4 cases), then gemm_bench
# moe_prefill beside bf16 torch._grouped_mm (bench/cuda/compare.py --moe-prefill-bench: both
# paths, FP8 and W8A16, w13 and w2, 512-8192 tokens, CUDA graphs; the wgmma rows are skipped when
# the new path's tests failed), and prints the table LAST. The bench is skipped past 130 s and
# cut at 150 s (its rows so far still make the table), so that it ends within 170 s.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), PDSERVE_MOE_WGMMA_VARIANTS
# ("tile,stages;...", gemm_bench's variant rows).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-moe58}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 30 cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 100 cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_gemm_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
failures() { grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error|got " "$1" | head -20; }
timeout 40 "$tests" --gtest_filter='CudaMoeGemmWgmmaTest*' > "$out/wgmma-tests.log" 2>&1
wgmma_rc=$?
echo "moe_grouped_gemm_wgmma tests: rc=$wgmma_rc $(summary "$out/wgmma-tests.log")"
failures "$out/wgmma-tests.log"
# multicast_activations on its own (a fault there turns its bench rows off, not the others).
timeout 30 "$tests" --gtest_filter='CudaMoeGemmWgmmaMulticast*' > "$out/multicast-tests.log" 2>&1
multicast_rc=$?
echo "multicast_activations tests: rc=$multicast_rc $(summary "$out/multicast-tests.log")"
failures "$out/multicast-tests.log"
[ "$multicast_rc" = 0 ] || export PDSERVE_MOE_WGMMA_VARIANTS=${PDSERVE_MOE_WGMMA_VARIANTS:-"64,0;128,0"}
timeout 30 "$tests" --gtest_filter='CudaMoeGemmTest*:CudaW8a16MoeGemm*' > "$out/mma-tests.log" 2>&1
echo "mma.sync grouped GEMM tests: rc=$? $(summary "$out/mma-tests.log")"
failures "$out/mma-tests.log"
if [ "$wgmma_rc" = 0 ]; then
  PDSERVE_MOE_GEMM=wgmma timeout 30 "$tests" --gtest_filter='CudaMoeGemmTest*' \
    > "$out/dispatch-tests.log" 2>&1
  echo "grouped GEMM tests through PDSERVE_MOE_GEMM=wgmma: rc=$? $(summary "$out/dispatch-tests.log")"
  failures "$out/dispatch-tests.log"
else
  # A fault in the new kernel must not take the mma rows and torch's with it.
  echo "wgmma tests failed: the bench times the mma.sync path and torch only"
fi
if [ $((SECONDS - start)) -gt 130 ]; then
  echo "skipped the bench: $((SECONDS - start)) s spent"
  exit 0
fi
s2=$SECONDS
# The bench writes its rows as it goes (a cut-short run still gives a table), then compare.py
# times torch._grouped_mm and prints the table.
mma_only=()
[ "$wgmma_rc" = 0 ] || mma_only=(env PDSERVE_MOE_PREFILL_MMA_ONLY=1)
"${mma_only[@]}" timeout $((150 - (SECONDS - start))) "$b/bench/pdserve_gemm_bench" moe_prefill \
  > "$out/moe-prefill.csv" 2> "$out/moe-prefill.csv.err"
echo "gemm_bench moe_prefill: rc=$? $((SECONDS - s2)) s, $(wc -l < "$out/moe-prefill.csv") rows"
tail -3 "$out/moe-prefill.csv.err"
s2=$SECONDS
timeout $((170 - (SECONDS - start))) python3 bench/cuda/compare.py \
  --moe-prefill-bench "$out/moe-prefill.csv" > "$out/moe-prefill.md" 2> "$out/moe-prefill.err"
echo "torch + table: rc=$? $((SECONDS - s2)) s; total $((SECONDS - start)) s"
tail -3 "$out/moe-prefill.err"
cat "$out/moe-prefill.md"
