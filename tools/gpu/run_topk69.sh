#!/usr/bin/env bash
# Issue 30: the top-k whose sample threshold is the median of the warps' rank keys
# (TopKVariant::kSelectQuantile) against kSelectPrefetch, in one device call (<= BUDGET s, default
# 330): every kernel GPU test (tests/kernels_cuda, all of them; TESTS: a gtest filter instead),
# compute-sanitizer memcheck on the quantile paths, then pdserve_cuda_bench in graph timing with
# PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_STAGES=1 at batch 1, 32 and 128 and context 4K,
# 32K and 128K, twice each (both kernels' rows come from the same run). The first round also
# writes the select top-k kernels' block timelines ($OUT/trace_topk.csv, summarized by
# tools/gpu/trace_summary.py --phases and tools/gpu/topk_phases.py in $OUT/trace_topk.md); NCU=1
# and SASS=1: see below. The table last (us, the mean of the two runs); rows in $OUT/topk69.csv
# (TAG,the bench's row).
# Here:
#   cmake --build build --target pdserve_cuda_bench pdserve_kernels_cuda_tests
#   tools/gpu/run_topk69.sh pack      # .device-carry/topk69.tar.xz
# There (carry it): OUT=<dir> bash tools/gpu/run_topk69.sh
# ENGINE=1 (both here and there; carry .device-carry/engine69.tar.xz too): the engine's GPU suite
# (build/tests/engine_gpu/engine_gpu_tests, the default top-k inside) after the kernel tests.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry topk69 build/bench/cuda/pdserve_cuda_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests || exit 1
  [ "${ENGINE:-0}" = 1 ] && pack_carry engine69 build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
start_round topk69 330
unpack .device-carry/topk69

s=$(date +%s)
timeout -k 5 "$(cap 150)" pdserve_kernels_cuda_tests --gtest_filter="${TESTS:-*}" > "$out/tests.log" 2>&1
row "kernel tests (${TESTS:-all})" "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10
if [ "${ENGINE:-0}" = 1 ] && may; then  # the engine's GPU suite with this build's default top-k
  engine_suite engine69
fi
if command -v compute-sanitizer > /dev/null && may; then
  s=$(date +%s)
  timeout -k 5 "$(cap 50)" compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$(command -v pdserve_kernels_cuda_tests)" \
    --gtest_filter='CudaTopKTest.SelectPrefetchPaths*:CudaTopKTest.DecodeBatches*' \
    > "$out/memcheck.log" 2>&1
  row memcheck "rc=$?" "$(($(date +%s) - s)) s $(grep -E 'ERROR SUMMARY|^\[  PASSED' "$out/memcheck.log" | tr '\n' ' ')"
fi

# SASS=1: the SASS of the untraced kSelectPrefetch and kSelectQuantile kernels ($OUT/topk_sass.txt)
if [ "${SASS:-0}" = 1 ] && command -v cuobjdump > /dev/null; then
  cuobjdump -sass "$(command -v pdserve_cuda_bench)" 2> /dev/null |
    awk '/Function : .*TopKSelectKernelILb1ELb[01]ELb0E/ {p = 1} p {print} /^\t\t\.\.\.\.\.\.\.\.\.\./ {p = 0}' \
    > "$out/topk_sass.txt"
  row sass "$(wc -l < "$out/topk_sass.txt") lines" ""
fi
# NCU=1: Nsight Compute on one kSelectQuantile and one kSelectPrefetch launch at 32 x 128K (eager
# launches of the bench's rows): warp states ($OUT/ncu_<variant>.txt) and the SASS with its
# warp-stall samples ($OUT/ncu_<variant>_source.csv; tools/gpu/topk_stalls.py sums them)
ncu_bin=$(command -v ncu || find /usr/local -maxdepth 4 -name ncu -type f 2> /dev/null | head -1)
if [ "${NCU:-0}" = 1 ] && [ -n "$ncu_bin" ]; then
  for v in ILb1ELb1ELb0E ILb1ELb0ELb0E; do
    may || break
    name=$([ "$v" = ILb1ELb1ELb0E ] && echo quantile || echo prefetch)
    s=$(date +%s)
    PDSERVE_BENCH_ONLY=indexer timeout -k 5 "$(cap 60)" "$ncu_bin" --kernel-name-base mangled \
      --kernel-name "regex:TopKSelectKernel$v" --launch-skip 30 --launch-count 1 \
      --clock-control none --section WarpStateStats --section SchedulerStats \
      --section LaunchStats --section SourceCounters pdserve_cuda_bench 32 131072 \
      > "$out/ncu_$name.txt" 2>&1
    PDSERVE_BENCH_ONLY=indexer timeout -k 5 "$(cap 60)" "$ncu_bin" --kernel-name-base mangled \
      --kernel-name "regex:TopKSelectKernel$v" --launch-skip 30 --launch-count 1 \
      --clock-control none --section SourceCounters --page source --print-source sass --csv \
      pdserve_cuda_bench 32 131072 > "$out/ncu_${name}_source.csv" 2> /dev/null
    python3 tools/gpu/topk_stalls.py "$out/ncu_${name}_source.csv" > "$out/ncu_${name}_stalls.txt"
    row "ncu $name" "rc=$?" "$(($(date +%s) - s)) s"
  done
fi
failed=0
s=$(date +%s)
for round in 1 2; do
  for context in 4096 32768 131072; do
    for batch in 1 32 128; do
      may || break 3
      trace=""
      [ "$round" = 1 ] && trace="$out/trace_topk.csv"
      PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_STAGES=1 \
        PDSERVE_BLOCK_TRACE="$trace" timeout -k 5 "$(cap 40)" pdserve_cuda_bench "$batch" "$context" \
        > "$out/topk_${round}_${batch}x${context}.csv" 2>> "$out/bench.err" ||
        failed=$((failed + 1))
    done
  done
done
row bench "failed runs: $failed" "$(($(date +%s) - s)) s"

python3 - "$out" <<'PY'
import sys, glob, collections, statistics
out = sys.argv[1]
t = collections.defaultdict(list)
for path in glob.glob(f"{out}/topk_*_*.csv"):
    for line in open(path):
        f = line.strip().split(",")
        if len(f) >= 5 and (f[0].startswith("top_k") or f[0].startswith("indexer")):
            try:
                t[(f[0], int(f[1]), int(f[2]))].append(float(f[4]))
            except ValueError:
                pass
cols = ["top_k", "top_k_prefetch", "top_k_quantile", "top_k_prefetch_s4", "top_k_quantile_s4",
        "top_k_prefetch_s2", "top_k_quantile_s2", "indexer_wgmma_prefetch",
        "indexer_wgmma_quantile", "indexer_read"]
print("| batch | context | " + " | ".join(cols) + " |")
print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
for b, c in sorted({(k[1], k[2]) for k in t}):
    cells = [f"{statistics.mean(t[(n, b, c)]):.2f}" if t.get((n, b, c)) else "-" for n in cols]
    print(f"| {b} | {c} | " + " | ".join(cells) + " |")
PY
[ -f "$out/trace_topk.csv" ] && {
  python3 tools/gpu/trace_summary.py "$out/trace_topk.csv" --phases
  python3 tools/gpu/topk_phases.py "$out/trace_topk.csv"
} > "$out/trace_topk.md"
for f in "$out"/topk_*_*.csv; do
  [ -f "$f" ] || continue
  sed "s/^/topk69_$(basename "$f" .csv),/" "$f"
  rm -f "$f"
done > "$out/topk69.csv"
printf '%s\n' "${rows[@]}"
