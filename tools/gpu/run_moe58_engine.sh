#!/usr/bin/env bash
# Issue 25, optional engine step of branch moe58: the CUDA engine's prefill of TOKENS tokens on
# one random V4-Flash layer in the real checkpoint format (tools/make_real_format_checkpoint.py
# --layers 1 --shapes flash: FP8 projections, 256 FP4 routed experts made FP8 at load, top-6),
# W8A16 and W8A8, with the routed experts' grouped GEMM on the mma.sync path
# (PDSERVE_MOE_GEMM=mma, the default) and on the warpgroup-MMA path from kMoeWgmmaMinPicks picks
# on (=auto: every prefill of 1366 tokens or more). bench/engine/gpu_decode_step_bench --prefill:
# median device / wall time of STEPS Forward calls, unfused and fused projections, and the last
# row's logits in brief per run (top 5 and sum: mma and wgmma should agree to bf16 rounding).
#   here:  cmake --build build --target gpu_decode_step_bench &&
#          tools/gpu/pack_binaries.sh /tmp/moe58pk/moe58 build/bench/engine/gpu_decode_step_bench &&
#          (cd /tmp/moe58pk && tar -cf - moe58 | xz -6 -T0 > <repo>/.device-carry/moe58.tar.xz)
#   there: OUT=<out> bash tools/gpu/run_moe58_engine.sh   (repository root, carrying
#          .device-carry/moe58.tar.xz; ~6 GB free in /tmp)
# Environment: OUT (gpu-out/moe58-engine), PACK (.device-carry/moe58.tar.xz), TOKENS (4096),
# STEPS (3). The table is printed last.
set -u
OUT=${OUT:-gpu-out/moe58-engine}
mkdir -p "$OUT"
pack=${PACK:-.device-carry/moe58.tar.xz}
dir=$(mktemp -d)
tar -xJf "$pack" -C "$dir" || { echo "no pack at $pack"; exit 1; }
# shellcheck disable=SC1091
source "$dir/moe58/env.sh"
s=$SECONDS
timeout 90 python3 tools/make_real_format_checkpoint.py --out /tmp/moe58-flash1 --layers 1 \
  --shapes flash > "$OUT/ckpt.log" 2>&1
echo "checkpoint rc=$? $((SECONDS - s)) s $(du -sh /tmp/moe58-flash1 | cut -f1)"
run() {  # name, PDSERVE_MOE_GEMM, activations
  local s=$SECONDS
  PDSERVE_MOE_GEMM=$2 timeout 120 gpu_decode_step_bench --model /tmp/moe58-flash1 \
    --weights fp8 --activations "$3" --prefill "${TOKENS:-4096}" --steps "${STEPS:-3}" \
    > "$OUT/$1.md" 2> "$OUT/$1.err"
  echo "$1: rc=$? $((SECONDS - s)) s"
  grep -iE "error|prefill logits" "$OUT/$1.err" | head -4
}
run w8a16-mma mma bf16
run w8a16-wgmma auto bf16
run w8a8-mma mma fp8
run w8a8-wgmma auto fp8
echo
echo "| run | projections | call | device us | wall us |"
echo "| --- | --- | --- | --- | --- |"
for n in w8a16-mma w8a16-wgmma w8a8-mma w8a8-wgmma; do
  sed -n 's/^| [^|]* |/| '"$n"' |/p' "$OUT/$n.md"
done
