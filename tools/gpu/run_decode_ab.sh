#!/usr/bin/env bash
# A/B of the decode-size FP8 GEMMs (issue 25) in one device call (<= BUDGET s, default 420):
# this build against the build before, and (VARIANT_ENV set) this build again with that
# environment (e.g. PDSERVE_MOE_DIRECT=group):
# 1. the grouped-expert, W8A16 and FP8 GEMM GPU tests (*Moe*, *W8a16*, *Fp8Gemm*);
# 2. one V4-Flash layer's decode GEMMs at TOKENS (default 1,8; decode_bench layer), three runs
#    of each build, interleaved;
# 3. the dense GEMMs at TOKENS (decode_bench gemm, rows read / fp8 / w8a16), twice each (and the
#    variant);
# 4. (ENGINE=1) the engine's GPU suite; the table last (us), the rows in $OUT/$NAME.csv.
# NAME: this build's pack (.device-carry/NAME.tar.xz); BASE: the build before's
# (.device-carry/BASE.tar.xz, its pdserve_decode_bench alone). Here:
#   cmake --build build --target pdserve_decode_bench pdserve_kernels_cuda_tests engine_gpu_tests
#   NAME=x tools/gpu/run_decode_ab.sh pack
# There (carry both): OUT=<dir> NAME=x BASE=y [VARIANT_ENV=K=V] [ENGINE=1]
#   bash tools/gpu/run_decode_ab.sh
# Runs: tools/gpu/run_direct66.sh (NAME direct66), and the calls docs/perf.md names.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
name=${NAME:?NAME, this build pack}
if [ "${1:-}" = pack ]; then
  pack_carry "$name" build/bench/cuda/pdserve_decode_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
base_name=${BASE:?BASE, the pack of the build before}
out=${OUT:-gpu-out/$name}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-420}
unpack ".device-carry/$name"
[ -d ".device-carry/$base_name" ] || tar -xJf ".device-carry/$base_name.tar.xz" -C .device-carry
base=.device-carry/$base_name/bin/pdserve_decode_bench
variant=${VARIANT_ENV:-}

s=$(date +%s)
timeout -k 5 "$(cap 120)" pdserve_kernels_cuda_tests --gtest_filter='*Moe*:*W8a16*:*Fp8Gemm*' \
  > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10

# bench MODE ROUND: this build, its variant (VARIANT_ENV) and the build before, one run each;
# failed counts the runs that did not exit 0.
failed=0
bench() {
  local mode=$1 round=$2
  timeout -k 5 "$(cap 40)" pdserve_decode_bench "$mode" > "$out/${mode}_new_$round.csv" \
    2>> "$out/bench.err" || failed=$((failed + 1))
  if [ -n "$variant" ]; then
    env "$variant" timeout -k 5 "$(cap 40)" pdserve_decode_bench "$mode" \
      > "$out/${mode}_variant_$round.csv" 2>> "$out/bench.err" || failed=$((failed + 1))
  fi
  timeout -k 5 "$(cap 40)" "$base" "$mode" > "$out/${mode}_base_$round.csv" 2>> "$out/bench.err" ||
    failed=$((failed + 1))
}
s=$(date +%s)
export PDSERVE_DECODE_TOKENS=${TOKENS:-1,8}
for round in 1 2 3; do
  may || break
  bench layer "$round"
done
row layer "failed runs: $failed" "$(($(date +%s) - s)) s"

s=$(date +%s)
failed=0
export PDSERVE_DECODE_ROWS=read,fp8,w8a16
for round in 1 2; do
  may || break
  bench gemm "$round"
done
row gemm "failed runs: $failed" "$(($(date +%s) - s)) s"
unset PDSERVE_DECODE_TOKENS PDSERVE_DECODE_ROWS

if [ -n "${ENGINE:-}" ] && [ "$(cap 150)" -ge 60 ]; then
  s=$(date +%s)
  PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(cap 150)" engine_gpu_tests > "$out/engine.log" 2>&1
  row engine "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/engine.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/engine.log" | head -10
fi

echo "== us per layer or call: this build / ${variant:-(no variant)} / the build before (runs)"
python3 - "$out" <<'PY'
import sys, collections, glob, os
out = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(f"{out}/layer_*_*.csv") + glob.glob(f"{out}/gemm_*_*.csv")):
    try:
        mode, tag, _ = os.path.basename(path)[:-4].split("_")
    except ValueError:
        continue
    for line in open(path):
        f = line.strip().split(",")
        if len(f) == 5 and f[0] != "kernel":
            try:
                t[(mode, f[0], f[1], int(f[2]))][tag].append(float(f[3]))
            except ValueError:
                pass
print("| mode | row | shape | tokens | this build | variant | before |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for key in sorted(t):
    r = t[key]
    g = lambda tag: " / ".join(f"{v:.1f}" for v in r.get(tag, [])) or "-"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {g('new')} | {g('variant')} | {g('base')} |")
PY
# One csv back (the device tool returns a few files): NAME_MODE_BUILD_ROUND,kernel,shape,tokens,
# median_us,bytes (BUILD: new, variant or base).
for f in "$out"/layer_*_*.csv "$out"/gemm_*_*.csv; do
  [ -f "$f" ] || continue
  tag=$(basename "$f" .csv)
  grep -v '^kernel,' "$f" | sed "s/^/${name}_$tag,/"
  rm -f "$f"
done > "$out/$name.csv"
printf '%s\n' "${rows[@]}"
