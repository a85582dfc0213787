#!/usr/bin/env bash
# The whole engine GPU suite with the engine's defaults, the sampler GPU tests, and decode steps
# unfused vs fused (the bundled model FP8-quantized in W8A16; two V4-Flash-shaped bf16 layers)
# in one call: how the defaults of 2026-12-04 (last-row prompt logits, fused projections, select
# top-k) were checked at 19:58 UTC (119 passed, 8 skipped; docs/engine-gpu.md, docs/perf.md).
# These commands ran from the lead's round folder and are committed here after the run.
#   here:  tools/gpu/pack_binaries.sh <dir> build/tests/engine_gpu/engine_gpu_tests \
#            build/tests/engine_gpu/sampler_gpu_tests build/bench/engine/gpu_decode_step_bench
#   there: source <dir>/env.sh && OUT=<out> bash tools/gpu/run_engine_defaults.sh  (repo root with
#          tests/fixtures and models/kjv-v4-tiny; ~100 s)
# Environment: OUT (gpu-out/engine-defaults), EFILTER (--gtest_filter), ELIMIT (280 s).
set -u
OUT=${OUT:-gpu-out/engine-defaults}
mkdir -p "$OUT"
nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2> /dev/null | head -1)")
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}:$nccl NCCL_NVLS_ENABLE=0
ckpt=/tmp/engine-defaults-kjv-fp8
rm -rf "$ckpt"
timeout 60 python3 tools/make_real_format_checkpoint.py --out "$ckpt" \
  --quantize-from models/kjv-v4-tiny > "$OUT/ckpt.log" 2>&1
echo "ckpt rc=$?"
s=$SECONDS
PDSERVE_SOURCE_DIR=$PWD PDSERVE_FP8_CHECKPOINT=$ckpt timeout "${ELIMIT:-280}" engine_gpu_tests \
  ${EFILTER:+--gtest_filter=$EFILTER} > "$OUT/engine.log" 2>&1
echo "engine rc=$? $((SECONDS - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$OUT/engine.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure$|Expected|Which is|fused projections, " "$OUT/engine.log" | head -40
s=$SECONDS
timeout 60 sampler_gpu_tests > "$OUT/sampler.log" 2>&1
echo "sampler rc=$? $((SECONDS - s)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$OUT/sampler.log" | tr '\n' ' ')"
s=$SECONDS
{ timeout 40 gpu_decode_step_bench --batches 1,8,32,64 --model "$ckpt" --weights fp8 \
    --activations bf16 &&
  timeout 40 gpu_decode_step_bench --batches 1,8,32,64 --flash-layers 2 --experts 16 \
    --vocab 8192; } > "$OUT/bench.md" 2> "$OUT/bench.err"
echo "bench rc=$? $((SECONDS - s)) s"
cat "$OUT/bench.md"
