#!/usr/bin/env bash
# Packs the state-transfer benchmark (kv_transfer_bench, built here by `make build`) with
# ucx_perftest and ucx_info (tools/gpu/pack_binaries.sh), so that
# bench/kvtransfer/run_kvtransfer_bench.sh runs on a machine without this project's Debian
# packages (the device machine: no UCX there). On that machine:
#   bash tools/gpu/run_kvtransfer_bench.sh [pack dir] [rounds] [page KiB ...]
# Usage: tools/gpu/pack_kvtransfer_bench.sh [build dir] [output dir]
#   (default: build .device-carry/kvtransfer)
set -euo pipefail
build=${1:-build}
out=${2:-.device-carry/kvtransfer}
bench=$build/bench/kvtransfer/kv_transfer_bench
[ -x "$bench" ] || { echo "no $bench: build it first (make build)" >&2; exit 1; }
"$(dirname "$0")"/pack_binaries.sh "$out" "$bench" "$(command -v ucx_perftest)" "$(command -v ucx_info)"
# run_kvtransfer_bench.sh looks for <build>/bench/kvtransfer/kv_transfer_bench.
mkdir -p "$out/build/bench/kvtransfer" && ln -s ../../../bin/kv_transfer_bench "$out/build/bench/kvtransfer/"
