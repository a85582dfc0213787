#!/usr/bin/env bash
# One device-machine call for issue 30's indexer work (kernels/cuda/topk.cuh TopKVariant
# kSelectSort, the scores kernels' programmatic dependent launch and query prefetch), from the
# repository root on a Hopper GPU with CUDA 13: builds the top-k, indexer and attention kernels,
# their GPU tests and bench/cuda's benchmark (tools/gpu/topk30/CMakeLists.txt: only those, with
# kernels/cuda's flags; ~30 s on 16 cores), runs the indexer and top-k GPU
# tests (every case with both top-k kernels and both scores kernels), times bench/cuda's indexer
# and top-k rows in graph timing (PDSERVE_BENCH_ONLY=indexer: no attention rows;
# PDSERVE_BENCH_TOPK_STAGES=1: the select kernel ended after each stage; TOPK_SWEEP=1, the
# default: both top-k kernels at 1, 2, 4 and 8 blocks per row), and prints, last, a
# table: kernel, batch, context, us, read floor, ratio, before (bench/cuda/results/
# 2026-12-04-graph.md).
# Environment: OUT (default ./gpu-out: stdout's table plus logs.tgz, the build, test and bench
# logs), BUILD (build dir), COMPARE=1 (bench/cuda/compare.py
# in graph timing afterwards, PyTorch for the indexer rows: ~1.5 min more), SANITIZE=1
# (compute-sanitizer memcheck on two top-k tests, rows at the select kernel's whole-row limit and
# ties across a cluster's blocks, racecheck on the first; <= 90 s more).
# Expected time without the options: build ~30 s on 16 cores, tests ~30 s, bench ~20 s.
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null' EXIT
b=${BUILD:-/tmp/topk30}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 30 cmake -S tools/gpu/topk30 -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 100 cmake --build "$b" -j"$(nproc)"; } > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED after $((SECONDS - start)) s"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/topk30_tests"
start=$SECONDS
timeout 60 "$tests" --gtest_filter='CudaIndexer*:CudaTopK*' > "$out/tests.log" 2>&1
echo "indexer + top-k GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|blocks per row|seed" "$out/tests.log" | head -30
if [ "${SANITIZE:-0}" = 1 ]; then
  for tool in memcheck racecheck; do
    filter='CudaTopKTest.RowsAtTheWholeRowLimit*:CudaTopKTest.TiesSpanning*'
    [ "$tool" = racecheck ] && filter='CudaTopKTest.RowsAtTheWholeRowLimit*'  # racecheck: ~10x slower
    timeout 45 compute-sanitizer --tool "$tool" --error-exitcode 9 "$tests" \
      --gtest_filter="$filter" > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/sanitize-$tool.log" | tr '\n' ' ')"
  done
fi
start=$SECONDS
PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_STAGES=1 \
  PDSERVE_BENCH_TOPK_SWEEP=${TOPK_SWEEP:-1} timeout 45 \
  "$b/topk30_bench" > "$out/bench-graph.csv" 2> "$out/bench-graph.err"
echo "bench (graph timing): rc=$? $((SECONDS - start)) s, $(wc -l < "$out/bench-graph.csv") rows"
head -5 "$out/bench-graph.err"
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  # One launch each of the wgmma scores kernel and the select top-k at 32 x 32K (launch timing,
  # L2 flushed): where their warps stall.
  start=$SECONDS
  for kernel in 'IndexerScoresWgmmaKernel<\(bool\)1, \(bool\)0>' 'TopKSelectKernel'; do
    PDSERVE_BENCH_ONLY=indexer timeout 20 ncu --clock-control none --kernel-name-base demangled \
      -k regex:"$kernel" -c 1 --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --page raw "$b/topk30_bench" 32 32768 >> "$out/ncu.txt" 2>&1
  done
  echo "ncu: rc=$? $((SECONDS - start)) s"
  # Per kernel: its name line, duration, DRAM throughput, occupancy, registers, and the stall
  # reasons that hold more than 0.1 warps per issued instruction.
  grep -E "^  [A-Za-z_].*\(|gpu__time_duration.sum|dram__throughput.avg.pct_of_peak_sustained_elapsed|sm__warps_active.avg.pct_of_peak|launch__registers_per_thread |issue_stalled_.*per_issue_active" \
    "$out/ncu.txt" | awk '!/issue_stalled/ || $NF + 0 > 0.1' | sed 's/  */ /g' | cut -c1-150 | head -60
fi
if [ "${COMPARE:-0}" = 1 ]; then
  start=$SECONDS
  PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer PYTHONUNBUFFERED=1 timeout 200 \
    python3 bench/cuda/compare.py --bench "$b/topk30_bench" --pytorch-only indexer \
    > "$out/compare-graph.md" 2>&1
  echo "compare.py (graph timing): rc=$? $((SECONDS - start)) s"
  cat "$out/compare-graph.md"
fi
python3 - "$out/bench-graph.csv" <<'PY' | tee "$out/table.md"
import sys
# bench/cuda/results/2026-12-04-graph.md (graph timing, H200, before issue 30's select top-k).
before = {
    ("top_k", 32, 4): 8.2, ("top_k", 32, 32): 13.1, ("top_k", 32, 128): 16.2,
    ("top_k", 128, 4): 8.9, ("top_k", 128, 32): 14.4, ("top_k", 128, 128): 22.0,
    ("top_k", 1, 4): 8.0, ("top_k", 1, 32): 12.8, ("top_k", 1, 128): 15.3,
    ("indexer_scores_wgmma", 1, 4): 3.6, ("indexer_scores_wgmma", 1, 32): 4.2,
    ("indexer_scores_wgmma", 1, 128): 7.0, ("indexer_scores_wgmma", 32, 4): 7.8,
    ("indexer_scores_wgmma", 32, 32): 24.7, ("indexer_scores_wgmma", 32, 128): 74.3,
    ("indexer_scores_wgmma", 128, 4): 16.9, ("indexer_scores_wgmma", 128, 32): 75.8,
    ("indexer_scores_wgmma", 128, 128): 276.1,
    ("indexer_wgmma", 1, 4): 11.8, ("indexer_wgmma", 1, 32): 17.5, ("indexer_wgmma", 1, 128): 22.2,
    ("indexer_wgmma", 32, 4): 15.9, ("indexer_wgmma", 32, 32): 39.6,
    ("indexer_wgmma", 32, 128): 91.5, ("indexer_wgmma", 128, 4): 25.9,
    ("indexer_wgmma", 128, 32): 92.2, ("indexer_wgmma", 128, 128): 296.5,
}
for k in list(before):
    if k[0] == "top_k":
        before[("top_k_select",) + k[1:]] = before[k]
    if k[0] == "indexer_wgmma":
        before[("indexer_select",) + k[1:]] = before[k]
        before[("indexer_wgmma_select",) + k[1:]] = before[k]
    if k[0] == "indexer_scores_wgmma":
        before[("indexer_scores_wgmma_qr",) + k[1:]] = before[k]
rows = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) == 7 and f[0] != "copy":
        rows[(f[0], int(f[1]), int(f[2]) // 1024)] = float(f[4])
detail = ["top_k_select_s1", "top_k_select_s4", "top_k_select_s2", "top_k_select_s3",
          "top_k_select", "top_k_select_b1", "top_k_select_b2", "top_k_select_b3",
          "top_k_select_b4", "top_k_select_b8", "top_k_b1", "top_k_b2", "top_k_b4"]
print("Select top-k by stage (s1: launch + -1 fill, s4: + the sample's threshold, s2: + the "
      "gathering (a fallback selection where the sample missed), s3: + placing by bins, where "
      "that fails the narrowing; then a fallback sort) and by blocks per row (b<N>; "
      "radix-cluster top_k_b<N>), us:")
print("| batch | context | " + " | ".join(d.replace("top_k_", "") for d in detail) + " |")
print("|" + " --- |" * (len(detail) + 2))
for batch in (1, 32, 128):
    for ctx in (4, 32, 128):
        cells = [rows.get((d, batch, ctx)) for d in detail]
        if any(c is not None for c in cells):
            print(f"| {batch} | {ctx}K | " +
                  " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
print()
kernels = ["top_k", "top_k_select", "indexer_scores_wgmma", "indexer_scores_wgmma_qr",
           "indexer_wgmma", "indexer_wgmma_select", "indexer_select"]
print("| kernel | batch | context | us | read floor | ratio | before |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for batch in (1, 32, 128):
    for ctx in (4, 32, 128):
        floor = rows.get(("indexer_read", batch, ctx))
        for k in kernels:
            us = rows.get((k, batch, ctx))
            if us is None:
                continue
            whole = k.startswith("indexer") and floor
            ratio = f"{us / floor:.2f}x" if whole else "-"
            old = before.get((k, batch, ctx))
            print(f"| {k} | {batch} | {ctx}K | {us:.1f} | {f'{floor:.1f}' if whole else '-'} | "
                  f"{ratio} | {old if old else '-'} |")
PY
