#!/usr/bin/env bash
# Issue 25: W8A8 prefill in the CUDA engine with GpuModelOptions::fp8_shared_act_quant off and on
# (PDSERVE_FP8_SHARED_ACT_QUANT=0 / 1), on one random V4-Flash layer in the real checkpoint
# format (tools/make_real_format_checkpoint.py --layers 1 --shapes flash: FP8 projections with
# 128 x 128 scales, 256 FP4 routed experts), and W8A16 (the default FP8 mode) beside them:
# bench/engine/gpu_decode_step_bench --prefill N (one Forward of N tokens from an empty slot,
# last row's logits, median of STEPS calls; device time between CUDA events), unfused and fused.
#   here:  cmake --build build --target gpu_decode_step_bench &&
#          tools/gpu/pack_binaries.sh /tmp/sactq build/bench/engine/gpu_decode_step_bench &&
#          (cd /tmp && tar -cf - sactq | xz -6 -T0 > <repo>/.device-carry/sactq.tar.xz)
#   there: OUT=<out> bash tools/gpu/run_shared_actq.sh   (repository root; tests/fixtures/
#          v4_configs and ~6 GB free in /tmp)
# Environment: OUT (gpu-out/sactq), PACK (.device-carry/sactq.tar.xz), TOKENS (4096), STEPS (5).
# The table is printed last.
set -u
OUT=${OUT:-gpu-out/sactq}
mkdir -p "$OUT"
pack=${PACK:-.device-carry/sactq.tar.xz}
dir=$(mktemp -d)
tar -xJf "$pack" -C "$dir" || { echo "no pack at $pack"; exit 1; }
# shellcheck disable=SC1091
source "$dir/sactq/env.sh"
s=$SECONDS
timeout 90 python3 tools/make_real_format_checkpoint.py --out /tmp/sactq-flash1 --layers 1 \
  --shapes flash > "$OUT/ckpt.log" 2>&1
echo "checkpoint rc=$? $((SECONDS - s)) s $(du -sh /tmp/sactq-flash1 | cut -f1)"
run() {  # name, shared (0/1), activations
  local s=$SECONDS
  PDSERVE_FP8_SHARED_ACT_QUANT=$2 timeout 120 gpu_decode_step_bench --model /tmp/sactq-flash1 \
    --weights fp8 --activations "$3" --prefill "${TOKENS:-4096}" --steps "${STEPS:-5}" \
    > "$OUT/$1.md" 2> "$OUT/$1.err"
  echo "$1: rc=$? $((SECONDS - s)) s"
  grep -iE "error|shared_act_quant" "$OUT/$1.err" | head -3
}
run w8a8-per-call 0 fp8
run w8a8-shared 1 fp8
run w8a16 0 bf16
echo
echo "| run | projections | call | device us | wall us |"
echo "| --- | --- | --- | --- | --- |"
for n in w8a8-per-call w8a8-shared w8a16; do
  sed -n 's/^| [^|]* |/| '"$n"' |/p' "$OUT/$n.md"
done
