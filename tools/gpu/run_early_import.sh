#!/usr/bin/env bash
# Issue 27, the CUDA decode's early import, on one H200 in one device call of at most ~120 s:
#   1. engine_gpu_tests: GpuModel's staged import (layers in any order, steps of another slot in
#      between) and runtime::EarlyImporter over runtime::GpuSlotImporter against the direct
#      import, state and next-token logits bit for bit; the direct import's own tests; the GPU
#      runner decoding transferred prompts imported early (RunnerOptions::early_import), also
#      while other sequences decode, against the import at the first step, token for token; a
#      slot claimed right after the batch emptied (its reset still pending) and a cancel whose
#      device calls fail (GpuModel::FailDeviceSelectionForTest: the slot's pages still come
#      back); the early import's host state machine (early_import_test).
#   2. gpu_state_transfer_bench (two processes on the GPU, V4-Flash attention shapes, 8 layers,
#      4K / 32K / 128K prompts, UCX_TLS=shm,self, the workers' default lanes and host threads,
#      the prompt chunks' last logits row only) with the early import (--early-import 1: the
#      slot claimed with the ticket, each layer imported as its pages land and pass their
#      checksums) and with the direct import after verification (--early-import 0, today's
#      path), one run each over every length.
# Built on the Debian machine (the device has no UCX) and packed into this folder:
#   cmake --build build --target gpu_state_transfer_bench engine_gpu_tests early_import_test
#   tools/gpu/pack_binaries.sh <hx>/ei build/bench/kvtransfer/gpu_state_transfer_bench \
#     build/tests/engine_gpu/engine_gpu_tests build/tests/runtime/early_import_test
#   (cd <hx> && tar -cf - ei | xz -6 -T0 > ei.tar.xz && rm -rf ei)
# Run from the folder holding tools/ and ei.tar.xz (.hx/<name>/ of a repository whose
# tests/fixtures and models/kjv-v4-tiny the engine tests read, found at ../.. or here):
#   OUT=<dir> bash tools/gpu/run_early_import.sh
# Environment: OUT (gpu-out/early-import), LAYERS (8), BUDGET (118 s:
# every step's timeout is cut to what is left of it). The comparison table is printed last.
set -uo pipefail
out=${OUT:-gpu-out/early-import}
layers=${LAYERS:-8}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
budget=${BUDGET:-118}
# shellcheck source=tools/gpu/round_lib.sh
source "$(dirname "$0")/round_lib.sh"
export NCCL_NVLS_ENABLE=0
unpack ei

# The engine tests' fixtures: this folder's tree if it carries them, else the repository's.
src=$(pwd)
[ -d "$src/tests/fixtures/small_model" ] && [ -d "$src/models/kjv-v4-tiny" ] || src=$(cd ../.. && pwd)
timeout "$(cap 10)" early_import_test > "$out/early_import_test.txt" 2>&1
rc=$?
row "early import state machine (host)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
  "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/early_import_test.txt" | tr '\n' ' ') ($(elapsed))"
nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl PDSERVE_SOURCE_DIR=$src PDSERVE_GPU_CHUNK_LOGITS=last \
  timeout "$(cap 30)" engine_gpu_tests \
  --gtest_filter='*GpuEarlyImportTest*:*GpuDirectImportTest*:GpuStepRunnerTest.DecodesFromATransferredPromptState:GpuStepRunnerTest.EarlyImportWhileOthersDecode:GpuStepRunnerTest.EarlyImportFindsASlotRightAfterTheBatchEmptied' \
  > "$out/engine_gpu_tests.txt" 2>&1
rc=$?
row "engine GPU tests (early import, direct import, runner PD decode; fixtures from $src)" \
  "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
  "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/engine_gpu_tests.txt" | tr '\n' ' ') ($(elapsed))"
grep -E '^\[  FAILED|Failure$|Expected|Which is' "$out/engine_gpu_tests.txt" | head -20

bench_rows=()
# One bench run: early import (1 / 0), the lengths, the longest timeout.
bench() {
  local early=$1 lens=$2 limit=$3
  local name=early$early-$lens
  local log=$out/bench-${name//,/_}.txt
  if ! may; then row "transfer bench, early import $early, $lens" "SKIPPED" "out of time"; return; fi
  UCX_TLS=shm,self timeout "$(cap "$limit")" gpu_state_transfer_bench \
    --layers "$layers" --lengths "$lens" --forward-max 4096 --repeats 3 --old-import 0 \
    --chunk-logits=last --early-import "$early" > "$log" 2> "$out/bench-${name//,/_}.err"
  local rc=$?
  row "transfer bench, early import $early, $lens tokens" \
    "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
    "state equal on $(grep -c '| equal |' "$log") of $(grep -cE '^\| [0-9]' "$log") rows ($(elapsed))"
  [ $rc = 0 ] || tail -3 "$out/bench-${name//,/_}.err"
  while read -r line; do bench_rows+=("$line"); done < <(grep -E '^\| [0-9]' "$log")
}
# Every length in one run per path (each run pays the model setup once); the new path first.
bench 1 4096,32768,131072 45
bench 0 4096,32768,131072 45

echo
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo
if [ ${#bench_rows[@]} -gt 0 ]; then
  echo "Full bench rows (gpu_state_transfer_bench columns):"
  printf '%s\n' "${bench_rows[@]}"
  echo
  echo "Early import (1) against the direct import after verification (0); ms, medians of 3:"
  echo "| import | prompt | MB | send drain | verify lag | import | left after last layer's compute | end-to-end GB/s | copy floor GB/s | share of floor | state |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for line in "${bench_rows[@]}"; do
    IFS='|' read -r -a f <<< "$line"
    # f[1] tokens, f[5] bytes, f[9] send drain, f[10] verify lag, f[13] import, f[15] e2e,
    # f[16] floor, f[17] share, f[19] left after compute, f[21] state, f[26] early import
    echo "|${f[26]}|${f[1]}|${f[5]% MB*} |${f[9]}|${f[10]}|${f[13]}|${f[19]}|${f[15]}|${f[16]}|${f[17]}|${f[21]}|"
  done
fi
