#!/usr/bin/env bash
# Block timelines of the decode kernels of issues 25 and 30 (kernels/cuda/block_trace.h), in one
# device call (<= BUDGET s, default 400): where a short decode kernel's time goes between its
# first block's start and its last block's end, inside the CUDA graph as the benches time it.
# 1. decode_bench gemm, PDSERVE_BLOCK_TRACE: wq_b and w2 at 16 and 64 tokens (read floor, the fp8
#    and w8a16 dispatch, the ring alone: streamx_4.264) -> bench.csv, trace_gemm.csv;
# 2. cuda_bench, graph timing, attention only, PDSERVE_BLOCK_TRACE -> attn.csv, trace_attn.csv;
# 3. the wgmma GEMM and sparse decode GPU tests (the kernels now carry the trace argument);
# 4. (ENGINE=1) the engine's GPU suite; cuobjdump's registers of the instrumented kernels (the trace must not add any);
# the summaries last (tools/gpu/trace_summary.py).
# Here:
#   cmake --build build --target pdserve_decode_bench pdserve_cuda_bench pdserve_kernels_cuda_tests
#   tools/gpu/run_trace64.sh pack      # .device-carry/trace64.tar.xz
# There (carry .device-carry/trace64.tar.xz [and trace64a.tar.xz]): OUT=<dir> [BUDGET=s]
#   bash tools/gpu/run_trace64.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry trace64 build/bench/cuda/pdserve_decode_bench build/bench/cuda/pdserve_cuda_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
out=${OUT:-gpu-out/trace64}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-400}
[ -f .device-carry/trace64.tar.xz ] ||
  { echo "FAIL: no .device-carry/trace64.tar.xz (run 'tools/gpu/run_trace64.sh pack' here)"; exit 2; }
unpack .device-carry/trace64
rm -f "$out/trace_gemm.csv" "$out/trace_attn.csv"

s=$(date +%s)
PDSERVE_BLOCK_TRACE=$out/trace_gemm.csv PDSERVE_DECODE_SHAPES=${SHAPES:-wq_b,wo_b,w13,w2} \
  PDSERVE_DECODE_TOKENS=${TOKENS:-16,64} PDSERVE_DECODE_ROWS=${ROWS:-read,fp8,w8a16,fp8_wgmma_c,w8a16_wgmma_c,streamx_4.264} \
  timeout -k 5 "$(cap 90)" pdserve_decode_bench gemm > "$out/bench.csv" 2> "$out/bench.err"
row gemm "rc=$?" "$(($(date +%s) - s)) s"

# A second build (.device-carry/trace64a.tar.xz, packed the same way under the name trace64a):
# its decode_bench on the same rows without the trace, for a before / after table.
if [ -f .device-carry/trace64a.tar.xz ]; then
  [ -d .device-carry/trace64a ] || tar -xJf .device-carry/trace64a.tar.xz -C .device-carry
  s=$(date +%s)
  PDSERVE_DECODE_SHAPES=${SHAPES:-wq_b,wo_b,w13,w2} PDSERVE_DECODE_TOKENS=${TOKENS:-16,64} \
    PDSERVE_DECODE_ROWS=${ROWS:-read,fp8,w8a16,fp8_wgmma_c,w8a16_wgmma_c,streamx_4.264} \
    timeout -k 5 "$(cap 60)" .device-carry/trace64a/bin/pdserve_decode_bench gemm \
    > "$out/bench_a.csv" 2> "$out/bench_a.err"
  row gemm_a "rc=$?" "$(($(date +%s) - s)) s"
fi

if [ -z "${SKIP_ATTN:-}" ]; then
  s=$(date +%s)
  PDSERVE_BLOCK_TRACE=$out/trace_attn.csv PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=attention \
    timeout -k 5 "$(cap 150)" pdserve_cuda_bench > "$out/attn.csv" 2> "$out/attn.err"
  row attention "rc=$?" "$(($(date +%s) - s)) s"
fi

# LAYER=1: one V4-Flash layer's decode GEMMs (decode_bench layer) with the default config and
# with cluster_reduce (PDSERVE_FP8_WGMMA=0,0,264,1,1,1), this build.
if [ -n "${LAYER:-}" ]; then
  export LC_ALL=C  # join and sort agree on the order
  s=$(date +%s)
  timeout -k 5 "$(cap 60)" pdserve_decode_bench layer > "$out/layer_default.csv" 2>> "$out/bench.err"
  PDSERVE_FP8_WGMMA=0,0,264,1,1,1 timeout -k 5 "$(cap 60)" pdserve_decode_bench layer \
    > "$out/layer_cluster.csv" 2>> "$out/bench.err"
  row layer "rc=$? (the last of its runs)" "$(($(date +%s) - s)) s"
  if [ -x .device-carry/trace64a/bin/pdserve_decode_bench ]; then
    timeout -k 5 "$(cap 60)" .device-carry/trace64a/bin/pdserve_decode_bench layer \
      > "$out/layer_a.csv" 2>> "$out/bench.err"
  fi
fi

s=$(date +%s)
timeout -k 5 "$(cap 100)" pdserve_kernels_cuda_tests \
  --gtest_filter='*Wgmma*:*W8a16*:*SparseDecode*' \
  > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"

# ENGINE=1: the engine's GPU suite with this build's kernels (logits against the CPU engine,
# graph against eager), while the budget allows.
if [ -n "${ENGINE:-}" ] && [ "$(cap 120)" -ge 60 ]; then
  s=$(date +%s)
  PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(cap 120)" engine_gpu_tests > "$out/engine.log" 2>&1
  row engine "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/engine.log" | tr '\n' ' ')"
fi

cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null)
if [ -n "$cuobjdump" ]; then
  "$cuobjdump" -res-usage "$(command -v pdserve_decode_bench)" 2>/dev/null |
    grep -A1 -E 'Function .*(Fp8WgmmaKernelILi(16|32|64)ELb[01]ELb0E|SparseDecodeSplitKernelILb1ELi0E)' |
    grep -oE 'Fp8WgmmaKernelILi[0-9]+ELb[01]ELb[01]E|SparseDecodeSplitKernelILb1ELi0E|REG:[0-9]+' |
    paste - - > "$out/registers.txt"
fi

echo "== GEMM rows (us): this build (traced rows), and the trace64a build where carried"
python3 - "$out/bench.csv" "$out/bench_a.csv" <<'PY'
import sys
def rows(path):
    try:
        return {tuple(f[:3]): float(f[3]) for f in (l.strip().split(",") for l in open(path))
                if len(f) == 5 and f[1] != "-"}
    except OSError:
        return {}
new, old = rows(sys.argv[1]), rows(sys.argv[2])
print("| row | shape | tokens | us | trace64a us |")
print("| --- | --- | --- | --- | --- |")
for k, v in new.items():
    print(f"| {k[0]} | {k[1]} | {k[2]} | {v:.2f} | {old[k]:.2f} |" if k in old else
          f"| {k[0]} | {k[1]} | {k[2]} | {v:.2f} | - |")
PY
echo "== GEMM block timelines"
python3 tools/gpu/trace_summary.py "$out/trace_gemm.csv" --phases
if [ -f "$out/layer_default.csv" ]; then
  echo "== one layer's decode GEMMs (us): default config / cluster_reduce / trace64a's default"
  layer_rows() { awk -F, 'NF==5 && $1 ~ /^layer_/ {print $1":"$3","$4}' "$1" 2>/dev/null | sort; }
  [ -f "$out/layer_a.csv" ] || layer_rows "$out/layer_default.csv" | sed 's/,.*/,-/' > "$out/layer_a.csv"
  join -t, <(layer_rows "$out/layer_default.csv") <(layer_rows "$out/layer_cluster.csv") |
    join -t, - <(if grep -q ',-$' "$out/layer_a.csv"; then cat "$out/layer_a.csv"; else layer_rows "$out/layer_a.csv"; fi) |
    grep -E '^layer_(w8a16|fp8|read)(_dense)?:' | sort -t: -k2 -n
fi
[ -f "$out/trace_attn.csv" ] && echo "== attention block timelines (batch 32 and 128)" &&
python3 tools/gpu/trace_summary.py "$out/trace_attn.csv" --phases --rows '^(csa|hca)_attention(_split|_cluster)?$' |
  grep -E '^\| (row|---)|\| (32|128)x'
echo "== registers"; cat "$out/registers.txt" 2>/dev/null
printf '%s\n' "${rows[@]}"
