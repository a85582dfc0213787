#!/usr/bin/env bash
# Packs what tools/gpu/run_ep_proof.sh runs on a GPU machine (issue 11: expert parallelism and PD
# across GPUs): pdserve, ep_bench and engine_gpu_tests built here (`cmake --build build --target
# pdserve ep_bench engine_gpu_tests`, with nvcc and nccl.h present) with their shared libraries
# (tools/gpu/pack_binaries.sh; NCCL is not packed: it is loaded at run time from the GPU
# machine's own libnccl.so.2), compressed into one pack.tar.xz (~15 MB), plus the tools/gpu
# scripts, so a checkout that lacks them can run them from the pack.
# Usage: tools/gpu/pack_ep_proof.sh [build dir] [output dir]  (default: build .device-carry/ep)
set -euo pipefail
build=${1:-build}
out=${2:-.device-carry/ep}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$here/pack_binaries.sh" "$tmp/pack" "$build/pdserve" "$build/bench/ep/ep_bench" \
  "$build/tests/engine_gpu/engine_gpu_tests" > /dev/null
rm -rf "$out" && mkdir -p "$out/tools"
tar -C "$tmp" -cJf "$out/pack.tar.xz" pack
cp "$here"/run_ep_proof.sh "$here"/run_pd_cuda_e2e.sh "$out/tools/"
du -sh "$out"
