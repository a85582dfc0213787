#!/usr/bin/env bash
# One device-machine call for the split top-k (kernels/cuda/topk.cuh, issue 30), from the
# repository root on a Hopper GPU with CUDA 13: builds kernels/cuda standalone (`cmake -S
# kernels/cuda`: the kernels, tests/kernels_cuda and bench/cuda), runs the top-k and indexer GPU
# tests, then bench/cuda in graph timing with the top-k cluster-size sweep
# (PDSERVE_BENCH_TOPK_SWEEP=1), and prints a table of the top-k and indexer rows at batch 1, 32
# and 128 beside the 2026-12-03 graph figures of docs/perf.md and the read floor, last.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), SANITIZE=1 (compute-sanitizer
# memcheck and racecheck on the split top-k tests, ~1 min more), COMPARE=1 (bench/cuda/compare.py
# in graph timing after it, PyTorch included, ~2-3 min more), OTHER_TESTS=1 (every kernel GPU
# test). Expected time without the options: build ~1.5 min on 16 cores, tests ~20 s, bench ~40 s.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-cuda}  # shared with run_gpu_tests.sh / run_fp8_gemm.sh: one build per call
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_cuda_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
timeout 240 "$tests" --gtest_filter='CudaTopK*:CudaIndexer*' > "$out/tests.log" 2>&1
echo "top-k + indexer GPU tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|blocks per row|seed" "$out/tests.log" | head -40
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" \
      --gtest_filter='CudaTopKTest.SplitRows*:CudaTopKTest.TiesSpanning*:CudaTopKTest.RowsShorter*' \
      > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/sanitize-$tool.log" | tr '\n' ' ')"
  done
fi
if [ "${OTHER_TESTS:-0}" = 1 ]; then
  timeout 300 "$tests" --gtest_filter='-CudaTopK*:CudaIndexer*' > "$out/other-tests.log" 2>&1
  echo "other kernel GPU tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/other-tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED" "$out/other-tests.log" | head -10
fi
PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_TOPK_SWEEP=1 timeout 300 "$b/bench/pdserve_cuda_bench" \
  > "$out/bench-graph.csv" 2> "$out/bench-graph.err"
echo "bench (graph timing): rc=$? $(wc -l < "$out/bench-graph.csv") rows"
if [ "${COMPARE:-0}" = 1 ]; then
  PDSERVE_BENCH_TIMING=graph PYTHONUNBUFFERED=1 timeout 400 python3 bench/cuda/compare.py \
    --bench "$b/bench/pdserve_cuda_bench" > "$out/compare-graph.md" 2>&1
  echo "compare.py (graph): rc=$?"
  cat "$out/compare-graph.md"
fi
python3 - "$out/bench-graph.csv" <<'EOF' | tee "$out/table.md"
import sys
# docs/perf.md, 2026-12-03 07:29 UTC (graph timing, same bench): indexer; issue 30: top-k alone.
before = {("indexer", 32, 4): 25.1, ("indexer", 128, 4): 34.1, ("indexer", 32, 32): 46.7,
          ("indexer", 128, 32): 101.3, ("indexer", 32, 128): 108.1, ("indexer", 128, 128): 334.4,
          ("top_k", 32, 32): 13.9, ("top_k", 32, 128): 22.0}
rows = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) == 7 and f[0] != "copy":
        rows[(f[0], int(f[1]), int(f[2]) // 1024)] = float(f[4])
kernels = ["top_k", "top_k_b1", "top_k_b2", "top_k_b4", "top_k_b8", "indexer_scores", "indexer",
           "indexer_read"]
print("| kernel | batch | context | us now | us before (2026-12-03) | now / read floor |")
print("| --- | --- | --- | --- | --- | --- |")
for batch in (1, 32, 128):
    for ctx in (4, 32, 128):
        for k in kernels:
            if (k, batch, ctx) not in rows:
                continue
            us = rows[(k, batch, ctx)]
            floor = rows.get(("indexer_read", batch, ctx))
            ratio = f"{us / floor:.2f}x" if k == "indexer" and floor else "-"
            old = before.get((k, batch, ctx))
            print(f"| {k} | {batch} | {ctx}K | {us:.1f} | {old if old else '-'} | {ratio} |")
EOF
