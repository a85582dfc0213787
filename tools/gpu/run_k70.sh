#!/usr/bin/env bash
# Issue 30 in one device call (<= BUDGET s, default 380): this build against the build before
# (BASE, default base70: main before the change), both timed in the same call (ALT: a third
# build's pdserve_cuda_bench pack, packed as BASE is, timed with them as "alt"; packed with its
# tests as NAME is, its tests run too).
# 1. GPU tests of this build: the sparse decode attention, the top-k, the indexer (TESTS: a
#    gtest filter instead);
#    (MEMCHECK: a gtest filter also run under compute-sanitizer memcheck; SASS=1: the quantile
#    top-k's machine code and its spills);
# 2. pdserve_cuda_bench in graph timing, this build and the build before alternating, twice each:
#    the attention (PDSERVE_BENCH_ONLY=attention) and the indexer with the top-k's stage rows
#    (PDSERVE_BENCH_ONLY=indexer PDSERVE_BENCH_TOPK_STAGES=1) at the SHAPES (batch x context);
#    WHAT: "attention", "indexer" or both (the default);
# 3. one more run of each build with PDSERVE_BLOCK_TRACE: the attention's and the select top-k's
#    block timelines ($OUT/trace_<what>_<build>.csv, summarized in $OUT/trace.md by
#    tools/gpu/trace_summary.py --phases and tools/gpu/topk_phases.py);
# the tables last (us, the mean of the two runs). Rows: $OUT/k70.csv
# (NAME_<what>_<build>_<round>_<shape>, then the bench's row).
# Here:
#   cmake --build build --target pdserve_cuda_bench pdserve_kernels_cuda_tests
#   tools/gpu/run_k70.sh pack        # .device-carry/k70.tar.xz (NAME=k70)
#   (the build before: its pdserve_cuda_bench alone, NAME=base70 tools/gpu/run_k70.sh pack-base;
#   ENGINE=1 there: the engine's GPU suite too, packed here by tools/gpu/run_k70.sh pack-engine
#   into .device-carry/engine70.tar.xz (ENGINE_NAME: another), carried as well)
# There (carry both): OUT=<dir> bash tools/gpu/run_k70.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
name=${NAME:-k70}
if [ "${1:-}" = pack ]; then
  pack_carry "$name" build/bench/cuda/pdserve_cuda_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests
  exit $?
fi
if [ "${1:-}" = pack-engine ]; then
  pack_carry "${NAME:-engine70}" build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
if [ "${1:-}" = pack-base ]; then
  pack_carry "${NAME:-base70}" build/bench/cuda/pdserve_cuda_bench
  exit $?
fi
start_round k70 380
unpack ".device-carry/$name"
base_name=${BASE:-base70}
[ -d ".device-carry/$base_name" ] || tar -xJf ".device-carry/$base_name.tar.xz" -C .device-carry
base=.device-carry/$base_name/bin/pdserve_cuda_bench
builds="new base"
if [ -n "${ALT:-}" ]; then
  [ -d ".device-carry/$ALT" ] || tar -xJf ".device-carry/$ALT.tar.xz" -C .device-carry
  alt=.device-carry/$ALT/bin/pdserve_cuda_bench
  builds="new alt base"
fi
new=$(command -v pdserve_cuda_bench)
shapes=${SHAPES-32x4096 32x32768 32x131072 128x32768}

s=$(date +%s)
timeout -k 5 "$(cap 120)" pdserve_kernels_cuda_tests \
  --gtest_filter="${TESTS:-CudaSparseDecode*:CudaTopK*:CudaIndexer*}" > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10

# ALT packed with its tests (NAME=<alt> run_k70.sh pack): the same tests of that build too.
if [ -n "${ALT:-}" ] && [ -x ".device-carry/$ALT/bin/pdserve_kernels_cuda_tests" ] && may; then
  s=$(date +%s)
  (
    # shellcheck disable=SC1090
    source ".device-carry/$ALT/env.sh"
    timeout -k 5 "$(cap 120)" ".device-carry/$ALT/bin/pdserve_kernels_cuda_tests" \
      --gtest_filter="${TESTS:-CudaSparseDecode*:CudaTopK*:CudaIndexer*}"
  ) > "$out/tests_alt.log" 2>&1
  row "tests ($ALT)" "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/tests_alt.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/tests_alt.log" | head -10
fi
if [ "${ENGINE:-0}" = 1 ] && may; then  # the engine's GPU suite with this build's kernels
  engine_suite "${ENGINE_NAME:-engine70}" 150
fi
if [ -n "${MEMCHECK:-}" ] && command -v compute-sanitizer > /dev/null && may; then
  s=$(date +%s)  # MEMCHECK: a gtest filter run under compute-sanitizer memcheck
  timeout -k 5 "$(cap 60)" compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$(command -v pdserve_kernels_cuda_tests)" --gtest_filter="$MEMCHECK" > "$out/memcheck.log" 2>&1
  row memcheck "rc=$?" "$(($(date +%s) - s)) s $(grep -E 'ERROR SUMMARY|^\[  PASSED' "$out/memcheck.log" | tr '\n' ' ')"
fi

# SASS=1: the untraced kSelectQuantile kernel's SASS ($OUT/topk_sass.txt) and its local-memory
# (spill) instructions with their neighbours ($OUT/topk_spills.txt)
if [ "${SASS:-0}" = 1 ] && command -v cuobjdump > /dev/null; then
  cuobjdump -sass "$new" 2> /dev/null |
    awk '/Function : .*TopKSelectKernelILb1ELb1ELb0E/ {p = 1} p {print} /^\t\t\.\.\.\.\.\.\.\.\.\./ {p = 0}' \
    > "$out/topk_sass.txt"
  grep -n -B6 -A2 -E 'STL|LDL' "$out/topk_sass.txt" > "$out/topk_spills.txt"
  row sass "$(wc -l < "$out/topk_sass.txt") lines" "$(grep -c -E 'STL|LDL' "$out/topk_sass.txt") STL/LDL"
fi

export PDSERVE_BENCH_TIMING=graph
# bench BUILD WHAT SHAPE OUTPUT [TRACE]: one pdserve_cuda_bench run of BUILD (new or base) with
# PDSERVE_BENCH_ONLY=WHAT at SHAPE (batch x context), rows to OUTPUT, block timelines to TRACE.
bench() {
  local bin=$new
  [ "$1" = base ] && bin=$base
  [ "$1" = alt ] && bin=$alt
  PDSERVE_BENCH_ONLY=$2 PDSERVE_BENCH_TOPK_STAGES=1 PDSERVE_BLOCK_TRACE=${5:-} \
    timeout -k 5 "$(cap 40)" "$bin" "${3%x*}" "${3#*x}" > "$4" 2>> "$out/bench.err"
}
failed=0
s=$(date +%s)
for round in 1 2; do
  for what in ${WHAT:-attention indexer}; do
    for shape in $shapes; do
      for build in $builds; do
        may || break 4
        bench "$build" "$what" "$shape" "$out/${what}_${build}_${round}_${shape}.csv" ||
          failed=$((failed + 1))
      done
    done
  done
done
row bench "failed runs: $failed" "$(($(date +%s) - s)) s"
s=$(date +%s)
for what in ${WHAT:-attention indexer}; do
  for shape in $shapes; do
    for build in $builds; do
      may || break 3
      bench "$build" "$what" "$shape" /dev/null "$out/trace_${what}_${build}.csv"
    done
  done
done
row traces "" "$(($(date +%s) - s)) s"

{
  for build in $builds; do
    f=$out/trace_attention_$build.csv
    [ -f "$f" ] && echo "== attention, $build" &&
      python3 tools/gpu/trace_summary.py "$f" --phases --rows '^(csa|hca)_attention$'
    f=$out/trace_indexer_$build.csv
    [ -f "$f" ] && echo "== top-k, $build" && python3 tools/gpu/topk_phases.py "$f"
  done
} > "$out/trace.md" 2>&1
python3 - "$out" <<'PY'
import sys, glob, os, collections, statistics
out = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for path in glob.glob(f"{out}/*_*_*_*.csv"):
    what, build, _, _ = os.path.basename(path)[:-4].split("_", 3)
    if what not in ("attention", "indexer"):
        continue
    for line in open(path):
        f = line.strip().split(",")
        if len(f) >= 5:
            try:
                t[(f[0], int(f[1]), int(f[2]))][build].append(float(f[4]))
            except ValueError:
                pass
keep = ("csa_attention", "hca_attention", "csa_attention_read", "hca_attention_read", "top_k",
        "indexer_scores_wgmma",
        "top_k_quantile_s2", "top_k_quantile_s4", "indexer_wgmma_quantile", "indexer_read",
        "top_k_capacity", "indexer_wgmma_quantile_capacity")
alt = any("alt" in r for r in t.values())
print("| row | batch | context | this build (runs) | before (runs) | change |"
      + (" alt (runs) | alt change |" if alt else ""))
print("| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if alt else ""))
for key in sorted(t):
    if key[0] not in keep:
        continue
    r = t[key]
    new, base = r.get("new", []), r.get("base", [])
    cell = lambda v: " / ".join(f"{x:.2f}" for x in v) or "-"
    change = (f"{100 * (statistics.mean(new) / statistics.mean(base) - 1):+.1f}%"
              if new and base else "-")
    extra = ""
    if alt:
        other = r.get("alt", [])
        extra = (f" {cell(other)} | "
                 + (f"{100 * (statistics.mean(other) / statistics.mean(base) - 1):+.1f}% |"
                    if other and base else "- |"))
    print(f"| {key[0]} | {key[1]} | {key[2]} | {cell(new)} | {cell(base)} | {change} |{extra}")
PY
for f in "$out"/*_*_*_*.csv; do
  [ -f "$f" ] || continue
  sed "s/^/${name}_$(basename "$f" .csv),/" "$f"
  rm -f "$f"
done > "$out/k70.csv"
printf '%s\n' "${rows[@]}"
