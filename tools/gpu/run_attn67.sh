#!/usr/bin/env bash
# Issue 30 and 25 checks in one device call (<= BUDGET s, default 360):
# 1. GPU tests: the routed experts' grouped GEMM (CudaMoeGemmTest*, with the one-token direct
#    picks' test), the sparse decode attention (CudaSparseDecode*) and the top-k (CudaTopK*);
# 2. the sparse decode attention in graph timing (pdserve_cuda_bench, PDSERVE_BENCH_ONLY=attention):
#    this build (the producer requests the lengths before the query copies; ATTN67=a: its first
#    form, the lookups' prefetch before them too) and the build before (.device-carry/base67a.tar.xz: main 3ebced4), twice each,
#    alternating;
# 3. the top-k at every blocks-per-row count (PDSERVE_BENCH_ONLY=indexer,
#    PDSERVE_BENCH_TOPK_SWEEP=1), this build once (the top-k is main's);
# the tables last (us). Rows: $OUT/attn67.csv (TAG,the bench's row).
# Here:
#   cmake --build build --target pdserve_cuda_bench pdserve_kernels_cuda_tests
#   tools/gpu/run_attn67.sh pack      # .device-carry/attn67.tar.xz (base67a: main's cuda_bench)
# There (carry both): OUT=<dir> bash tools/gpu/run_attn67.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry "attn67${ATTN67:-}" build/bench/cuda/pdserve_cuda_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests
  exit $?
fi
out=${OUT:-gpu-out/attn67}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-360}
unpack ".device-carry/attn67${ATTN67:-}"
[ -d .device-carry/base67a ] || tar -xJf .device-carry/base67a.tar.xz -C .device-carry
base=.device-carry/base67a/bin/pdserve_cuda_bench

s=$(date +%s)
timeout -k 5 "$(cap 120)" pdserve_kernels_cuda_tests \
  --gtest_filter='CudaMoeGemmTest*:CudaSparseDecode*:CudaTopK*' > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10

failed=0
s=$(date +%s)
export PDSERVE_BENCH_TIMING=graph
for round in 1 2; do
  may || break
  PDSERVE_BENCH_ONLY=attention timeout -k 5 "$(cap 70)" pdserve_cuda_bench \
    > "$out/attn_new_$round.csv" 2>> "$out/bench.err" || failed=$((failed + 1))
  PDSERVE_BENCH_ONLY=attention timeout -k 5 "$(cap 70)" "$base" \
    > "$out/attn_base_$round.csv" 2>> "$out/bench.err" || failed=$((failed + 1))
done
row attention "failed runs: $failed" "$(($(date +%s) - s)) s"
s=$(date +%s)
if may; then
  PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_SWEEP=1 timeout -k 5 "$(cap 90)" \
    pdserve_cuda_bench > "$out/topk_new_1.csv" 2>> "$out/bench.err"
  row topk "rc=$?" "$(($(date +%s) - s)) s"
fi

python3 - "$out" <<'PY'
import sys, glob, os, collections
out = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(f"{out}/attn_*_*.csv") + glob.glob(f"{out}/topk_*_*.csv")):
    try:
        kind, tag, _ = os.path.basename(path)[:-4].split("_")
    except ValueError:
        continue
    for line in open(path):
        f = line.strip().split(",")
        if len(f) >= 5:
            try:
                t[(f[0], int(f[1]), int(f[2]))][tag].append(float(f[4]))
            except ValueError:
                pass
print("== attention (graph timing, us): this build / the build before (runs)")
print("| row | batch | context | this build | before |")
print("| --- | --- | --- | --- | --- |")
for key in sorted(t):
    if "attention" not in key[0]:
        continue
    r = t[key]
    g = lambda tag: " / ".join(f"{v:.2f}" for v in r.get(tag, [])) or "-"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {g('new')} | {g('base')} |")
print("== top-k at each blocks-per-row count (us, this build)")
rows = sorted({k[0] for k in t if k[0].startswith("top_k")})
sizes = sorted({(k[1], k[2]) for k in t if k[0].startswith("top_k")})
print("| batch | context | " + " | ".join(rows) + " |")
print("| --- | --- | " + " | ".join("---" for _ in rows) + " |")
for b, c in sizes:
    cells = [f"{t[(r, b, c)]['new'][0]:.2f}" if t[(r, b, c)].get("new") else "-" for r in rows]
    print(f"| {b} | {c} | " + " | ".join(cells) + " |")
PY
for f in "$out"/attn_*_*.csv "$out"/topk_*_*.csv; do
  [ -f "$f" ] || continue
  sed "s/^/attn67_$(basename "$f" .csv),/" "$f"
  rm -f "$f"
done > "$out/attn67.csv"
printf '%s\n' "${rows[@]}"
