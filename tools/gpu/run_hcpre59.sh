#!/usr/bin/env bash
# The fused hyper-connection pre-mix (GpuModelOptions::fused_hc_pre, PDSERVE_FUSED_HC_PRE;
# kernels/cuda/hyper_connection_fused.cuh: two launches instead of rms_norm + the fp32 GEMM +
# hyper_connection_pre + rms_norm), in one device call of at most ~200 s:
#   1. the kernel tests: the fused pair against the unfused composition (rows 1, 3, 32, 128, 33,
#      300, V4-Flash and small odd shapes; NaN rows, guards, determinism, graph replay), and the
#      hyper-connection, Sinkhorn (its row kernel now calls kernels/cuda/sinkhorn_rows.cuh) and
#      RMSNorm tests;
#   2. the engine's GPU suite with PDSERVE_FUSED_HC_PRE=1 (every model of the process fused:
#      logits against the CPU engine, graph == eager, PD pages), PDSERVE_SOURCE_DIR=$PWD, and
#      the fused, graph and fixture tests again with =pdl;
#   3. a real-format V4-Flash 1-layer checkpoint's graph decode step (gpu_decode_step_bench, as
#      tools/gpu/run_layer_profile.sh: W8A16, fused projections) at batch 1 and 32 with the
#      switch off, on and on with programmatic launches (=pdl), medians of 20 steps; then, while time is left, the switch-on steps
#      under ncu (per-kernel us, to see the two new kernels) at batch 1 and 32.
# The table is printed last. Logs under $OUT.
# Here:
#   cmake --build build --target pdserve_kernels_cuda_tests engine_gpu_tests gpu_decode_step_bench sampler_gpu_tests
#   tools/gpu/run_hcpre59.sh pack          # .device-carry/hcpre59.tar.xz
# There (carry .device-carry/hcpre59.tar.xz; or BUILD=<a tree built there> without it):
#   OUT=<dir> bash tools/gpu/run_hcpre59.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  b=${BUILD:-build}
  tools/gpu/pack_binaries.sh "$tmp/hcpre59" "$b/tests/kernels_cuda/pdserve_kernels_cuda_tests" \
    "$b/tests/engine_gpu/engine_gpu_tests" "$b/tests/engine_gpu/sampler_gpu_tests" \
    "$b/bench/engine/gpu_decode_step_bench" > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - hcpre59 | xz -6 -T0) > .device-carry/hcpre59.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/hcpre59.tar.xz
  exit 0
fi
out=${OUT:-gpu-out/hcpre59}
mkdir -p "$out"
out=$(cd "$out" && pwd)
start=$SECONDS
if [ -f .device-carry/hcpre59.tar.xz ] || [ -x .device-carry/hcpre59/bin/engine_gpu_tests ]; then
  if [ ! -x .device-carry/hcpre59/bin/engine_gpu_tests ]; then
    tar -xJf .device-carry/hcpre59.tar.xz -C .device-carry || echo "FAIL: unpacking hcpre59.tar.xz"
  fi
  # shellcheck disable=SC1091
  source .device-carry/hcpre59/env.sh
elif [ -n "${BUILD:-}" ] && [ -x "$BUILD/tests/engine_gpu/engine_gpu_tests" ]; then
  export PATH=$BUILD/tests/kernels_cuda:$BUILD/tests/engine_gpu:$BUILD/bench/engine:$PATH
else
  echo "FAIL: no .device-carry/hcpre59.tar.xz (run '$0 pack' here first) and no BUILD tree"
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
declare -A result
# Seconds a step may take: at most $1, and what is left of ~190 s since the start.
budget() {
  local left=$((190 - (SECONDS - start)))
  [ "$left" -gt "$1" ] && left=$1
  [ "$left" -lt 1 ] && left=1
  echo "$left"
}
# The checkpoint (CPU only, ~30 s) is written while the tests run.
ckpt=${CKPT:-/tmp/flash1}
ckpt_pid=
if [ ! -f "$ckpt/model.safetensors.index.json" ]; then
  timeout -k 3 100 python3 tools/make_real_format_checkpoint.py --out "$ckpt" --layers 1 \
    --shapes flash > "$out/ckpt.log" 2>&1 &
  ckpt_pid=$!
fi
s=$SECONDS
timeout -k 3 "$(budget 40)" pdserve_kernels_cuda_tests \
  --gtest_filter='CudaHyperConnection*:CudaSinkhorn*:CudaRmsNorm*' > "$out/kernels.log" 2>&1
result[kernels]="rc=$? $((SECONDS - s)) s $(passed "$out/kernels.log")"
grep -E "^\[  FAILED  \]|: Failure$" "$out/kernels.log" | head -8
s=$SECONDS
PDSERVE_FUSED_HC_PRE=1 PDSERVE_SOURCE_DIR=$PWD timeout -k 3 "$(budget 80)" engine_gpu_tests \
  > "$out/engine_gpu.log" 2>&1
result[engine]="rc=$? $((SECONDS - s)) s $(passed "$out/engine_gpu.log")"
grep -E "^\[  FAILED  \]|: Failure$" "$out/engine_gpu.log" | head -8
s=$SECONDS
PDSERVE_FUSED_HC_PRE=pdl PDSERVE_SOURCE_DIR=$PWD timeout -k 3 "$(budget 30)" engine_gpu_tests \
  --gtest_filter='*FusedHcPre*:*GraphDecodeEqualsEager*:GpuModelFixturesTest.*' \
  > "$out/engine_gpu_pdl.log" 2>&1
result[engine_pdl]="rc=$? $((SECONDS - s)) s $(passed "$out/engine_gpu_pdl.log")"
grep -E "^\[  FAILED  \]|: Failure$" "$out/engine_gpu_pdl.log" | head -8
if [ -n "$ckpt_pid" ]; then
  wait "$ckpt_pid"
  echo "checkpoint rc=$? at $((SECONDS - start)) s"
fi
bench=(gpu_decode_step_bench --model "$ckpt" --weights fp8 --activations bf16 --projections fused
  --prompt 64)
for on in 0 1 pdl; do
  s=$SECONDS
  PDSERVE_FUSED_HC_PRE=$on timeout -k 3 "$(budget 40)" "${bench[@]}" --batches 1,32 --steps 20 \
    > "$out/plain$on.md" 2> "$out/plain$on.err"
  rc=$?
  result[plain$on]="rc=$rc $((SECONDS - s)) s, $(grep -h '^hc pre' "$out/plain$on.err" | head -1)"
done
for b in 1 32; do
  if [ $((SECONDS - start)) -gt 160 ]; then
    result[ncu$b]="skipped (time)"
    continue
  fi
  s=$SECONDS
  PDSERVE_FUSED_HC_PRE=1 timeout -k 3 "$(budget 25)" ncu --profile-from-start off --clock-control none \
    --cache-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$out/ncu$b.csv" "${bench[@]}" --batches "$b" --steps 4 --profile-timed \
    > "$out/ncu$b.md" 2> "$out/ncu$b.err"
  result[ncu$b]="rc=$? $((SECONDS - s)) s"
done
python3 - "$out" <<'PY' > "$out/kernels_on.md" 2>&1
import csv, re, sys
out = sys.argv[1]
for b in ("1", "32"):
    try:
        with open(f"{out}/ncu{b}.csv") as f:
            lines = [l for l in f if l.startswith('"')]
    except OSError:
        continue
    agg = {}
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        n = re.sub(r"\(.*$", "", r["Kernel Name"])
        if not re.search(r"HcPre|HyperConnection|Collapse|RmsNorm|Sinkhorn|gemv|sgemm|splitK", n):
            continue
        n = re.sub(r"^(void )?(pdserve::kernels::cuda::)?", "", n)[:60]
        t, c = agg.get(n, (0.0, 0))
        agg[n] = (t + float(r["Metric Value"].replace(",", "")) / 1000.0 / 4, c + 1)
    print(f"batch {b}, switch on, hc-related kernels (us / step over 4 steps, launches / step):")
    for n, (t, c) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"  {n:60s} {t:7.1f} {c / 4:g}")
PY
echo
echo "GPU: $(cat "$out/gpu.txt")   total $((SECONDS - start)) s"
printf '%-28s %s\n' step result
printf '%-28s %s\n' "kernel tests" "${result[kernels]}"
printf '%-28s %s\n' "engine GPU tests, fused" "${result[engine]}"
printf '%-28s %s\n' "engine GPU subset, pdl" "${result[engine_pdl]}"
printf '%-28s %s\n' "bench switch off" "${result[plain0]}"
printf '%-28s %s\n' "bench switch on" "${result[plain1]}"
printf '%-28s %s\n' "bench switch pdl" "${result[plainpdl]}"
printf '%-28s %s\n' "ncu batch 1 (on)" "${result[ncu1]}"
printf '%-28s %s\n' "ncu batch 32 (on)" "${result[ncu32]}"
grep -E "normalized error" "$out/kernels.log" | awk '{print $NF}' |
  sort -g | tail -1 | sed 's/^/worst fused-vs-unfused normalized error: /'
grep -E "fused hc pre[,:]" "$out/engine_gpu.log" | head -9
cat "$out/kernels_on.md"
echo
echo "decode step, real-format V4-Flash 1 layer (| model | projections | batch | device us | wall us |):"
echo "switch off:"
cat "$out/plain0.md"
echo "switch on (PDSERVE_FUSED_HC_PRE=1):"
cat "$out/plain1.md"
echo "switch on, programmatic launches (PDSERVE_FUSED_HC_PRE=pdl):"
cat "$out/plainpdl.md"
