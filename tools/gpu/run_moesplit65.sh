#!/usr/bin/env bash
# The grouped routed experts split k only below kMoeSplitMaxBlocks blocks
# (moe_gemm_workspace.h, issue 25), in one device call (<= BUDGET s,
# default 300):
# 1. the grouped-expert and W8A16 GPU tests (*Moe*, *W8a16*);
# 2. one V4-Flash layer's decode GEMMs (decode_bench layer): this build, then the build before
#    (.device-carry/base65.tar.xz, main before the change, packed as base65), twice each,
#    alternating;
# 3. (ENGINE=1) the engine's GPU suite; the table last (the routed experts' rows and the whole
#    layer's, us).
# Here:
#   cmake --build build --target pdserve_decode_bench pdserve_kernels_cuda_tests engine_gpu_tests
#   tools/gpu/run_moesplit65.sh pack      # .device-carry/moesplit65.tar.xz
# There (carry .device-carry/moesplit65.tar.xz and base65.tar.xz): OUT=<dir> [ENGINE=1]
#   bash tools/gpu/run_moesplit65.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
# shellcheck source=tools/gpu/round_lib.sh
source tools/gpu/round_lib.sh
if [ "${1:-}" = pack ]; then
  pack_carry moesplit65 build/bench/cuda/pdserve_decode_bench \
    build/tests/kernels_cuda/pdserve_kernels_cuda_tests build/tests/engine_gpu/engine_gpu_tests
  exit $?
fi
out=${OUT:-gpu-out/moesplit65}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-300}
unpack .device-carry/moesplit65
[ -d .device-carry/base65 ] || tar -xJf .device-carry/base65.tar.xz -C .device-carry

s=$(date +%s)
timeout -k 5 "$(cap 90)" pdserve_kernels_cuda_tests --gtest_filter='*Moe*:*W8a16*' \
  > "$out/tests.log" 2>&1
row tests "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/tests.log" | head -10

s=$(date +%s)
for round in 1 2; do
  timeout -k 5 "$(cap 40)" pdserve_decode_bench layer > "$out/layer_new_$round.csv" 2>> "$out/bench.err"
  timeout -k 5 "$(cap 40)" .device-carry/base65/bin/pdserve_decode_bench layer \
    > "$out/layer_base_$round.csv" 2>> "$out/bench.err"
done
row layer "rc=$?" "$(($(date +%s) - s)) s"

if [ -n "${ENGINE:-}" ] && [ "$(cap 120)" -ge 60 ]; then
  s=$(date +%s)
  PDSERVE_SOURCE_DIR=$PWD timeout -k 5 "$(cap 120)" engine_gpu_tests > "$out/engine.log" 2>&1
  row engine "rc=$?" "$(($(date +%s) - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/engine.log" | tr '\n' ' ')"
fi

echo "== one layer's decode GEMMs, us: this build (runs 1, 2) / the build before (runs 1, 2)"
python3 - "$out" <<'PY'
import sys, collections
out = sys.argv[1]
t = collections.defaultdict(dict)
for tag in ("new_1", "new_2", "base_1", "base_2"):
    try:
        for line in open(f"{out}/layer_{tag}.csv"):
            f = line.strip().split(",")
            if len(f) == 5 and f[0].startswith("layer_") and not f[0].endswith(("_fused", "_fused_q")):
                t[(f[0], int(f[2]))][tag] = float(f[3])
    except OSError:
        pass
print("| part | batch | this build | before |")
print("| --- | --- | --- | --- |")
for (part, m), r in sorted(t.items(), key=lambda kv: (kv[0][0], kv[0][1])):
    g = lambda a, b: " / ".join(f"{r[k]:.1f}" for k in (a, b) if k in r)
    print(f"| {part} | {m} | {g('new_1', 'new_2')} | {g('base_1', 'base_2')} |")
PY
printf '%s\n' "${rows[@]}"
