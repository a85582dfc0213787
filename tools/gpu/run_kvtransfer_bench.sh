#!/usr/bin/env bash
# Runs bench/kvtransfer/run_kvtransfer_bench.sh with the binaries and libraries packed by
# tools/gpu/pack_kvtransfer_bench.sh (for a machine without UCX installed), from the repository root.
# Usage: tools/gpu/run_kvtransfer_bench.sh [pack dir] [rounds] [page KiB ...]
set -euo pipefail
pack=$(readlink -f "${1:-.device-carry/kvtransfer}")
shift || true
export PATH=$pack/bin:$PATH
export LD_LIBRARY_PATH=$pack/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_MODULE_DIR=$pack/lib/ucx
chmod +x "$pack"/bin/* "$pack"/build/bench/kvtransfer/kv_transfer_bench
exec bash bench/kvtransfer/run_kvtransfer_bench.sh "$pack/build" "$@"
