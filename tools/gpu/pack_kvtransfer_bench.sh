#!/usr/bin/env bash
# Packs the state-transfer benchmark (kv_transfer_bench, built here by `make build`) with
# ucx_perftest, ucx_info, the UCX transport modules and every shared library they need beyond
# libc / libstdc++, so that bench/kvtransfer/run_kvtransfer_bench.sh runs on a machine without
# this project's Debian packages (the device machine: no UCX there). On that machine:
#   bash tools/gpu/run_kvtransfer_bench.sh [pack dir] [rounds] [page KiB ...]
# Usage: tools/gpu/pack_kvtransfer_bench.sh [build dir] [output dir]
#   (default: build .device-carry/kvtransfer)
set -euo pipefail
build=${1:-build}
out=${2:-.device-carry/kvtransfer}
bench=$build/bench/kvtransfer/kv_transfer_bench
[ -x "$bench" ] || { echo "no $bench: build it first (make build)" >&2; exit 1; }
bins=("$bench" "$(command -v ucx_perftest)" "$(command -v ucx_info)")
moddir=$(dirname "$(readlink -f "$(ldconfig -p | awk '/libucs.so.0 / {print $NF; exit}')")")/ucx
rm -rf "$out" && mkdir -p "$out/build/bench/kvtransfer" "$out/bin" "$out/lib/ucx"
cp "$bench" "$out/build/bench/kvtransfer/"
cp "${bins[1]}" "${bins[2]}" "$out/bin/"
# Only the shared-memory helper module: the InfiniBand ones need verbs libraries.
cp -L "$moddir"/libuct_cma.so.0 "$out/lib/ucx/"
for f in "${bins[@]}" "$moddir"/libuct_cma.so.0; do ldd "$f"; done | awk '$3 ~ /^\// {print $3}' |
  sort -u | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux|libpthread|libdl|librt)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
strip --strip-unneeded "$out"/lib/*.so* "$out"/lib/ucx/*.so* "$out"/bin/* \
  "$out"/build/bench/kvtransfer/kv_transfer_bench 2>/dev/null || true
du -sh "$out"
