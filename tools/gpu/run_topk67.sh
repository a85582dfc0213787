#!/usr/bin/env bash
# Issue 30: the select top-k (kSelectPrefetch, the default, and kSelectSort) at every blocks-per-row
# count, to choose the automatic count, in one device call (<= BUDGET s, default 240):
# pdserve_cuda_bench in graph timing with PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_SWEEP=1 at
# batch 1, 32 and 128 and context 32K, 64K and 128K (8K, 16K and 32K keys a row), twice each;
# then the CudaTopK* GPU tests. The table last (us, the mean of the two runs); rows in
# $OUT/topk67.csv (TAG,the bench's row).
# Here:
#   cmake --build build --target pdserve_cuda_bench pdserve_kernels_cuda_tests
#   tools/gpu/run_topk67.sh pack      # .device-carry/topk67.tar.xz
# There (carry it): OUT=<dir> bash tools/gpu/run_topk67.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry topk67 build/bench/cuda/pdserve_cuda_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests
  exit $?
fi
out=${OUT:-gpu-out/topk67}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-240}
unpack .device-carry/topk67

failed=0
s=$(date +%s)
for round in 1 2; do
  for context in 32768 65536 131072; do
    for batch in 1 32 128; do
      may || break 3
      PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_SWEEP=1 \
        timeout -k 5 "$(cap 40)" pdserve_cuda_bench "$batch" "$context" \
        > "$out/topk_${round}_${batch}x${context}.csv" 2>> "$out/bench.err" ||
        failed=$((failed + 1))
    done
  done
done
row sweep "failed runs: $failed" "$(($(date +%s) - s)) s"
s=$(date +%s)
timeout -k 5 "$(cap 60)" pdserve_kernels_cuda_tests --gtest_filter='CudaTopK*' > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"

python3 - "$out" <<'PY'
import sys, glob, collections, statistics
out = sys.argv[1]
t = collections.defaultdict(list)
for path in glob.glob(f"{out}/topk_*_*.csv"):
    for line in open(path):
        f = line.strip().split(",")
        if len(f) >= 5 and f[0].startswith("top_k"):
            try:
                t[(f[0], int(f[1]), int(f[2]))].append(float(f[4]))
            except ValueError:
                pass
cols = ["top_k", "top_k_prefetch_b1", "top_k_prefetch_b2", "top_k_prefetch_b3",
        "top_k_prefetch_b4", "top_k_select", "top_k_select_b1", "top_k_select_b2",
        "top_k_select_b3", "top_k_select_b4"]
print("| batch | context | " + " | ".join(cols) + " |")
print("| --- | --- | " + " | ".join("---" for _ in cols) + " |")
for b, c in sorted({(k[1], k[2]) for k in t}):
    cells = [f"{statistics.mean(t[(n, b, c)]):.2f}" if t.get((n, b, c)) else "-" for n in cols]
    print(f"| {b} | {c} | " + " | ".join(cells) + " |")
PY
for f in "$out"/topk_*_*.csv; do
  [ -f "$f" ] || continue
  sed "s/^/topk67_$(basename "$f" .csv),/" "$f"
  rm -f "$f"
done > "$out/topk67.csv"
printf '%s\n' "${rows[@]}"
