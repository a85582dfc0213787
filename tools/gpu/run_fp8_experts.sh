#!/usr/bin/env bash
# Issue 25 on one H200, one device call: routed experts FP8 on the GPU (FP4 -> FP8 at load,
# engine/stored_experts.h; kernels/cuda/moe_gemm in GpuModel), loaded without an fp32 host copy.
#   1. tests: with KERNELS=1, kernels/cuda built standalone and its MoE / FP8 GEMM GPU tests
#      (ctest -R; the kernels are unchanged since their last device run); then engine_gpu_tests GpuFp8Weights* on the bundled model FP8-quantized by the tool (FP8 GPU vs
#      CPU fp32, bf16 GPU vs CPU, FP8 vs bf16 GPU; figures printed by the test).
#   2. checkpoint: tools/make_real_format_checkpoint.py, random weights, V4-Flash shapes, LAYERS
#      (8) layers, the bundled model's tokenizer and vocabulary (4096), max_position_embeddings
#      set to 16384 (the decode worker's plan would otherwise size 64 slots of 1M tokens); then
#      `pdserve plan` on a deployment of one CUDA prefill + one CUDA decode worker (weights fp8).
#   3. serve: `pdserve serve --backend cuda --weights fp8`: load time (start to /ready 200),
#      peak host RSS (VmHWM of the process after the load) against the checkpoint's size, GPU
#      memory used, and 8 greedy tokens of a completion.
#   4. up: `pdserve up` with that prefill + decode pair on GPU 0 (share_gpus), 8 tokens through
#      the router.
#   5. compare: a 2-layer V4-Flash checkpoint of the same tool (2 layers: the bf16 path needs the
#      fp32 host copy, 26 GB per layer, and the CPU engine needs it too) through
#      GpuFp8WeightsTest.Fp8Resident* (PDSERVE_FP8_CHECKPOINT): FP8 GPU vs the same weights
#      dequantized to bf16 on the same GPU, and bf16 GPU vs CPU fp32, same prompts, same run;
#      then the LAYERS-layer checkpoint (when written) through
#      GpuFp8WeightsTest.Fp8ResidentAgainstBf16DequantizedOnALargeCheckpoint: FP8 (W8A16, W8A8)
#      vs the same weights dequantized to bf16 at load (no fp32 host copy) on the same GPU.
# Pack here (after building pdserve and engine_gpu_tests in build/):
#   tools/gpu/pack_engine_tests.sh build .device-carry/gpu
#   tools/gpu/pack_binaries.sh .device-carry/bin build/pdserve
#   (tools/gpu/device_tree.sh tests makes the tree fit; models/kjv-v4-tiny must stay.)
# There: OUT=$OUT tools/gpu/run_fp8_experts.sh. Environment: PACK (.device-carry/gpu), BINS
# (.device-carry/bin), OUT (gpu-out/fp8), LAYERS (8), WORK (/tmp/pdserve-fp8: the checkpoints,
# ~37 GB of disk), STEPS ("tests checkpoint serve up compare"). Table printed last.
# Expected time on an H200 host (estimates, not measured): tests ~1 min (KERNELS=1: +2 min),
# checkpoints ~2-3 min (~1 GB/s of random bytes), serve and up loads ~1 min each, compare ~2 min:
# about 7-9 min, near one device call's 10 minutes; STEPS splits it into two calls if needed
# (the checkpoints stay in WORK between calls only on a warm machine).
set -uo pipefail
out=${OUT:-gpu-out/fp8}
pack=${PACK:-.device-carry/gpu}
bins=${BINS:-.device-carry/bin}
work=${WORK:-/tmp/pdserve-fp8}
layers=${LAYERS:-8}
steps=${STEPS:-tests checkpoint serve up compare}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }
ck=$work/flash$layers
ck2=$work/flash2

if [[ " $steps " == *" tests "* ]]; then
  SKIP_KERNELS=$([ "${KERNELS:-0}" = 1 ] && echo 0 || echo 1) KFILTER='MoeGemm|Fp8Gemm' \
    EFILTER='GpuFp8Weights*' PACK=$pack OUT=$out/tests timeout 420 \
    tools/gpu/run_gpu_tests.sh > "$out/tests.txt" 2>&1
  row "GPU tests (kernels MoeGemm/Fp8Gemm, engine GpuFp8Weights*)" "rc $?" \
    "$(tail -2 "$out/tests.txt" | tr '\n' ' ') ($(elapsed))"
  while read -r line; do row "bundled model (FP8 experts + FP8 dense)" "-" "$line"; done \
    < <(grep -E "^fp8 weights, " "$out/tests/engine.log" 2>/dev/null)
fi

# shellcheck disable=SC1091
source "$bins/env.sh"
pdserve=$(command -v pdserve)

make_checkpoint() {  # dir, layers
  [ -f "$1/model.safetensors.index.json" ] && return 0
  rm -rf "$1"
  # The bundled tokenizer: kjv-v4-tiny's, or kjv-v4-wide's (the same) in a `wide` device tree.
  local tok=models/kjv-v4-tiny
  [ -f $tok/tokenizer.json ] || tok=models/kjv-v4-wide
  python3 tools/make_real_format_checkpoint.py --out "$1" --shapes flash --layers "$2" --seed 1 \
    --tokenizer-from $tok --shard-mb 4096 &&
    python3 - "$1/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["max_position_embeddings"] = 16384
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
}

cat > "$out/pd.yaml" <<YAML
name: fp8-pd-cuda
share_gpus: true
model: {path: $ck, served_name: flash$layers}
router: {host: 127.0.0.1, http_port: 18410, health_interval_ms: 5000}
prefill:
  - {name: prefill-0, host: 127.0.0.1, port: 18411, metrics_port: 18412, backend: cuda, gpus: "0", weights: fp8}
decode:
  - {name: decode-0, host: 127.0.0.1, port: 18413, metrics_port: 18414, backend: cuda, gpus: "0", weights: fp8}
transfer: {transport: ucx, lease_ms: 30000}
guards: {degeneration_action: flag, paranoid: false, canary_every: 0}
YAML

if [[ " $steps " == *" checkpoint "* ]]; then
  s=$(date +%s)
  make_checkpoint "$ck" "$layers" > "$out/checkpoint.log" 2>&1
  row "checkpoint: $layers V4-Flash layers, FP8 + FP4 experts" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "$(du -sh "$ck" | cut -f1) on disk, $(($(date +%s) - s)) s ($(elapsed))"
  "$pdserve" plan --config "$out/pd.yaml" > "$out/plan.txt" 2>&1
  row "pdserve plan (prefill + decode, one H200 each)" "rc $?" \
    "$(grep -E '^  (weights|total|fits) ' "$out/plan.txt" | tr -s ' ' | tr '\n' ';')"
fi

ready() {  # url, seconds, pid: /ready answers 200
  for _ in $(seq 1 $(($2 * 2))); do
    curl -sf "$1/ready" > /dev/null 2>&1 && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
complete() {  # base url -> prints the completion's text and token count
  python3 - "$1" <<'PY'
import json, sys, urllib.request
url = sys.argv[1]
model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
body = {"model": model, "prompt": "In the beginning", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True}
req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=300))
print(f"{r['usage']['completion_tokens']} tokens {json.dumps(r['choices'][0]['text'])[:60]}")
PY
}

if [[ " $steps " == *" serve "* ]]; then
  s=$(date +%s.%N)
  "$pdserve" serve --model "$ck" --backend cuda --weights fp8 --host 127.0.0.1 --port 18400 \
    --max-batch 8 > "$out/serve.log" 2>&1 &
  pid=$!
  if ready http://127.0.0.1:18400 600 $pid; then
    load=$(python3 -c "import time; print(f'{time.time() - $s:.1f}')")
    hwm=$(awk '/VmHWM/ {printf "%.2f GiB", $2 / 1048576}' /proc/$pid/status)
    gpu=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader | head -1)
    text=$(complete http://127.0.0.1:18400 2>&1 | tail -1)
    row "serve --backend cuda --weights fp8" PASS \
      "load ${load} s, peak host RSS $hwm (checkpoint $(du -sh "$ck" | cut -f1)), GPU $gpu; $text ($(elapsed))"
  else
    row "serve --backend cuda --weights fp8" FAIL "$(tail -2 "$out/serve.log" | tr '\n' ' ')"
  fi
  grep -E "weights fp8|backend cuda" "$out/serve.log" | head -5 > "$out/serve-weights.txt"
  kill $pid 2>/dev/null; wait $pid 2>/dev/null
fi

if [[ " $steps " == *" up "* ]]; then
  "$pdserve" up --config "$out/pd.yaml" > "$out/up.log" 2>&1 &
  pid=$!
  if ready http://127.0.0.1:18410 600 $pid && sleep 6; then
    text=$(complete http://127.0.0.1:18410 2>&1 | tail -1)
    row "up: CUDA prefill + CUDA decode (fp8)" "$([[ $text == *tokens* ]] && echo PASS || echo FAIL)" \
      "$text ($(elapsed))"
  else
    row "up: CUDA prefill + CUDA decode (fp8)" FAIL "$(tail -2 "$out/up.log" | tr '\n' ' ')"
  fi
  kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
fi

if [[ " $steps " == *" compare "* ]]; then
  make_checkpoint "$ck2" 2 > "$out/checkpoint2.log" 2>&1
  chmod +x "$pack/bin/engine_gpu_tests"
  mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  PDSERVE_FP8_CHECKPOINT=$ck2 PDSERVE_SOURCE_DIR=$PWD \
    LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$nccl:$LD_LIBRARY_PATH timeout 400 \
    "$pack/bin/engine_gpu_tests" --gtest_filter='GpuFp8WeightsTest.Fp8Resident*' \
    > "$out/compare.log" 2>&1
  rc=$?
  while read -r line; do row "2-layer V4-Flash (rc $rc)" "-" "$line"; done \
    < <(grep -E "^fp8 weights, " "$out/compare.log")
fi

# The LAYERS-layer checkpoint: FP8 resident vs the same weights dequantized to bf16 on the GPU
# (WeightFormat::kBf16Dequantized: no fp32 host copy), one model on the device at a time. Step
# "large" (in "compare" too); needs only the checkpoint and tests/fixtures/small_model's prompt ids.
if [[ " $steps " == *" compare "* || " $steps " == *" large "* ]]; then
  mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
  chmod +x "$pack/bin/engine_gpu_tests"
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  if [ -f "$ck/model.safetensors.index.json" ]; then
    s=$(date +%s)
    PDSERVE_FP8_LARGE_CHECKPOINT=$ck PDSERVE_SOURCE_DIR=$PWD \
      LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$nccl:$LD_LIBRARY_PATH timeout 420 \
      "$pack/bin/engine_gpu_tests" \
      --gtest_filter='GpuFp8WeightsTest.Fp8ResidentAgainstBf16DequantizedOnALargeCheckpoint' \
      > "$out/compare_large.log" 2>&1
    rc=$?
    while read -r line; do row "$layers-layer V4-Flash (rc $rc, $(($(date +%s) - s)) s)" "-" "$line"; done \
      < <(grep -E "^fp8 weights, " "$out/compare_large.log")
  fi
fi

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
echo
cat "$out/plan.txt" 2>/dev/null | head -30
echo
echo "$(cat "$out/gpu.txt"), $(date -u +%FT%TZ)"
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
