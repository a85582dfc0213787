#!/usr/bin/env bash
# One device-machine call for the FP8 GEMMs at decode sizes (issue 25's decode goal), from the
# repository root on a Hopper GPU with CUDA 13: builds kernels/cuda standalone (the kernels, the
# GPU tests and bench/cuda/decode_bench.cu), runs the tests of the new kernel options alone first
# (cluster reduce, smem scales, register weights: a hang or fault there turns the cluster rows of
# the bench off), then the FP8 / W8A16 / MoE GEMM GPU tests, then decode_bench: the dense V4-Flash
# shapes at 1 / 8 / 16 / 32 / 64 / 128 tokens against the read floor of the same bytes, and one
# V4-Flash layer's decode-step GEMMs at the same batch sizes with its floor (with the default
# dispatch, then once per environment of LAYER_ENVS). Prints the tables last
# (bench/cuda/decode_table.py); every path's times and the config ranking in $OUT/all-paths.md.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), LAYER_ENVS (see below).
# Measured 2026-12-04 on the H200: build 25 s, tests ~10 s, benches ~10 s (42 s in all).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-fp8dec}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 110 cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 110 cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_decode_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
timeout 30 "$tests" --gtest_filter='*ClusterReduce*:*SmemScales*:*RegisterWeights*' > "$out/cluster-tests.log" 2>&1
cluster_rc=$?
echo "cluster-reduce tests: rc=$cluster_rc $(summary "$out/cluster-tests.log")"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$out/cluster-tests.log" | head -20
if [ "$cluster_rc" != 0 ]; then export PDSERVE_DECODE_NO_CLUSTER=1; fi
timeout 45 "$tests" \
  --gtest_filter='CudaFp8Gemm*:CudaMoeGemm*:CudaW8a16*:-*ClusterReduce*:*SmemScales*:*RegisterWeights*' > "$out/fp8-tests.log" 2>&1
echo "fp8 / w8a16 / moe gemm tests: rc=$? $(summary "$out/fp8-tests.log")"
grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$out/fp8-tests.log" | head -20
bench="$b/bench/pdserve_decode_bench"
s2=$SECONDS
timeout 45 "$bench" gemm > "$out/gemm.csv" 2> "$out/gemm.err"
echo "decode_bench gemm: rc=$? $((SECONDS - s2)) s"
# The GEMM table now (in case the round's limit stops what follows), again at the end.
python3 bench/cuda/decode_table.py "$out/gemm.csv" > "$out/gemm-table.md" 2>&1
python3 bench/cuda/decode_table.py "$out/gemm.csv" --all-paths > "$out/all-paths.md" 2>&1
cat "$out/gemm-table.md"
s2=$SECONDS
timeout 25 "$bench" layer > "$out/layer-default.csv" 2> "$out/layer-default.err"
echo "decode_bench layer (default dispatch): rc=$? $((SECONDS - s2)) s"
# LAYER_ENVS: environments of further layer runs, separated by "|" (each a list of VAR=value).
layer_envs=${LAYER_ENVS:-}
layer_args=("default=$out/layer-default.csv")
if [ "$cluster_rc" = 0 ] && [ -n "$layer_envs" ]; then
  i=0
  IFS='|' read -ra envs <<< "$layer_envs"
  for e in "${envs[@]}"; do
    i=$((i + 1))
    s2=$SECONDS
    env $e timeout 25 "$bench" layer > "$out/layer-$i.csv" 2> "$out/layer-$i.err"
    echo "decode_bench layer run $i ($e): rc=$? $((SECONDS - s2)) s"
    layer_args+=("env$i=$out/layer-$i.csv")
  done
fi
echo "total: $((SECONDS - start)) s"
python3 bench/cuda/decode_table.py "$out/gemm.csv" --layer "${layer_args[@]}" 2>&1
