#!/usr/bin/env bash
# Issue 27's lanes on the GPU machine's host (16 cores: the default there is 4 lanes): the lane
# tests (several lanes over tcp and shm, a corrupted page on one lane, one lane's endpoint closed
# mid-transfer, identical bytes with 1 and 4 lanes, the transfer metrics) and the full-protocol
# benchmark with 1, 2, 4 and 8 lanes over UCX tcp and shm,self. Host-side only: no GPU is used.
#
# Pack here (after `cmake --build build --target kv_transfer_bench pdserve_kvtransfer_tests`):
#   tools/gpu/pack_binaries.sh .device-carry/lanes build/bench/kvtransfer/kv_transfer_bench \
#     build/tests/kvtransfer/pdserve_kvtransfer_tests "$(command -v ucx_info)"
# There, from the repository root:
#   bash tools/gpu/run_lanes.sh [pack dir (.device-carry/lanes)]
# Logs under $OUT (default ./gpu-out/lanes); prints the benchmark table last. Expected run time
# about 2 minutes (16 benchmark runs of 3 x 1 GiB, plus ~30 s of tests). Exit 0 when the tests
# passed and every benchmark run gave a figure.
set -uo pipefail
pack=$(readlink -f "${1:-.device-carry/lanes}")
out=${OUT:-gpu-out/lanes}
mkdir -p "$out"
# shellcheck source=/dev/null
source "$pack/env.sh"
status=0
# The process tests exec kv_test_peer by the path baked in at build time; only the in-process
# lane and metrics tests run here.
if ! pdserve_kvtransfer_tests --gtest_filter='*Lane*:*TransferMetrics*' >"$out/tests.log" 2>&1; then
  status=1
fi
tests=$(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$out/tests.log" | tr '\n' ' ')
mkdir -p "$pack/build/bench/kvtransfer"
ln -sf "$pack/bin/kv_transfer_bench" "$pack/build/bench/kvtransfer/kv_transfer_bench"
bash bench/kvtransfer/run_lanes_bench.sh "$pack/build" 2 1024 1 2 4 8 >"$out/bench.md" 2>"$out/bench.err"
if grep -qE '\| 0\.000 \|' "$out/bench.md"; then status=1; fi
echo "lane tests: $tests (log: $out/tests.log)"
cat "$out/bench.md"
exit $status
