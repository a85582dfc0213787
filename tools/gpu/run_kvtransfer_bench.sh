#!/usr/bin/env bash
# Runs bench/kvtransfer/run_kvtransfer_bench.sh with the binaries and libraries packed by
# tools/gpu/pack_kvtransfer_bench.sh (for a machine without UCX installed), from the repository root.
# Usage: tools/gpu/run_kvtransfer_bench.sh [pack dir] [rounds] [page KiB ...]
set -euo pipefail
pack=$(readlink -f "${1:-.device-carry/kvtransfer}")
shift || true
# shellcheck source=/dev/null
source "$pack/env.sh"
exec bash bench/kvtransfer/run_kvtransfer_bench.sh "$pack/build" "$@"
