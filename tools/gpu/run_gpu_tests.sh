#!/usr/bin/env bash
# On a machine with an NVIDIA Hopper GPU and CUDA 13, from the repository root: builds
# kernels/cuda on its own and runs its GPU tests, then runs the GPU engine test packed by
# tools/gpu/pack_engine_tests.sh (when present), and the packed sampler_gpu_tests. Logs under $OUT (default ./gpu-out); a summary
# is printed last. Environment: PACK (the packed folder, default .device-carry/gpu), KFILTER /
# EFILTER (ctest -R / --gtest_filter), SKIP_KERNELS=1. NVLink multicast stays off for the NCCL
# tests (NCCL_NVLS_ENABLE=0), which load the machine's own libnccl.so.2 (found below).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out}
pack=${PACK:-.device-carry/gpu}
mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; "$nvcc" --version | tail -1; } > "$out/env.txt" 2>&1
summary=()
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  b=/tmp/pdserve-build-cuda
  if cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" > "$out/configure.log" 2>&1 &&
     cmake --build "$b" -j"$(nproc)" > "$out/build.log" 2>&1; then
    ctest --test-dir "$b" -L gpu --output-on-failure --timeout 300 -j4 ${KFILTER:+-R "$KFILTER"} > "$out/kernels.log" 2>&1
    grep -E "^\[  FAILED|Failure|Expected|Which is|seed" "$out/kernels.log" | head -30
    summary+=("kernels: $(grep -E 'tests passed' "$out/kernels.log")")
  else
    grep -m20 -E "error" "$out/build.log"; summary+=("kernels: BUILD FAILED")
  fi
fi
if [ -f "$pack/libs.tar.xz" ]; then
  mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
  cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  chmod +x "$pack/bin/engine_gpu_tests"
  LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-} PDSERVE_SOURCE_DIR=$PWD \
    timeout 500 "$pack/bin/engine_gpu_tests" ${EFILTER:+--gtest_filter="$EFILTER"} > "$out/engine.log" 2>&1
  rc=$?
  grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/engine.log" | head -30
  grep -E "rows, argmax" "$out/engine.log"
  summary+=("engine: rc=$rc $(grep -E '^\[  PASSED' "$out/engine.log") $(grep -E '^\[  FAILED  \] [0-9]+ test' "$out/engine.log")")
  if [ -f "$pack/bin/sampler_gpu_tests" ]; then
    chmod +x "$pack/bin/sampler_gpu_tests"
    LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-} \
      timeout 500 "$pack/bin/sampler_gpu_tests" > "$out/sampler.log" 2>&1
    rc=$?
    grep -E "^\[  FAILED|Failure|^sampler_gpu " "$out/sampler.log" | head -30
    summary+=("sampler: rc=$rc $(grep -E '^\[  PASSED' "$out/sampler.log") $(grep -E '^\[  FAILED  \] [0-9]+ test' "$out/sampler.log")")
  fi
fi
printf '%s\n' "${summary[@]}"
