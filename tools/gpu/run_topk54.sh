#!/usr/bin/env bash
# One device-machine call for issue 30's top-k (kernels/cuda/topk.cuh TopKVariant::kSelectPrefetch
# against the default kSelectSort), from the repository root on a Hopper GPU with CUDA 13: builds
# the top-k, indexer and attention kernels with the top-k and indexer GPU tests and bench/cuda's
# benchmark (tools/gpu/topk30/CMakeLists.txt: only those), runs the indexer and top-k GPU tests
# (every top-k case with all three top-k kernels at every block count; the indexer's with the
# wgmma scores + select-prefetch top-k among its variants), times bench/cuda's indexer and top-k
# rows at batch 1 / 32 / 128 x 4K / 32K / 128K in graph timing (PDSERVE_BENCH_ONLY=indexer,
# PDSERVE_BENCH_TOPK_STAGES=1: both select kernels ended after each stage, TOPK_SWEEP=1 (the
# default): every kernel at 1, 2, 3, 4 and 8 blocks per row), then compute-sanitizer memcheck on
# the new kernel's own test, and prints, last, a table: variant, batch, context, us, against the
# default top-k of the same run.
# Environment: OUT (default ./gpu-out: the tables, logs.tgz with the build, test, bench and
# sanitizer logs), BUILD (a build folder; this script builds in its subfolder topk54), LIMIT
# (seconds for the whole script, default 165: each step gets at most what is left).
# Expected on 16 cores: build ~30 s, tests ~45 s, bench ~30 s, memcheck ~20 s.
set -uo pipefail
final=${OUT:-gpu-out}
out=$(mktemp -d)
mkdir -p "$final"
trap 'cp "$out"/*.md "$final"/ 2>/dev/null; tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null' EXIT
b=${BUILD:-/tmp/pdserve-topk54}/topk54
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
limit=${LIMIT:-165}
t0=$SECONDS
# The seconds a step may take: at most $1, at most what is left of the limit less $2 kept for
# the steps after it.
budget() {
  local left=$((limit - (SECONDS - t0) - ${2:-0}))
  [ "$left" -lt "$1" ] && echo "$left" || echo "$1"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 30 cmake -S tools/gpu/topk30 -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout "$(budget 90 60)" cmake --build "$b" -j"$(nproc)" --target topk30_tests topk30_bench; } \
     > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED after $((SECONDS - start)) s"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/topk30_tests"

start=$SECONDS
timeout "$(budget 60 45)" "$tests" --gtest_filter='CudaIndexer*:CudaTopK*' > "$out/tests.log" 2>&1
echo "indexer + top-k GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|blocks per row|seed" "$out/tests.log" | head -30

start=$SECONDS
PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_STAGES=1 \
  PDSERVE_BENCH_TOPK_SWEEP=${TOPK_SWEEP:-1} timeout "$(budget 50 15)" \
  "$b/topk30_bench" > "$out/bench-graph.csv" 2> "$out/bench-graph.err"
echo "bench (graph timing): rc=$? $((SECONDS - start)) s, $(wc -l < "$out/bench-graph.csv") rows"
head -5 "$out/bench-graph.err"

start=$SECONDS
s=$(budget 40 3)
if [ "$s" -ge 10 ]; then
  timeout "$s" "$sanitizer" --tool memcheck --error-exitcode 9 "$tests" \
    --gtest_filter='CudaTopKTest.SelectPrefetchPaths*' > "$out/sanitize-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck (CudaTopKTest.SelectPrefetchPaths*): rc=$? $((SECONDS - start)) s $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/sanitize-memcheck.log" | tr '\n' ' ')"
else
  echo "compute-sanitizer memcheck: skipped ($s s left)"
fi

python3 - "$out/bench-graph.csv" <<'PY' | tee "$out/table.md"
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) == 7 and f[0] != "copy":
        rows[(f[0], int(f[1]), int(f[2]) // 1024)] = float(f[4])
sizes = [(b, c) for b in (1, 32, 128) for c in (4, 32, 128)]
def cell(v):
    return "-" if v is None else f"{v:.1f}"
print("Stages (s1: launch + -1 fill, s4: + the sample's threshold, s2: + the gathering, "
      "whole: + placing by bins), us, select = kSelectSort (the default until 2026-12-05), prefetch = kSelectPrefetch (the default since):")
names = ["top_k_select_s1", "top_k_select_s4", "top_k_select_s2", "top_k_select",
         "top_k_prefetch_s1", "top_k_prefetch_s4", "top_k_prefetch_s2", "top_k_prefetch"]
print("| batch | context | " + " | ".join(n.replace("top_k_", "") for n in names) + " |")
print("|" + " --- |" * (len(names) + 2))
for b, c in sizes:
    print(f"| {b} | {c}K | " + " | ".join(cell(rows.get((n, b, c))) for n in names) + " |")
print()
print("Blocks per row (b<N>), us:")
sweep = [f"top_k_{v}b{n}" for v in ("select_", "prefetch_") for n in (1, 2, 3, 4, 8)]
print("| batch | context | " + " | ".join(n.replace("top_k_", "") for n in sweep) + " |")
print("|" + " --- |" * (len(sweep) + 2))
for b, c in sizes:
    print(f"| {b} | {c}K | " + " | ".join(cell(rows.get((n, b, c))) for n in sweep) + " |")
print()
# variant rows and the row of the current default they are compared with
pairs = [("top_k_select (old default)", "top_k_select", "top_k_select"),
         ("top_k_prefetch", "top_k_prefetch", "top_k_select"),
         ("top_k_b2 (radix-cluster, 2 blocks)", "top_k_b2", "top_k_select"),
         ("indexer wgmma + select (old default)", "indexer_wgmma_select", "indexer_wgmma_select"),
         ("indexer wgmma + prefetch", "indexer_wgmma_prefetch", "indexer_wgmma_select")]
print("| variant | batch | context | us | vs kSelectSort | indexer read floor |")
print("| --- | --- | --- | --- | --- | --- |")
for b, c in sizes:
    floor = rows.get(("indexer_read", b, c))
    for label, name, base in pairs:
        us = rows.get((name, b, c))
        ref = rows.get((base, b, c))
        if us is None:
            continue
        vs = f"{us / ref:.2f}x ({us - ref:+.1f})" if ref else "-"
        fl = f"{floor:.1f}" if floor and label.startswith("indexer") else "-"
        print(f"| {label} | {b} | {c}K | {us:.1f} | {vs} | {fl} |")
PY
echo "total: $((SECONDS - t0)) s"
