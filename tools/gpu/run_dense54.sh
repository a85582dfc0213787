#!/usr/bin/env bash
# One device-machine call for issue 25's decode goal (dense FP8 GEMMs at 1-128 tokens): the
# split-k reduce kernel letting the next kernel launch at its start (PDSERVE_SPLITK_EARLY_TRIGGER=1;
# opt-in in the code, so this script exports it for every row but the *_late ones and the layer
# run that sets 0), fp8_gemm_wgmma's split_tokens, stagger_k and
# multicast_activations options, and the W8A8 dispatch without cuBLASLt (PDSERVE_FP8_GEMM=own).
# From the repository root on a Hopper GPU with CUDA 13: builds kernels/cuda standalone (the
# kernels, the GPU tests, bench/cuda/decode_bench.cu), runs the new options' tests first, one
# filter each (a failure turns that option's rows off, so a fault cannot take the other rows with
# it), then the other FP8 / W8A16 / MoE GEMM GPU tests (with the early trigger), then decode_bench
# over V4-Flash's dense shapes at 1-128 tokens with the configs in VARIANTS (and the dispatch once
# more with the old trigger: rows *_late), and one V4-Flash layer's decode-step GEMMs with the
# default and with each of LAYER_RUNS. Prints the layer's parts (all, dense_fused,
# dense_fused_q) per run and then the dispatch beside the variants, as % of the read floor of the
# same bytes, LAST (every path and the config ranking in $OUT/all-paths.md). Steps after 150 s
# are skipped, so that it ends within 170 s on the H200.
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), VARIANTS, LAYER_RUNS.
set -uo pipefail
export PDSERVE_SPLITK_EARLY_TRIGGER=${PDSERVE_SPLITK_EARLY_TRIGGER:-1}
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/pdserve-build-dense54}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
# decode_bench configs "w,s,t,c,x,r,a,i,t,k,m" (warpgroups, stages, target blocks, cluster_reduce,
# smem_scales, register weights, alternate_turns, two_in_flight, split_tokens, stagger_k,
# multicast_activations); row names <mode>_v<w>.<s>.<t>[.c][.s][.r][.a][.i][.t][.k][.m]. The
# default: split_tokens with the decode config's automatic stages, with 4 / 2 stages, with two
# blocks in flight; 2 warpgroups of 64 rows (the activation box read once per 128 weight rows);
# stagger_k alone and with split_tokens (the blocks running at once read different activation
# boxes); multicast_activations alone and with split_tokens (one L2 read of a box per 128 rows).
variants=${VARIANTS:-"0,0,264,0,1,1,0,0,1;0,4,264,0,1,1,0,0,1;0,2,264,0,1,1,0,0,1;0,4,264,0,1,1,0,1,1;2,4,264,0,1,1;2,2,264,0,1,1;0,0,264,0,1,1,0,0,0,1;0,0,264,0,1,1,0,0,1,1;0,0,264,0,1,1,0,0,0,0,1;0,0,264,0,1,1,0,0,1,0,1"}
# Layer runs besides the default: "PDSERVE_FP8_GEMM value|PDSERVE_FP8_WGMMA value|
# PDSERVE_SPLITK_EARLY_TRIGGER value" (any may be empty), ";"-separated, run in this order while
# the script has spent less than 150 s. Default: the old trigger; W8A8 without cuBLASLt (own
# kernels at 64-128 tokens); split_tokens in the dispatch, with multicast_activations too, with
# stagger_k too; own kernels with split_tokens and multicast_activations.
layer_runs=${LAYER_RUNS:-"||0;own||;|0,0,264,0,1,1,0,0,1|;|0,0,264,0,1,1,0,0,1,0,1|;|0,0,264,0,1,1,0,0,1,1|;own|0,0,264,0,1,1,0,0,1,0,1|"}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! { timeout 30 cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 90 cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests pdserve_decode_bench; } \
       > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
summary() { grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$1" | tr '\n' ' '; }
failures() { grep -E "^\[  FAILED|Failure|Expected|Which is|Value of|seed|error" "$1" | head -20; }
timeout 20 "$tests" --gtest_filter='*SplitTokens*' > "$out/split-tests.log" 2>&1
split_rc=$?
echo "split_tokens tests: rc=$split_rc $(summary "$out/split-tests.log")"
failures "$out/split-tests.log"
timeout 20 "$tests" --gtest_filter='*StaggerK*' > "$out/stagger-tests.log" 2>&1
stagger_rc=$?
echo "stagger_k tests: rc=$stagger_rc $(summary "$out/stagger-tests.log")"
failures "$out/stagger-tests.log"
timeout 20 "$tests" --gtest_filter='*MulticastActivations*' > "$out/multicast-tests.log" 2>&1
multicast_rc=$?
echo "multicast_activations tests: rc=$multicast_rc $(summary "$out/multicast-tests.log")"
failures "$out/multicast-tests.log"
timeout 40 "$tests" \
  --gtest_filter='CudaFp8Gemm*:CudaMoeGemm*:CudaW8a16*:-*SplitTokens*:*StaggerK*:*MulticastActivations*' \
  > "$out/fp8-tests.log" 2>&1
echo "other fp8 / w8a16 / moe gemm tests: rc=$? $(summary "$out/fp8-tests.log")"
failures "$out/fp8-tests.log"
# Variants with split_tokens (field 9), stagger_k (10) or multicast_activations (11) are left out
# when that option's tests failed.
failed_option() {
  local f
  IFS=',' read -ra f <<< "$1"
  { [ "${f[8]:-0}" = 1 ] && [ "$split_rc" != 0 ]; } ||
    { [ "${f[9]:-0}" = 1 ] && [ "$stagger_rc" != 0 ]; } ||
    { [ "${f[10]:-0}" = 1 ] && [ "$multicast_rc" != 0 ]; }
}
kept=()
IFS=';' read -ra all <<< "$variants"
for v in "${all[@]}"; do
  if failed_option "$v"; then continue; fi
  kept+=("$v")
done
variants=$(IFS=';'; echo "${kept[*]}")
echo "bench variants: $variants"
bench="$b/bench/pdserve_decode_bench"
s2=$SECONDS
PDSERVE_DECODE_NO_CLUSTER=1 PDSERVE_FP8_VARIANTS="$variants" timeout 35 "$bench" gemm \
  > "$out/gemm.csv" 2> "$out/gemm.err"
echo "decode_bench gemm: rc=$? $((SECONDS - s2)) s"
# The dispatch with the old trigger (rows fp8_late / w8a16_late, appended to gemm.csv).
if [ $((SECONDS - start)) -le 150 ]; then
  s2=$SECONDS
  PDSERVE_SPLITK_EARLY_TRIGGER=0 PDSERVE_DECODE_NO_CLUSTER=1 PDSERVE_FP8_VARIANTS=" " timeout 15 \
    "$bench" gemm > "$out/gemm-late.csv" 2> "$out/gemm-late.err"
  echo "decode_bench gemm (PDSERVE_SPLITK_EARLY_TRIGGER=0): rc=$? $((SECONDS - s2)) s"
  grep -E '^(fp8|w8a16),' "$out/gemm-late.csv" | sed -E 's/^(fp8|w8a16),/\1_late,/' \
    >> "$out/gemm.csv"
else
  echo "decode_bench gemm (PDSERVE_SPLITK_EARLY_TRIGGER=0): skipped, 150 s spent"
fi
python3 bench/cuda/decode_table.py "$out/gemm.csv" --all-paths > "$out/all-paths.md" 2>&1
layer_args=()
s2=$SECONDS
timeout 15 "$bench" layer > "$out/layer-default.csv" 2> "$out/layer-default.err"
echo "decode_bench layer (default): rc=$? $((SECONDS - s2)) s"
layer_args+=("default=$out/layer-default.csv")
i=0
IFS=';' read -ra runs <<< "$layer_runs"
for run in "${runs[@]}"; do
  IFS='|' read -r path config trigger <<< "$run"
  if failed_option "$config"; then continue; fi
  if [ $((SECONDS - start)) -gt 150 ]; then
    echo "decode_bench layer ($run): skipped, 150 s spent"
    continue
  fi
  i=$((i + 1))
  s2=$SECONDS
  env ${path:+PDSERVE_FP8_GEMM=$path} ${config:+PDSERVE_FP8_WGMMA=$config} \
    ${trigger:+PDSERVE_SPLITK_EARLY_TRIGGER=$trigger} timeout 12 "$bench" layer \
    > "$out/layer-$i.csv" 2> "$out/layer-$i.err"
  echo "decode_bench layer ($run): rc=$? $((SECONDS - s2)) s"
  layer_args+=("${path:-dispatch}/${config:-default}${trigger:+/trigger:$trigger}=$out/layer-$i.csv")
done
echo "total: $((SECONDS - start)) s"
python3 bench/cuda/decode_table.py "$out/gemm.csv" --layer "${layer_args[@]}" > "$out/tables.md" 2>&1
# The table last: the layer's dense parts per run, then the dispatch beside each variant.
sed -n '/One V4-Flash CSA layer/,/^2 GiB read floor/p' "$out/tables.md" | grep -v "^2 GiB" |
  grep "| dense_fused |\|| dense_fused_q |\|| all |\|^| run\|^| ---"
suffixes="_late,_wgmma"
for v in "${kept[@]}"; do
  IFS=',' read -ra f <<< "$v"
  name="_v${f[0]}.${f[1]}.${f[2]}"
  [ "${f[3]:-0}" = 1 ] && name+=".c"
  [ "${f[4]:-0}" = 1 ] && name+=".s"
  [ "${f[5]:-0}" = 1 ] && name+=".r"
  [ "${f[6]:-0}" = 1 ] && name+=".a"
  [ "${f[7]:-0}" = 1 ] && name+=".i"
  [ "${f[8]:-0}" = 1 ] && name+=".t"
  [ "${f[9]:-0}" = 1 ] && name+=".k"
  [ "${f[10]:-0}" = 1 ] && name+=".m"
  suffixes+=",$name"
done
python3 bench/cuda/decode_table.py "$out/gemm.csv" --compare "$suffixes" 2>&1
