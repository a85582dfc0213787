#!/usr/bin/env bash
# Packs the GPU engine tests (engine_gpu_tests, sampler_gpu_tests; built here by `make build` where
# nvcc is found) with the shared libraries a CUDA machine without this project's Debian packages
# lacks (absl, OpenBLAS and theirs; not libc / libstdc++ / cuBLAS), for tools/gpu/run_gpu_tests.sh
# and tools/gpu/run_sampler_tests.sh there.
# Usage: tools/gpu/pack_engine_tests.sh [build dir] [output dir]  (default: build .device-carry/gpu)
set -euo pipefail
build=${1:-build}
out=${2:-.device-carry/gpu}
bins=("$build/tests/engine_gpu/engine_gpu_tests" "$build/tests/engine_gpu/sampler_gpu_tests")
for bin in "${bins[@]}"; do
  [ -x "$bin" ] || { echo "no $bin: build it first (make build, with nvcc installed)" >&2; exit 1; }
done
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib"
for bin in "${bins[@]}"; do
  cp "$bin" "$out/bin/" && strip "$out/bin/$(basename "$bin")"
done
for bin in "${bins[@]}"; do ldd "$bin"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux|libpthread|libdl|librt|libcublas(Lt)?)\.so' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
strip --strip-unneeded "$out"/lib/*.so* 2>/dev/null || true
tar -C "$out" -cJf "$out/libs.tar.xz" lib && rm -rf "$out/lib"
du -sh "$out"
