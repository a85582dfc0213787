#!/usr/bin/env bash
# Fp8WgmmaConfig::max_registers (issue 25): the wgmma GEMM built with at most 96 / 128 registers
# a thread, so that 3-4 blocks fit on a multiprocessor at 16-64 tokens instead of 2-3, in one
# device call (<= BUDGET s, default 480): wgmma GEMM GPU tests (the capped builds' bits against
# the uncapped build, every token tile, splits, configs, extreme scales; the attention, indexer,
# top-k and MoE tests, whose shared-memory attribute is now set per device), decode_bench's dense
# shapes at 8-64 tokens with the default config, capped at 128 and 96, and with more target
# blocks; the engine's GPU suite with
# PDSERVE_FP8_WGMMA capped at 128; one V4-Flash layer's decode GEMMs (decode_bench layer) with the
# default config and capped at 128 and 96; the engine suite capped at 96 while time is left; the
# tables last (us and % of the read floor of the same bytes; raw rows in $OUT/*.csv).
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests pdserve_decode_bench engine_gpu_tests
#   tools/gpu/run_cap63.sh pack            # .device-carry/cap63.tar.xz
# There (carry .device-carry/cap63.tar.xz): OUT=<dir> [BUDGET=s] [QUICK=1] bash tools/gpu/run_cap63.sh
# QUICK=1 (<= ~150 s): the capped tests and two basic ones, the attention / top-k / indexer / MoE
# tests, the bench at 16-64 tokens with the default config and capped at 128 / 96; nothing else.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry cap63 build/tests/kernels_cuda/pdserve_kernels_cuda_tests \
    build/bench/cuda/pdserve_decode_bench build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
out=${OUT:-gpu-out/cap63}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
# Seconds a step may take: at most $1, and what is left of BUDGET (default 480) s since the start.
cap() {
  local left=$((${BUDGET:-480} - (SECONDS - start)))
  [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"
}
q() { if [ -n "${QUICK:-}" ]; then echo "$1"; else echo "$2"; fi; }  # $1 with QUICK set, else $2
[ -f .device-carry/cap63.tar.xz ] ||
  { echo "FAIL: no .device-carry/cap63.tar.xz (run 'tools/gpu/run_cap63.sh pack' here)"; exit 2; }
unpack .device-carry/cap63
s=$SECONDS
gemm_tests='*MaxRegisters*:*WgmmaEveryTokenTileAndOddCounts:*WgmmaTilesSplitsAndConfigs'
[ -n "${QUICK:-}" ] || gemm_tests="$gemm_tests:*WgmmaExtremeScalesAndNonFinite:*WgmmaClusterReduceEqualsTwoPassBitForBit:*WgmmaRefusesASmallWorkspace:*WgmmaConfigsAndTokenTiles"
timeout -k 5 "$(cap "$(q 60 90)")" pdserve_kernels_cuda_tests --gtest_filter="$gemm_tests" \
  > "$out/tests.log" 2>&1
tests="rc=$? $((SECONDS - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
# The kernels whose shared-memory attribute is now set per device (launch_check.h's
# SetMaxDynamicSharedMemory): attention, indexer, top-k, MoE GEMMs.
s=$SECONDS
timeout -k 5 "$(cap "$(q 45 70)")" pdserve_kernels_cuda_tests \
  --gtest_filter='*SparseDecode*:*TopK*:*Indexer*:*Moe*' > "$out/tests_attr.log" 2>&1
tests_attr="rc=$? $((SECONDS - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests_attr.log" | tr '\n' ' ')"
s=$SECONDS
# Variants: the default config (0,0,264 smem scales, register weights), capped at 128 and 96,
# and capped with 3 / 4 blocks' worth of target blocks.
v="0,0,264,0,1,1;0,0,264,0,1,1,0,0,0,0,0,128;0,0,264,0,1,1,0,0,0,0,0,96"
[ -n "${QUICK:-}" ] || v="$v;0,0,396,0,1,1,0,0,0,0,0,128;0,0,528,0,1,1,0,0,0,0,0,96;0,0,396,0,1,1"
tokens=8,16,32,64
[ -z "${QUICK:-}" ] || tokens=16,32,64
PDSERVE_FP8_VARIANTS="$v" PDSERVE_DECODE_TOKENS=$tokens PDSERVE_DECODE_ROWS='read,fp8,w8a16,fp8_v*,w8a16_v*' \
  timeout -k 5 "$(cap "$(q 40 90)")" pdserve_decode_bench gemm > "$out/bench.csv" 2> "$out/bench.err"
bench="rc=$? $((SECONDS - s)) s"
capped128="0,0,264,0,1,1,0,0,0,0,0,128"
capped96="0,0,264,0,1,1,0,0,0,0,0,96"
passed() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '; }
engine=""
layer="not run"
if [ -z "${QUICK:-}" ]; then
s=$SECONDS
PDSERVE_SOURCE_DIR=$PWD PDSERVE_FP8_WGMMA=$capped128 timeout -k 5 "$(cap 100)" engine_gpu_tests \
  > "$out/engine_x128.log" 2>&1
engine="
engine GPU suite, PDSERVE_FP8_WGMMA=$capped128: rc=$? $((SECONDS - s)) s $(passed "$out/engine_x128.log")"
s=$SECONDS
{
  timeout -k 5 "$(cap 45)" pdserve_decode_bench layer > "$out/layer_default.csv"
  PDSERVE_FP8_WGMMA=$capped128 timeout -k 5 "$(cap 45)" pdserve_decode_bench layer \
    > "$out/layer_x128.csv"
  PDSERVE_FP8_WGMMA=$capped96 timeout -k 5 "$(cap 45)" pdserve_decode_bench layer \
    > "$out/layer_x96.csv"
} 2>> "$out/bench.err"
layer="$((SECONDS - s)) s"
if [ "$(cap 100)" -ge 60 ]; then
  s=$SECONDS
  PDSERVE_SOURCE_DIR=$PWD PDSERVE_FP8_WGMMA=$capped96 timeout -k 5 "$(cap 100)" engine_gpu_tests \
    > "$out/engine_x96.log" 2>&1
  engine="$engine
engine GPU suite, PDSERVE_FP8_WGMMA=$capped96: rc=$? $((SECONDS - s)) s $(passed "$out/engine_x96.log")"
fi
fi
grep -E '^\[  FAILED  \]' "$out/tests.log" "$out/tests_attr.log" | head -10
python3 - "$out/bench.csv" <<'PY'
import collections, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) == 5 and f[0] != "kernel" and f[1] != "-":  # "-": the 2 GiB copy, no shape
        rows.setdefault((f[1], int(f[2])), {})[f[0]] = float(f[3])
names = ["0.0.264.s.r", "0.0.264.s.r.x128", "0.0.264.s.r.x96", "0.0.396.s.r.x128",
         "0.0.528.s.r.x96", "0.0.396.s.r"]
for mode in ("w8a16", "fp8"):
    cols = [mode] + [f"{mode}_v{n}" for n in names]
    print(f"\n{mode}: us (% of the read floor)")
    print("| shape | tokens | read | " + " | ".join(c.replace(mode + "_v", "") for c in cols) + " |")
    print("| --- | --- | --- |" + " --- |" * len(cols))
    for (shape, tok), r in rows.items():
        floor = r.get("read")
        cells = ["-" if r.get(c) is None else f"{r[c]:.1f} ({100 * floor / r[c]:.0f}%)" for c in cols]
        print(f"| {shape} | {tok} | {floor:.1f} | " + " | ".join(cells) + " |")
import glob, os
layer = {}
for f in sorted(glob.glob(os.path.join(os.path.dirname(sys.argv[1]), "layer_*.csv"))):
    config = os.path.basename(f)[len("layer_"):-len(".csv")]
    for line in open(f):
        g = line.strip().split(",")
        if len(g) == 5 and g[1] == "layer":
            layer.setdefault((g[0], int(g[2])), {})[config] = float(g[3])
configs = sorted({c for r in layer.values() for c in r}, key=lambda c: (c != "default", c))
print("\none V4-Flash layer's decode GEMMs (decode_bench layer): us per config (% of layer_read)")
print("| part | tokens | " + " | ".join(configs) + " |")
print("| --- | --- |" + " --- |" * len(configs))
for (part, tok), r in sorted(layer.items()):
    if part.startswith("layer_read"):
        continue
    floor = layer.get((part.replace("layer_w8a16", "layer_read").replace("layer_fp8", "layer_read"), tok), {}).get("default")
    cells = ["-" if r.get(c) is None else
             (f"{r[c]:.1f}" + (f" ({100 * floor / r[c]:.0f}%)" if floor else "")) for c in configs]
    print(f"| {part} | {tok} | " + " | ".join(cells) + " |")
PY
echo "tests: $tests"
echo "attention / indexer / top-k / MoE tests: $tests_attr"
echo "bench: $bench"
echo "layer: $layer$engine"
