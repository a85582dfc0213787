#!/usr/bin/env bash
# One device-machine call for the fused projections (GpuModelOptions::fused_projections,
# engine/fused_projections.h; opt-in, never run on a GPU before this script), from the
# repository root on a Hopper GPU with CUDA 13:
#   1. builds kernels/cuda standalone and runs the compressor kernel tests (the strided source
#      rows the fused path reads: CudaCompressorTest.StridedSourceRowsMatchCpu among them);
#   2. writes the bundled model FP8-quantized (tools/make_real_format_checkpoint.py) once and runs
#      the engine GPU tests of the fusion (fused logits against unfused on the fixture models and
#      the bundled model in bf16, the quantized one in W8A16 and W8A8; graph == eager fused) and
#      two unfused tests as a check that the default path is unchanged;
#   3. times decode steps unfused and fused (bench/engine/gpu_decode_step_bench.cc, graph decode,
#      median device time per step): the bundled model in bf16, W8A16 and W8A8, and random bf16
#      weights in V4-Flash shapes (2 layers, 16 routed experts).
# Prints the test summaries, then the timing table last. Logs under $OUT (default ./gpu-out/fused).
#
# Binaries built here and carried (the device machine lacks this project's Debian packages;
# the libraries go xz-compressed, 35 MB in all, under the 64 MiB carry limit):
#   here:  cmake --build build --target engine_gpu_tests gpu_decode_step_bench &&
#          tools/gpu/run_fused_projections.sh --pack [build dir]
#   there (carry .device-carry/fused): tools/gpu/run_fused_projections.sh
# Environment: OUT, PACK (.device-carry/fused), SKIP_KERNELS=1, BATCHES ("1,8,32"),
# FLASH_LAYERS (2; 0 skips the V4-Flash-shaped rows). Exit 0 when every step passed.
# Not run yet: written 2026-12-04 without a GPU; its time budget (~150 s) is an estimate.
set -uo pipefail
pack=${PACK:-.device-carry/fused}
if [ "${1:-}" = --pack ]; then
  build=${2:-build}
  tools/gpu/pack_binaries.sh "$pack" "$build/tests/engine_gpu/engine_gpu_tests" \
    "$build/bench/engine/gpu_decode_step_bench" || exit 1
  tar -C "$pack" -cJf "$pack/lib.tar.xz" lib && rm -rf "$pack/lib"
  du -sh "$pack"
  exit 0
fi
out=${OUT:-gpu-out/fused}
batches=${BATCHES:-1,8,32}
flash_layers=${FLASH_LAYERS:-2}
mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 |
  tee "$out/gpu.txt"
status=0
summary=()
start=$SECONDS
if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  b=/tmp/pdserve-build-fused
  if timeout 40 cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_COMPILER="$nvcc" > "$out/kernels-build.log" 2>&1 &&
     timeout 90 cmake --build "$b" -j"$(nproc)" --target pdserve_kernels_cuda_tests \
       >> "$out/kernels-build.log" 2>&1; then
    timeout 30 "$b/tests/pdserve_kernels_cuda_tests" --gtest_filter='CudaCompressor*' \
      > "$out/kernels.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || status=1
    grep -E "^\[  FAILED|Failure|Expected|Which is|seed" "$out/kernels.log" | head -20
    summary+=("compressor kernel tests: rc=$rc $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/kernels.log" | tr '\n' ' ')")
  else
    grep -m20 -E "error" "$out/kernels-build.log"
    summary+=("compressor kernel tests: BUILD FAILED")
    status=1
  fi
  summary+=("kernels: $((SECONDS - start)) s")
fi
if [ ! -f "$pack/env.sh" ] || [ ! -f "$pack/lib.tar.xz" ]; then
  echo "no $pack/env.sh: pack the binaries here first (see this script's header)" >&2
  printf '%s\n' "${summary[@]}"
  exit 1
fi
# The pack unpacked outside the carried tree (env.sh finds its libraries beside itself).
unpacked=/tmp/pdserve-fused-pack
rm -rf "$unpacked" && mkdir -p "$unpacked" && cp -r "$pack/bin" "$pack/env.sh" "$unpacked/" &&
  tar -C "$unpacked" -xJf "$pack/lib.tar.xz"
# shellcheck disable=SC1091
source "$unpacked/env.sh"
s2=$SECONDS
ckpt=/tmp/pdserve-fused-kjv-fp8
rm -rf "$ckpt"
if ! timeout 60 python3 tools/make_real_format_checkpoint.py --out "$ckpt" \
       --quantize-from models/kjv-v4-tiny > "$out/checkpoint.log" 2>&1; then
  tail -5 "$out/checkpoint.log"
  summary+=("quantized checkpoint: FAILED")
  status=1
fi
summary+=("quantized checkpoint: $((SECONDS - s2)) s")
s2=$SECONDS
PDSERVE_SOURCE_DIR=$PWD PDSERVE_FP8_CHECKPOINT=$ckpt timeout 120 engine_gpu_tests \
  --gtest_filter='*GpuFusedProjections*:GpuFp8WeightsTest.Bf16CheckpointInFp8ModeIsTheBf16Path:*GraphDecodeEqualsEagerBitForBit/kjv_v4_tiny' \
  > "$out/engine.log" 2>&1
rc=$?
[ "$rc" = 0 ] || status=1
grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/engine.log" | head -20
grep -E "^fused projections, " "$out/engine.log"
summary+=("engine tests: rc=$rc $((SECONDS - s2)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/engine.log" | tr '\n' ' ')")
bench_rows="$out/bench.md"
: > "$bench_rows"
run_bench() {  # name, then the bench's arguments
  local name=$1
  shift
  local s3=$SECONDS
  timeout 60 gpu_decode_step_bench --batches "$batches" "$@" >> "$bench_rows" 2> "$out/bench-$name.err"
  local brc=$?
  [ "$brc" = 0 ] || { status=1; tail -3 "$out/bench-$name.err"; }
  summary+=("bench $name: rc=$brc $((SECONDS - s3)) s")
}
run_bench tiny-bf16 --model models/kjv-v4-tiny
run_bench tiny-w8a16 --model "$ckpt" --weights fp8 --activations bf16
run_bench tiny-w8a8 --model "$ckpt" --weights fp8 --activations fp8
if [ "$flash_layers" -gt 0 ]; then
  run_bench flash-bf16 --flash-layers "$flash_layers" --experts 16 --vocab 8192
fi
summary+=("total: $((SECONDS - start)) s")
printf '%s\n' "${summary[@]}"
echo
echo "Decode step, graph, median of 30 steps: us per step (device time between events; wall: the call and its sync)"
echo
python3 - "$bench_rows" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 5:
        continue
    what, mode, batch, dev, wall = cells
    rows.setdefault((what, int(batch)), {})[mode] = (float(dev), float(wall))
print("| model | batch | unfused us | fused us | fused / unfused | unfused wall us | fused wall us |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for (what, batch), m in rows.items():
    u, f = m.get("unfused"), m.get("fused")
    if u is None or f is None:
        continue
    print(f"| {what} | {batch} | {u[0]:.1f} | {f[0]:.1f} | {f[0] / u[0]:.3f} | {u[1]:.1f} | {f[1]:.1f} |")
PY
exit $status
