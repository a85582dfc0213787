#!/usr/bin/env bash
# Issue 26 on one H200, one device call: the production-shaped bundled model (models/kjv-v4-wide:
# V4-Flash's attention shapes, so decode takes the fixed-shape sparse-attention and indexer
# kernels) served on the CUDA engine and judged, plus the GPU tests and the step-scaling table.
#   1. GPU tests: the on-device sampler (tools/gpu/run_sampler_tests.sh, SKIP_KERNELS=1) and every
#      engine GPU test (tools/gpu/run_gpu_tests.sh, SKIP_KERNELS=1), from the packed folder PACK.
#   2. Step scaling (tools/gpu/run_step_scaling.sh): kjv-v4-tiny and kjv-v4-wide, device sampler
#      and host sampler, concurrency 1 / 16 / 64, input 128 / output 256 token ids.
#   3. `pdserve check` on kjv-v4-wide (4 seeded samples per prompt at the model's temperature
#      0.6 + greedy, 128 tokens) against `pdserve serve --backend cuda`, against `pdserve up`
#      with CUDA prefill + CUDA decode workers (both on GPU 0), and against `pdserve serve
#      --backend cpu` (the reference: the same seeds judged on the CPU engine's text).
# Run from the repository root with binaries packed here:
#   tools/gpu/pack_engine_tests.sh build .device-carry/gpu
#   tools/gpu/pack_binaries.sh .device-carry/bin build/pdserve
# there: OUT=$OUT tools/gpu/run_wide_model_proof.sh. Environment: PACK (.device-carry/gpu), BINS
# (.device-carry/bin), OUT (gpu-out/wide), STEPS ("tests scaling check"), MODELS (the models the
# scaling step serves, "kjv-v4-tiny kjv-v4-wide"). Table printed last.
set -uo pipefail
out=${OUT:-gpu-out/wide}
pack=${PACK:-.device-carry/gpu}
bins=${BINS:-.device-carry/bin}
steps=${STEPS:-tests scaling check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

if [[ " $steps " == *" tests "* ]]; then
  SKIP_KERNELS=1 PACK=$pack OUT=$out/sampler timeout 240 tools/gpu/run_sampler_tests.sh \
    > "$out/sampler.txt" 2>&1
  row "sampler GPU tests" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "$(grep -E '^sampler_gpu ' "$out/sampler.txt" | head -3 | tr '\n' ';') ($(elapsed))"
  SKIP_KERNELS=1 PACK=$pack OUT=$out/engine timeout 300 tools/gpu/run_gpu_tests.sh \
    > "$out/engine.txt" 2>&1
  row "engine GPU tests" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "$(tail -3 "$out/engine.txt" | tr '\n' ' ') ($(elapsed))"
fi

# shellcheck disable=SC1091
source "$bins/env.sh"
pdserve=$(command -v pdserve)

if [[ " $steps " == *" scaling "* ]]; then
  for m in ${MODELS:-kjv-v4-tiny kjv-v4-wide}; do
    MODEL=models/$m OUT=$out/scaling-$m PDSERVE=$pdserve timeout 200 \
      tools/gpu/run_step_scaling.sh > "$out/scaling-$m.txt" 2>&1
    row "step scaling $m" "$([ $? = 0 ] && echo PASS || echo FAIL)" "see below ($(elapsed))"
  done
fi

wait_ready() {  # url, seconds, pid
  for _ in $(seq 1 $(($2 * 2))); do
    curl -sf "$1/ready" > /dev/null 2>&1 && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
check_against() {  # label, base url
  "$pdserve" check --endpoint "$2" --prompts deploy/check/kjv-prompts.jsonl --samples 4 --seed 100 --max-tokens 128 --json \
    --output "$out/check-$1.json" > "$out/check-$1.txt" 2>&1
  local rc=$?
  row "check kjv-v4-wide: $1" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")" \
    "$(python3 -c "
import json,sys
j=json.load(open('$out/check-$1.json'))
print(json.dumps({k: j[k] for k in j if not isinstance(j[k], (list, dict))})[:300])" 2>/dev/null) ($(elapsed))"
}

if [[ " $steps " == *" check "* ]]; then
  for backend in cuda cpu; do
    "$pdserve" serve --model models/kjv-v4-wide --backend "$backend" --port 18300 \
      > "$out/serve-wide-$backend.log" 2>&1 &
    pid=$!
    if wait_ready http://127.0.0.1:18300 240 $pid; then
      check_against "serve-$backend" http://127.0.0.1:18300
    else
      row "check kjv-v4-wide: serve-$backend" FAIL "not ready: $(tail -2 "$out/serve-wide-$backend.log")"
    fi
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
  done
  cat > "$out/wide-pd.yaml" <<YAML
name: wide-pd-cuda
share_gpus: true
model: {path: $PWD/models/kjv-v4-wide, served_name: kjv-v4-wide}
router: {host: 127.0.0.1, http_port: 18310, health_interval_ms: 5000}
prefill:
  - {name: prefill-0, host: 127.0.0.1, port: 18311, metrics_port: 18312, backend: cuda, gpus: "0"}
decode:
  - {name: decode-0, host: 127.0.0.1, port: 18313, metrics_port: 18314, backend: cuda, gpus: "0"}
transfer: {transport: ucx, lease_ms: 30000}
guards: {degeneration_action: flag, paranoid: false, canary_every: 0}
YAML
  "$pdserve" up --config "$out/wide-pd.yaml" > "$out/up-wide.log" 2>&1 &
  pid=$!
  if wait_ready http://127.0.0.1:18310 240 $pid; then
    check_against "up-cuda-pd" http://127.0.0.1:18310
  else
    row "check kjv-v4-wide: up-cuda-pd" FAIL "not ready: $(tail -2 "$out/up-wide.log")"
  fi
  kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
fi

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
echo
for m in kjv-v4-tiny kjv-v4-wide; do
  [ -f "$out/scaling-$m.txt" ] && grep -E "^\||^model" "$out/scaling-$m.txt"
done
echo
echo "$(cat "$out/gpu.txt"), $(date -u +%FT%TZ)"
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
