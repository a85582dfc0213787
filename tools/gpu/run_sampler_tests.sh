#!/usr/bin/env bash
# On a machine with an NVIDIA Hopper GPU and CUDA 13, from the repository root: the on-device
# sampler's GPU tests, then a short table. (1) builds kernels/cuda on its own and runs its
# SamplingTest cases (tests/kernels_cuda/sampling_test.cc); (2) runs sampler_gpu_tests from the
# folder tools/gpu/pack_engine_tests.sh packed here (the GPU sampler against serving::SampleToken
# over the parameter grid; prints mismatch counts); (3) runs engine_gpu_tests' step-runner tests
# (device vs host sampling in the CUDA runner, and the GPU runner against the CPU runner).
# Logs under $OUT (default ./gpu-out). Environment: PACK (default .device-carry/gpu),
# SKIP_KERNELS=1 (skip step 1), LIBS (where the packed libraries are unpacked, default
# /tmp/pdserve-libs). Exit status: 0 when every step passed.
set -uo pipefail
out=${OUT:-gpu-out}
pack=${PACK:-.device-carry/gpu}
mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
rows=()
status=0
row() { rows+=("$(printf '%-40s %-6s %s' "$1" "$2" "$3")"); [ "$2" = PASS ] || status=1; }

if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  b=/tmp/pdserve-build-cuda
  if cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_CUDA_COMPILER="$nvcc" > "$out/sampler-configure.log" 2>&1 &&
     cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests > "$out/sampler-build.log" 2>&1; then
    ctest --test-dir "$b" --no-tests=error -R 'SamplingTest\.' --output-on-failure --timeout 300 > "$out/sampler-kernels.log" 2>&1
    rc=$?
    row "kernels SamplingTest (standalone)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
      "$(grep -E 'tests passed' "$out/sampler-kernels.log")"
  else
    grep -m20 -E "error" "$out/sampler-build.log"
    row "kernels SamplingTest (standalone)" FAIL "build failed: $out/sampler-build.log"
  fi
fi

if [ -f "$pack/libs.tar.xz" ]; then
  libs=${LIBS:-/tmp/pdserve-libs}
  mkdir -p "$libs" && tar -xJf "$pack/libs.tar.xz" -C "$libs"
  cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  export LD_LIBRARY_PATH=$libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-}
  export PDSERVE_SOURCE_DIR=$PWD
  for name in sampler_gpu_tests engine_gpu_tests; do
    bin=$pack/bin/$name
    if [ ! -f "$bin" ]; then row "$name" FAIL "not in $pack (run tools/gpu/pack_engine_tests.sh)"; continue; fi
    chmod +x "$bin"
    filter='*'
    [ "$name" = engine_gpu_tests ] && filter='GpuStepRunnerTest.*'
    timeout 500 "$bin" --gtest_filter="$filter" > "$out/$name.log" 2>&1
    rc=$?
    grep -E "^\[  FAILED|Failure|Expected|Which is|mismatch" "$out/$name.log" | head -30
    row "$name ($filter)" "$([ $rc = 0 ] && echo PASS || echo FAIL)" \
      "rc=$rc $(grep -E '^\[  (PASSED|SKIPPED) |^\[  FAILED  \] [0-9]+ test' "$out/$name.log" | tr '\n' ' ')"
  done
  grep -h "^sampler_gpu " "$out/sampler_gpu_tests.log" 2>/dev/null
else
  row "packed GPU tests" FAIL "no $pack/libs.tar.xz (run tools/gpu/pack_engine_tests.sh here first)"
fi
printf '%-40s %-6s %s\n' test result detail
printf '%s\n' "${rows[@]}"
exit $status
