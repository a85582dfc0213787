#!/usr/bin/env bash
# One device-machine call: standalone build of kernels/cuda, the GPU tests, then the benchmark
# against PyTorch. Logs go to $OUT (or ./out); the Markdown table is printed last.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
if ! { cmake -S kernels/cuda -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release &&
       cmake --build build-cuda -j16; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -i "warning" "$out/build.log" | head -5
(cd build-cuda && timeout 150 ctest --output-on-failure -L gpu) >"$out/ctest.log" 2>&1
grep -E "Failure|error|Expected|Which is|seed|tests passed|tests failed|Failed|\*\*\*" "$out/ctest.log" | head -60
tail -3 "$out/ctest.log"
PYTHONUNBUFFERED=1 timeout 200 python3 bench/cuda/compare.py \
  --bench build-cuda/bench/pdserve_cuda_bench 2>&1 | tee "$out/bench.md"
