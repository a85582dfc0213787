#!/usr/bin/env bash
# One device-machine call for fp8_gemm_wgmma's consumer options and its W8A16 stage rule (issue
# 25's decode goal), from the repository root on a Hopper GPU with CUDA 13: builds kernels/cuda
# standalone (the kernels, the GPU tests, bench/cuda/decode_bench.cu), runs the tests of the
# consumer options first (two_in_flight, alternate_turns: a failure turns that option's bench
# rows off, so a fault cannot take the other rows with it), then the other FP8 / W8A16 / MoE GEMM
# GPU tests, then decode_bench over V4-Flash's dense shapes at 1-128 tokens with the configs in
# VARIANTS (the default: the stage rule before this work, 2 or 3 stages everywhere, 2 stages with
# 132 / 396 target blocks, the consumer options), and one V4-Flash layer's decode-step GEMMs with the default config and with each of
# LAYER_CONFIGS. Prints the dispatch beside the variants, as % of the read floor of the same
# bytes, LAST (every path and the config ranking in $OUT/all-paths.md). 78-79 s on the H200.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), VARIANTS, LAYER_CONFIGS.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-fp8wg25}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# decode_bench configs "w,s,t,c,x,r,a,i" (warpgroups, stages, target blocks, cluster_reduce,
# smem_scales, register weights, alternate_turns, two_in_flight); row names w8a16_v<w>.<s>.<t>...
variants=${VARIANTS:-"0,4,264,0,1,1;0,2,264,0,1,1;0,3,264,0,1,1;0,2,132,0,1,1;0,2,396,0,1,1;0,0,264,0,1,1,0,1;0,6,264,0,1,1,0,1;0,0,264,0,1,1,1,0"}
# Layer runs besides the default config: PDSERVE_FP8_WGMMA values, ";"-separated (the default:
# the stage rule before this work, 4 stages up to 64 W8A16 tokens).
layer_configs=${LAYER_CONFIGS:-"0,4,264,0,1,1"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 30 cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 80 cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_decode_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
failures() { grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$1" | head -20; }
# The new options' tests, one filter each (a fault in one must not hide the other's result).
timeout 25 "$tests" --gtest_filter='*TwoInFlight*' > "$out/inflight-tests.log" 2>&1
inflight_rc=$?
echo "two_in_flight tests: rc=$inflight_rc $(summary "$out/inflight-tests.log")"
failures "$out/inflight-tests.log"
timeout 25 "$tests" --gtest_filter='*AlternateTurns*' > "$out/alternate-tests.log" 2>&1
alternate_rc=$?
echo "alternate_turns tests: rc=$alternate_rc $(summary "$out/alternate-tests.log")"
failures "$out/alternate-tests.log"
timeout 40 "$tests" --gtest_filter='CudaFp8Gemm*:CudaMoeGemm*:CudaW8a16*:-*TwoInFlight*:*AlternateTurns*' \
  > "$out/fp8-tests.log" 2>&1
echo "other fp8 / w8a16 / moe gemm tests: rc=$? $(summary "$out/fp8-tests.log")"
failures "$out/fp8-tests.log"
# Variants whose option failed its tests are left out of the bench (fields 7 and 8).
kept=()
IFS=';' read -ra all <<< "$variants"
for v in "${all[@]}"; do
  IFS=',' read -ra f <<< "$v"
  if [ "${f[6]:-0}" = 1 ] && [ "$alternate_rc" != 0 ]; then continue; fi
  if [ "${f[7]:-0}" = 1 ] && [ "$inflight_rc" != 0 ]; then continue; fi
  kept+=("$v")
done
variants=$(IFS=';'; echo "${kept[*]}")
echo "bench variants: $variants"
bench="$b/bench/pdserve_decode_bench"
s2=$SECONDS
PDSERVE_DECODE_NO_CLUSTER=1 PDSERVE_FP8_VARIANTS="$variants" timeout 35 "$bench" gemm \
  > "$out/gemm.csv" 2> "$out/gemm.err"
echo "decode_bench gemm: rc=$? $((SECONDS - s2)) s"
python3 bench/cuda/decode_table.py "$out/gemm.csv" --all-paths > "$out/all-paths.md" 2>&1
layer_args=()
s2=$SECONDS
timeout 15 "$bench" layer > "$out/layer-default.csv" 2> "$out/layer-default.err"
echo "decode_bench layer (default config): rc=$? $((SECONDS - s2)) s"
layer_args+=("default=$out/layer-default.csv")
i=0
IFS=';' read -ra lcs <<< "$layer_configs"
for lc in "${lcs[@]}"; do
  IFS=',' read -ra lf <<< "$lc"
  if [ "${lf[6]:-0}" = 1 ] && [ "$alternate_rc" != 0 ]; then continue; fi
  if [ "${lf[7]:-0}" = 1 ] && [ "$inflight_rc" != 0 ]; then continue; fi
  i=$((i + 1))
  s2=$SECONDS
  PDSERVE_FP8_WGMMA="$lc" timeout 15 "$bench" layer > "$out/layer-$i.csv" 2> "$out/layer-$i.err"
  echo "decode_bench layer (PDSERVE_FP8_WGMMA=$lc): rc=$? $((SECONDS - s2)) s"
  layer_args+=("$lc=$out/layer-$i.csv")
done
echo "total: $((SECONDS - start)) s"
python3 bench/cuda/decode_table.py "$out/gemm.csv" --layer "${layer_args[@]}" > "$out/tables.md" 2>&1
# The table last: the dispatch now beside each variant (row suffix _v<config>) and mma.sync.
suffixes="_mma,_wgmma"
for v in "${kept[@]}"; do
  IFS=',' read -ra f <<< "$v"
  name="_v${f[0]}.${f[1]}.${f[2]}"
  [ "${f[3]:-0}" = 1 ] && name+=".c"
  [ "${f[4]:-0}" = 1 ] && name+=".s"
  [ "${f[5]:-0}" = 1 ] && name+=".r"
  [ "${f[6]:-0}" = 1 ] && name+=".a"
  [ "${f[7]:-0}" = 1 ] && name+=".i"
  suffixes+=",$name"
done
sed -n '/One V4-Flash CSA layer/,/^2 GiB read floor/p' "$out/tables.md" | grep -v "^2 GiB" |
  grep -v "| moe |\|| dense_fused |"
python3 bench/cuda/decode_table.py "$out/gemm.csv" --compare "$suffixes" 2>&1
