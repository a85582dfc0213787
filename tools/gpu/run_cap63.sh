#!/usr/bin/env bash
# Fp8WgmmaConfig::max_registers (issue 25): the wgmma GEMM built with at most 96 / 128 registers
# a thread, so that 3-4 blocks fit on a multiprocessor at 16-64 tokens instead of 2-3, in one
# device call (<= ~300 s): the wgmma GEMM GPU tests (the capped builds' bits against the uncapped
# build, every other wgmma option), then decode_bench's dense shapes at 8-64 tokens with the
# default config, capped at 128 and 96, and with more target blocks; the table last
# (us and % of the read floor of the same bytes; raw rows in $OUT/bench.csv).
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests pdserve_decode_bench
#   tools/gpu/run_cap63.sh pack            # .device-carry/cap63.tar.xz
# There (carry .device-carry/cap63.tar.xz): OUT=<dir> bash tools/gpu/run_cap63.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry cap63 build/tests/kernels_cuda/pdserve_kernels_cuda_tests build/bench/cuda/pdserve_decode_bench
  exit $?
fi
out=${OUT:-gpu-out/cap63}
mkdir -p "$out"
out=$(cd "$out" && pwd)
[ -f .device-carry/cap63.tar.xz ] ||
  { echo "FAIL: no .device-carry/cap63.tar.xz (run 'tools/gpu/run_cap63.sh pack' here)"; exit 2; }
unpack .device-carry/cap63
s=$SECONDS
timeout -k 5 150 pdserve_kernels_cuda_tests \
  --gtest_filter='*MaxRegisters*:CudaFp8GemmTest.*Wgmma*:CudaW8a16GemmTest.*Wgmma*' \
  > "$out/tests.log" 2>&1
tests="rc=$? $((SECONDS - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
s=$SECONDS
# Variants: the default config (0,0,264 smem scales, register weights), capped at 128 and 96,
# and capped with 3 / 4 blocks' worth of target blocks.
v="0,0,264,0,1,1;0,0,264,0,1,1,0,0,0,0,0,128;0,0,264,0,1,1,0,0,0,0,0,96"
v="$v;0,0,396,0,1,1,0,0,0,0,0,128;0,0,528,0,1,1,0,0,0,0,0,96;0,0,396,0,1,1"
PDSERVE_FP8_VARIANTS="$v" PDSERVE_DECODE_TOKENS=8,16,32,64 PDSERVE_DECODE_ROWS='read,fp8,w8a16,fp8_v*,w8a16_v*' \
  timeout -k 5 150 pdserve_decode_bench gemm > "$out/bench.csv" 2> "$out/bench.err"
bench="rc=$? $((SECONDS - s)) s"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10
python3 - "$out/bench.csv" <<'PY'
import collections, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) == 5 and f[0] != "kernel":
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
PY
echo "tests: $tests"
echo "bench: $bench"
