#!/usr/bin/env bash
# One device-machine call for the warpgroup-MMA indexer scores (IndexerScoresVariant::kWgmma,
# kernels/cuda/indexer.cuh, issue 30), from the repository root on a Hopper GPU with CUDA 13:
# builds kernels/cuda standalone (`cmake -S kernels/cuda`: the kernels, tests/kernels_cuda and
# bench/cuda), runs the indexer and top-k GPU tests (every indexer case with both scores kernels),
# then bench/cuda/compare.py in graph timing (pdserve_cuda_bench once: every kernel and read floor;
# PyTorch for the indexer rows only) and prints, last, the indexer rows of both variants against
# the read floor and PyTorch at batch 1, 32 and 128.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), SANITIZE=1 (compute-sanitizer
# memcheck and racecheck on the wgmma indexer tests, ~1 min more), OTHER_TESTS=1 (every kernel
# GPU test, ~1 min more). Expected time without the options: build ~1.5 min on 16 cores, tests
# ~20 s, compare.py ~1.5 min.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-cuda}  # shared with run_gpu_tests.sh / run_topk.sh: one build per call
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
timeout 240 "$tests" --gtest_filter='CudaIndexer*:CudaTopK*:LaunchCheck*' > "$out/tests.log" 2>&1
echo "indexer + top-k GPU tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|wgmma|mma.sync|seed" "$out/tests.log" | head -40
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" \
      --gtest_filter='CudaIndexerTest.MixedLengths*:CudaIndexerTest.BlocksSpanning*:CudaIndexerTest.SmallPages*' \
      > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/sanitize-$tool.log" | tr '\n' ' ')"
  done
fi
if [ "${OTHER_TESTS:-0}" = 1 ]; then
  timeout 300 "$tests" --gtest_filter='-CudaIndexer*:CudaTopK*:LaunchCheck*' > "$out/other-tests.log" 2>&1
  echo "other kernel GPU tests: rc=$? $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/other-tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED" "$out/other-tests.log" | head -10
fi
start=$SECONDS
PDSERVE_BENCH_TIMING=graph PYTHONUNBUFFERED=1 timeout 420 python3 bench/cuda/compare.py \
  --bench "$b/bench/pdserve_cuda_bench" --pytorch-only indexer > "$out/compare-graph.md" 2>&1
echo "compare.py (graph timing): rc=$? $((SECONDS - start)) s; full table: $out/compare-graph.md"
head -1 "$out/compare-graph.md"
python3 - "$out/compare-graph.md" <<'PY' | tee "$out/table.md"
import sys
# docs/perf.md 2026-12-04 11:17 UTC (graph timing): the indexer before this change.
before = {(32, 32): 46.4, (32, 128): 103.6, (128, 128): 347.0}
rows, torch_us = {}, {}
for line in open(sys.argv[1]):
    f = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(f) != 10 or f[0] in ("kernel", "---"):
        continue
    key = (f[0], int(f[1]), int(f[2].rstrip("K")))
    rows[key] = float(f[4])
    if f[8] not in ("-", "OOM"):
        torch_us[key] = float(f[8])
print("| batch | context | read floor | scores mma.sync | scores wgmma | top_k | indexer mma.sync "
      "(x floor) | indexer wgmma (x floor) | PyTorch | wgmma vs PyTorch | 2026-12-04 |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for batch in (1, 32, 128):
    for ctx in (4, 32, 128):
        g = lambda k: rows.get((k, batch, ctx))
        floor = g("indexer_read")
        if floor is None:
            continue
        fmt = lambda v: "-" if v is None else f"{v:.1f}"
        ratio = lambda v: "-" if v is None else f"{v:.1f} ({v / floor:.2f}x)"
        ref = torch_us.get(("indexer", batch, ctx))
        wg = g("indexer_wgmma")
        speed = f"{ref / wg:.1f}x" if ref and wg else "-"
        print(f"| {batch} | {ctx}K | {floor:.1f} | {fmt(g('indexer_scores'))} | "
              f"{fmt(g('indexer_scores_wgmma'))} | {fmt(g('top_k'))} | {ratio(g('indexer'))} | "
              f"{ratio(wg)} | {fmt(ref)} | {speed} | {before.get((batch, ctx), '-')} |")
PY
