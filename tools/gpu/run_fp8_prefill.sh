#!/usr/bin/env bash
# One device-machine call for fp8_gemm's prefill path (cuBLASLt block-scaled FP8 from
# kFp8LtMinTokens tokens, kernels/cuda/fp8_gemm.cuh; issue 25), from the repository root on a
# Hopper GPU with CUDA 13 and PyTorch: builds kernels/cuda standalone (tests + gemm bench only),
# runs the FP8 / W8A16 / MoE GEMM GPU tests (the cuBLASLt cases: k / 128 of 2, 3 and 4, token
# counts not a multiple of 4, through the dispatch), then the dense GEMM bench against PyTorch
# (bench/cuda/compare.py --gemm-bench, one wgmma config so there is no sweep) and prints, last,
# the prefill table: our cuBLASLt path (act quant included) against torch._scaled_mm (inputs
# already quantized) and bf16 torch.matmul. Logs under $OUT. Expected run time: ~2-3 min.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-fp8p}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
start=$SECONDS
if ! { cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_gemm_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
timeout 120 "$b/tests/pdserve_kernels_cuda_tests" --gtest_filter='CudaFp8Gemm*:CudaW8a16*:CudaMoeGemm*' \
  > "$out/tests.log" 2>&1
echo "fp8 / w8a16 / moe GEMM tests: rc=$? $(summary "$out/tests.log")"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|refus|error" "$out/tests.log" | head -30
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
PDSERVE_FP8_VARIANTS="1,4,264" PYTHONUNBUFFERED=1 timeout 240 python3 bench/cuda/compare.py \
  --gemm-bench "$b/bench/pdserve_gemm_bench" --gemm-part dense > "$out/bench.md" 2>&1
echo "bench: rc=$? (total $((SECONDS - start)) s); full table: $out/bench.md"
grep -m2 -E "^GPU:" "$out/bench.md"
python3 - "$out/bench.md" <<'PY' | tee "$out/prefill.md"
import sys
print("| shape | tokens | pdserve fp8_gemm (cuBLASLt) us | torch._scaled_mm us | ratio | wgmma us | torch bf16 us |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for line in open(sys.argv[1]):
    f = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(f) != 10 or not f[1].isdigit() or int(f[1]) < 64:
        continue
    shape, m, wg, _, _, _, lt, _, tsm, tbf = f
    try:
        ratio = "%.2f" % (float(lt) / float(tsm))
    except ValueError:
        ratio = "-"
    print(f"| {shape} | {m} | {lt} | {tsm} | {ratio} | {wg} | {tbf} |")
PY
