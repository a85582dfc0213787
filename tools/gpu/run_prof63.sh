#!/usr/bin/env bash
# Where the decode kernels of issues 25 and 30 spend their time, in one device call (<= ~560 s):
# 1. decode_bench's dense shapes at 16-128 tokens: the dispatch (fp8 / w8a16), the wgmma kernel
#    alone, the read floor and TmaStreamKernel with the activation boxes (streamx: the ring of the
#    W8A8 wgmma kernel without its math) -> bench.csv;
# 2. Nsight Compute (one launch each, caches as the graph left them, clocks not locked; sections
#    SpeedOfLight, Occupancy, LaunchStats, WarpStateStats, SchedulerStats, MemoryWorkloadAnalysis,
#    SourceCounters) of the wgmma GEMM at 32 and 128 tokens (W8A8 and W8A16), the W8A16 mma.sync
#    GEMM at 1 token, the sparse decode attention's split kernel at 32 x 32K and the select top-k
#    at 32 x 128K (its bench needs more than an H100's 80 GB) -> ncu_<case>.txt;
# 3. what time is left: the engine's GPU suite with the Sinkhorn default (tools/gpu/run_sk62.sh),
#    when .device-carry/hcpre59.tar.xz was carried too.
# Here:
#   cmake --build build --target pdserve_decode_bench pdserve_cuda_bench
#   tmp=$(mktemp -d) && tools/gpu/pack_binaries.sh $tmp/prof63 build/bench/cuda/pdserve_decode_bench \
#     build/bench/cuda/pdserve_cuda_bench && (cd $tmp && tar -cJf "$PWD/.device-carry/prof63.tar.xz" prof63)
#   (or: tools/gpu/run_prof63.sh pack)
# There (carry .device-carry/prof63.tar.xz [and hcpre59.tar.xz]): OUT=<dir> bash tools/gpu/run_prof63.sh
# PROF_CASES='attn|topk' (an extended regex of case names): only those ncu cases, no bench.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry prof63 build/bench/cuda/pdserve_decode_bench build/bench/cuda/pdserve_cuda_bench
  exit $?
fi
out=${OUT:-gpu-out/prof63}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
[ -f .device-carry/prof63.tar.xz ] ||
  { echo "FAIL: no .device-carry/prof63.tar.xz (run 'tools/gpu/run_prof63.sh pack' here)"; exit 2; }
unpack .device-carry/prof63
ncu_bin=$(command -v ncu || find /usr/local -maxdepth 4 -name ncu -type f 2>/dev/null | head -1)
declare -A step

s=$SECONDS
[ -n "${PROF_CASES:-}" ] && touch "$out/bench.csv" ||  # PROF_CASES set: only those ncu cases
PDSERVE_DECODE_TOKENS=16,32,64,128 \
  PDSERVE_DECODE_ROWS=read,fp8,w8a16,fp8_wgmma,w8a16_wgmma,streamx_4.264,streamx_8.264 \
  timeout -k 5 120 pdserve_decode_bench gemm > "$out/bench.csv" 2> "$out/bench.err"
step[bench]="rc=$? $((SECONDS - s)) s"

# ncu <case> <regex> <skip> <env...> -- <command...>
profile() {
  local name=$1 regex=$2 skip=$3
  # PROF_CASES: an extended regex of the case names to run (default: all)
  [[ -z "${PROF_CASES:-}" || $name =~ ${PROF_CASES} ]] || return 0
  shift 3
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local t=$SECONDS
  env "${envs[@]}" timeout -k 5 90 "$ncu_bin" --kernel-name-base demangled \
    --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 --clock-control none \
    --cache-control none \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    --print-details all "$@" > "$out/ncu_$name.txt" 2> "$out/ncu_$name.err"
  step[ncu_$name]="rc=$? $((SECONDS - t)) s"
}
if [ -n "$ncu_bin" ]; then
  for tok in 128 32; do
    profile "fp8_wq_b_$tok" Fp8WgmmaKernel 6 PDSERVE_DECODE_SHAPES=wq_b PDSERVE_DECODE_TOKENS=$tok \
      PDSERVE_DECODE_ROWS=fp8_wgmma -- pdserve_decode_bench gemm
    profile "w8a16_wq_b_$tok" Fp8WgmmaKernel 6 PDSERVE_DECODE_SHAPES=wq_b \
      PDSERVE_DECODE_TOKENS=$tok PDSERVE_DECODE_ROWS=w8a16_wgmma -- pdserve_decode_bench gemm
  done
  profile w8a16_wo_b_32 Fp8WgmmaKernel 6 PDSERVE_DECODE_SHAPES=wo_b PDSERVE_DECODE_TOKENS=32 \
    PDSERVE_DECODE_ROWS=w8a16_wgmma -- pdserve_decode_bench gemm
  profile w8a16_wo_b_1 BlockScaledGemm 6 PDSERVE_DECODE_SHAPES=wo_b PDSERVE_DECODE_TOKENS=1 \
    PDSERVE_DECODE_ROWS=w8a16 -- pdserve_decode_bench gemm
  profile attn_32x32k "SparseDecodeSplitKernel<(true|\\(bool\\)1)" 6 PDSERVE_BENCH_TIMING=graph \
    PDSERVE_BENCH_ONLY=attention -- pdserve_cuda_bench 32 32768
  profile topk_32x128k "TopKSelectKernel<(true|\\(bool\\)1)>" 20 PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=indexer \
    -- pdserve_cuda_bench 32 131072
else
  step[ncu]="no ncu on this machine"
fi

if [ -f .device-carry/hcpre59.tar.xz ] && [ $((560 - (SECONDS - start))) -gt 150 ]; then
  s=$SECONDS
  OUT="$out/sk62" BUDGET=$((540 - (SECONDS - start))) bash tools/gpu/run_sk62.sh > "$out/sk62.log" 2>&1
  step[sk62]="rc=$? $((SECONDS - s)) s"
fi

# The bench as a table: us (% of the read floor of the same bytes) per shape and token count.
python3 - "$out/bench.csv" <<'EOF'
import collections, sys
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) != 5 or f[0] == "kernel":
        continue
    rows.setdefault((f[1], int(f[2])), {})[f[0]] = float(f[3])
cols = ["read", "fp8", "w8a16", "fp8_wgmma", "w8a16_wgmma", "streamx_4.264", "streamx_8.264"]
print("| shape | tokens | " + " | ".join(cols) + " |")
print("| --- | --- |" + " --- |" * len(cols))
for (shape, tok), r in rows.items():
    floor = r.get("read")
    cells = []
    for c in cols:
        v = r.get(c)
        cells.append("-" if v is None else
                     (f"{v:.1f}" if c == "read" or not floor else f"{v:.1f} ({100 * floor / v:.0f}%)"))
    print(f"| {shape} | {tok} | " + " | ".join(cells) + " |")
EOF
# The ncu figures that say where the time goes.
for f in "$out"/ncu_*.txt; do
  [ -s "$f" ] || continue
  echo "== $(basename "$f" .txt)"
  grep -E '^\s+(Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Block Limit (Registers|Shared Mem)|Dynamic Shared Memory Per Block|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Warp Cycles Per Issued Instruction|Issued Warp Per Scheduler|No Eligible|Grid Size)\b' "$f" |
    sed 's/  */ /g' | head -16
done
for k in "${!step[@]}"; do printf '%-22s %s\n' "$k" "${step[$k]}"; done | sort
[ -f "$out/sk62.log" ] && tail -6 "$out/sk62.log"
exit 0
