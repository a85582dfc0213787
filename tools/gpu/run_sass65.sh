#!/usr/bin/env bash
# Where the W8A16 wgmma decode GEMM's warps wait, instruction by instruction (issue 25): Nsight
# Compute's warp-stall samples per SASS instruction (SourceCounters, source page) of one launch of
# Fp8WgmmaKernel<N, true, false> inside decode_bench's graph, for CASES (default: wq_b at 16 and
# 32 tokens, w2 at 16), in one device call (<= ~150 s). Per case: ncu_<case>.csv (every
# instruction), then a summary: the samples by opcode and the 25 instructions with the most.
# Here:
#   cmake --build build --target pdserve_decode_bench
#   tools/gpu/run_sass65.sh pack      # .device-carry/sass65.tar.xz
# There (carry .device-carry/sass65.tar.xz): OUT=<dir> bash tools/gpu/run_sass65.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry sass65 build/bench/cuda/pdserve_decode_bench
  exit $?
fi
out=${OUT:-gpu-out/sass65}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-200}
unpack .device-carry/sass65
ncu_bin=$(command -v ncu || find /usr/local -maxdepth 4 -name ncu -type f 2>/dev/null | head -1)
[ -n "$ncu_bin" ] || { echo "FAIL: no ncu on this machine"; exit 2; }
for c in ${CASES:-wq_b:16 wq_b:32 w2:16}; do
  shape=${c%%:*}
  tok=${c##*:}
  s=$(date +%s)
  PDSERVE_DECODE_SHAPES=$shape PDSERVE_DECODE_TOKENS=$tok PDSERVE_DECODE_ROWS=w8a16_wgmma \
    timeout -k 5 "$(cap 60)" "$ncu_bin" --kernel-name-base demangled \
    --kernel-name regex:Fp8WgmmaKernel --launch-skip 6 --launch-count 1 --clock-control none \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    pdserve_decode_bench gemm > "$out/ncu_${shape}_$tok.csv" 2> "$out/ncu_${shape}_$tok.err"
  row "ncu $shape $tok" "rc=$?" "$(($(date +%s) - s)) s"
done
for f in "$out"/ncu_*.csv; do
  echo "== $(basename "$f" .csv)"
  python3 - "$f" <<'PY'
import csv, sys, collections
text = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, l in enumerate(text) if l.startswith('"Address"')), None)
if start is None:
    print("(no source table)"); sys.exit()
rows = list(csv.reader(text[start:]))
head = rows[0]
def col(*keys):
    for i, h in enumerate(head):
        if all(k in h for k in keys):
            return i
    return None
src = col("Source")
alls = col("Warp Stall Sampling (All")
noti = col("Warp Stall Sampling (Not")
if src is None or alls is None:
    print("columns:", head[:12]); sys.exit()
def num(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0
body = [r for r in rows[1:] if len(r) == len(head)]
total = sum(num(r[alls]) for r in body) or 1.0
ops = collections.Counter()
for r in body:
    words = r[src].split()
    if words and words[0].startswith("@"):  # a predicate, then the opcode
        words = words[1:]
    ops[words[0] if words else "?"] += num(r[alls])
print("samples", int(total), "instructions", len(body))
print("| opcode | % of samples |")
print("| --- | --- |")
for op, v in ops.most_common(15):
    print(f"| {op} | {100 * v / total:.1f} |")
print("| instruction | % all | % not issued |")
print("| --- | --- | --- |")
for r in sorted(body, key=lambda r: -num(r[alls]))[:25]:
    print(f"| {r[src][:70]} | {100 * num(r[alls]) / total:.1f} | "
          f"{100 * num(r[noti]) / total if noti is not None else 0:.1f} |")
PY
done
printf '%s\n' "${rows[@]}"
