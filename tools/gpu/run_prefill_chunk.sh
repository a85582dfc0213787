#!/usr/bin/env bash
# The two prefill changes of 2026-12-04 that were written without device time, checked and
# timed on one H200 in one device call of at most ~150 s (docs/engine-gpu.md, "Prompt chunks"
# and "Prompt chunks' logits"):
#   1. engine_gpu_tests: GpuModelTest.LastRowLogitsAreTheLastRowOfAllRows (ChunkLogits::kLastRow
#      equals the last row of kAllRows bit for bit), ServingChunkLogitsTest, and with
#      PDSERVE_GPU_CHUNK_LOGITS=last the serving paths' tests (GpuPrefillTest.* with its
#      WholeChunkBlockDecodesToTheCpuPrefillsTokens, a 256-token block; GpuStepRunnerTest.*;
#      GpuDirectImportTest.*; GpuServeTest.*).
#   2. prefill_chunk_bench: a 4K and a 16K prompt through Forward calls cut at 64 / 256 / 1024 /
#      4096 tokens, all logits rows or the last only (V4-Flash attention and dense shapes, vocab
#      129280, few experts: a lower bound on what larger blocks save).
# Built on the Debian machine and packed into this folder:
#   cmake --build build --target engine_gpu_tests prefill_chunk_bench
#   tools/gpu/pack_binaries.sh <hx>/chunk build/tests/engine_gpu/engine_gpu_tests \
#     build/bench/ep/prefill_chunk_bench
#   (cd <hx> && tar -cf - chunk | xz -6 -T0 > chunk.tar.xz && rm -rf chunk)
# with the repository's tests/fixtures and models/kjv-v4-tiny beside tools/ (the engine tests
# read them through PDSERVE_SOURCE_DIR). Run from that folder:
#   OUT=<dir> bash tools/gpu/run_prefill_chunk.sh
# Environment: OUT (gpu-out/chunk), LENGTHS (4096,16384), BLOCKS (64,256,1024,4096), LAYERS (4),
# EXPERTS (16), BUDGET (150 s: each step's timeout is cut to what is left). The tables are last.
set -uo pipefail
out=${OUT:-gpu-out/chunk}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-150}
cap() {
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
elapsed() { echo "$(($(date +%s) - t0)) s"; }
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
export NCCL_NVLS_ENABLE=0

[ -d chunk ] || tar -xJf chunk.tar.xz
# shellcheck disable=SC1091
source chunk/env.sh
nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl
echo "cores $(nproc); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

tests() {  # tests NAME ENV FILTER LIMIT
  local name=$1 env=$2 filter=$3 limit=$4
  env "$env" PDSERVE_SOURCE_DIR="$PWD" timeout "$(cap "$limit")" engine_gpu_tests \
    --gtest_filter="$filter" > "$out/tests-$name.txt" 2>&1
  local rc=$?
  row "engine GPU tests: $name" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
    "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/tests-$name.txt" | tr '\n' ' ') ($(elapsed))"
  grep -E '^\[  FAILED  \] [A-Z]|Failure$|Expected|Which is' "$out/tests-$name.txt" | head -20
}
tests last-row PDSERVE_GPU_CHUNK_LOGITS=all '*LastRowLogits*:ServingChunkLogits*' 30
tests serving-last PDSERVE_GPU_CHUNK_LOGITS=last \
  'GpuPrefillTest.*:GpuStepRunnerTest.*:*GpuDirectImportTest*:GpuBackendTest.*' 70

timeout "$(cap 60)" prefill_chunk_bench --layers "${LAYERS:-4}" --experts "${EXPERTS:-16}" \
  --lengths "${LENGTHS:-4096,16384}" --blocks "${BLOCKS:-64,256,1024,4096}" --logits all,last \
  --repeats 2 > "$out/bench.txt" 2> "$out/bench.err"
rc=$?
row "prefill_chunk_bench" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
  "$(grep -cE '^\| [0-9]' "$out/bench.txt") rows ($(elapsed))"
[ $rc = 0 ] || tail -5 "$out/bench.err"

echo
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo
cat "$out/bench.txt"
