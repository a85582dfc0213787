#!/usr/bin/env bash
# Issue 26, the guards on CUDA, on one H200 in one device call: the logits canary (recomputed on
# the GPU), the degeneration detector, the reference-kernel switch and the test-only wrong indexer
# (PDSERVE_TEST_SCRAMBLE_INDEXER=lowest: the fixed-shape decode indexer keeps the LOWEST-scoring
# entries, engine/gpu/gpu_model.h) on models/kjv-v4-wide (V4-Flash attention shapes, top-512 of
# rate-4 entries: the indexer chooses only past 2048 tokens of context).
#   1. GPU tests (from PACK, when packed): the wrong indexer against the healthy one step by step
#      (GpuModelV4ShapesTest), the canary through the colocated CUDA server (GpuBackendTest), the
#      runner's canary refusals (GpuStepRunnerTest.RefusesWhatItCannotServe).
#   2. `pdserve check` with deploy/check/kjv-long-prompts.jsonl (6 prompts of 2347 to 3332 tokens,
#      completions API, 128 tokens, 4 seeded samples at the model's temperature 0.6 + greedy)
#      against, each started fresh:
#        serve-healthy        pdserve serve --backend cuda --canary-every 1
#        serve-wrong          the same with PDSERVE_TEST_SCRAMBLE_INDEXER=lowest
#        serve-wrong-nocanary the same without the canary (does the detector alone see it?)
#        pd-healthy           pdserve up, CUDA prefill + CUDA decode on GPU 0, canary_every 1
#        pd-wrong             the same with PDSERVE_TEST_SCRAMBLE_INDEXER=lowest
#        pd-wrong-reference   the same with guards.reference_kernels [indexer] (the bisection)
#      Expected: healthy and reference runs exit 0 with 0 canary mismatches; wrong runs with the
#      canary exit 1 with canary mismatches (failed requests: "canary mismatch: ...").
#   3. The canary's normalized error (max|diff| / max|ref|, every check is logged) per run: the
#      healthy distribution against the wrong one, for guards::kGpuCanaryTolerance.
# Run from the repository root. Here: build pdserve and engine_gpu_tests, then
#   tools/gpu/device_tree.sh bundle build && tools/gpu/device_tree.sh wide
# and carry .device-carry; there:
#   mkdir -p .device-carry && tar -xJf .device-carry/bundle.tar.xz -C .device-carry &&
#   (cd .device-carry/bin && XZ_OPT="-0 -T0" tar -cJf ../gpu/libs.tar.xz lib) &&
#   tar -xJf .device-carry/wide.tar.xz && OUT=$OUT tools/gpu/run_guards_proof.sh
# and back here tools/gpu/device_tree.sh restore. (Or pack by hand: tools/gpu/pack_binaries.sh
# .device-carry/bin build/pdserve; tools/gpu/pack_engine_tests.sh build .device-carry/gpu.)
# Environment: BINS (.device-carry/bin), PACK (.device-carry/gpu), OUT (gpu-out/guards), RUNS (the
# runs of step 2, default all six), CANARY_TOLERANCE (0: guards::kGpuCanaryTolerance),
# SKIP_TESTS=1. Estimated 3-5 minutes on an H200 (not yet run).
# Table printed last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out/guards}
bins=${BINS:-.device-carry/bin}
pack=${PACK:-.device-carry/gpu}
tolerance=${CANARY_TOLERANCE:-0}
runs=${RUNS:-serve-healthy serve-wrong serve-wrong-nocanary pd-healthy pd-wrong pd-wrong-reference}
model=$PWD/models/kjv-v4-wide
prompts=deploy/check/kjv-long-prompts.jsonl
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

if [ "${SKIP_TESTS:-0}" != 1 ] && [ -f "$pack/libs.tar.xz" ]; then
  # The V4-shape tests use random weights; the serve and runner tests read models/kjv-v4-tiny,
  # which tools/gpu/device_tree.sh's `wide` mode leaves behind.
  filter='GpuModelV4ShapesTest.*'
  [ -f models/kjv-v4-tiny/model.safetensors ] &&
    filter+=':GpuBackendTest.*:GpuStepRunnerTest.RefusesWhatItCannotServe'
  SKIP_KERNELS=1 PACK=$pack OUT=$out/tests EFILTER=$filter timeout 300 tools/gpu/run_gpu_tests.sh > "$out/tests.txt" 2>&1
  rows+=("| GPU tests $filter | $(grep -q 'engine: rc=0' "$out/tests.txt" && echo PASS || echo FAIL) | $(grep -h 'wrong indexer vs healthy' "$out/tests/engine.log" | cut -c1-200) $(grep -h '^engine:' "$out/tests.txt") ($(elapsed)) |")
fi

# shellcheck disable=SC1091
source "$bins/env.sh"
pdserve=$(command -v pdserve)

wait_ready() {  # url, seconds, pid
  for _ in $(seq 1 $(($2 * 2))); do
    curl -sf "$1/ready" > /dev/null 2>&1 && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
metric() {  # metrics text file, metric name (first sample, summed over labels)
  awk -v m="$2" '$1 == m || index($1, m "{") == 1 {s += $NF; n++} END {print n ? s : "-"}' "$1"
}
# The canary's errors in a log: "pass N, mismatch M, error min / median / p90 / max".
canary_errors() {
  python3 - "$1" <<'PY'
import re, sys, math
errs = {"pass": [], "mismatch": []}
seen = set()  # a mismatch can be logged again by whoever reports the failed request
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"canary (pass|mismatch): (sequence \d+ at position \d+): .*?(?:error|by) "
                  r"([0-9.eE+-]+|inf)", line)
    if m and m.group(2) not in seen:
        seen.add(m.group(2))
        errs[m.group(1)].append(float(m.group(3)))
allv = sorted(errs["pass"] + errs["mismatch"])
def q(p):
    return allv[min(len(allv) - 1, int(p * len(allv)))] if allv else float("nan")
print(f"pass {len(errs['pass'])}, mismatch {len(errs['mismatch'])}, error min {q(0):.2g} "
      f"median {q(0.5):.2g} p90 {q(0.9):.2g} max {q(1.0) if allv else float('nan'):.2g}")
PY
}
check() {  # run name, base url
  "$pdserve" check --endpoint "$2" --prompts "$prompts" --api completions --samples 4 \
    --seed 1000 --json --output "$out/check-$1.json" > "$out/check-$1.txt" 2>&1
  echo $?
}
failing() {  # run name: the failing prompts and their reasons, briefly
  python3 - "$out/check-$1.json" <<'PY' 2>/dev/null
import json, sys
j = json.load(open(sys.argv[1]))
prompts = j.get("prompts", [])
bad = [p for p in prompts if not p.get("pass")]
samples = [s for p in prompts for s in p.get("samples", []) + ([p["greedy"]] if p.get("greedy") else [])]
errors = sum(1 for s in samples if s.get("request_error"))
judged = sum(1 for s in samples if not s.get("request_error") and not s.get("pass"))
print(f"{len(bad)}/{len(prompts)} prompts fail, of {len(samples)} samples {errors} failed "
      f"requests and {judged} judged degenerate" +
      ("".join(f"; {p['id']}: {', '.join(p.get('reasons', []))[:60]}" for p in bad[:1])))
PY
}
row() {  # run, expected rc ("any": reported only), rc, detail
  local verdict=FAIL
  [ "$3" = "$2" ] && verdict=PASS
  [ "$2" = any ] && verdict=INFO
  rows+=("| $1 | $verdict (check rc $3, want $2) | $4 ($(elapsed)) |")
}

serve_run() {  # name, canary-every, fault(0/1), expected rc
  local name=$1 port=18400 fault=()
  [ "$3" = 1 ] && fault=(PDSERVE_TEST_SCRAMBLE_INDEXER=lowest)
  env "${fault[@]}" "$pdserve" serve --model "$model" --backend cuda --port $port --max-batch 16 \
    --canary-every "$2" --canary-tolerance "$tolerance" > "$out/$name.log" 2>&1 &
  local pid=$!
  if ! wait_ready http://127.0.0.1:$port 240 $pid; then
    row "$name" "$4" "not ready" "$(tail -2 "$out/$name.log" | tr '\n' ' ')"
    kill $pid 2>/dev/null; wait $pid 2>/dev/null
    return
  fi
  local rc
  rc=$(check "$name" http://127.0.0.1:$port)
  curl -sf http://127.0.0.1:$port/metrics > "$out/$name.metrics"
  kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
  row "$name" "$4" "$rc" "$(failing "$name"); canary checks $(metric "$out/$name.metrics" pdserve_serve_canary_checks_total) mismatches $(metric "$out/$name.metrics" pdserve_serve_canary_mismatches_total); degenerate $(metric "$out/$name.metrics" pdserve_serve_degenerate_generations_total); $(canary_errors "$out/$name.log")"
}

pd_run() {  # name, fault(0/1), reference kernels yaml list, expected rc
  local name=$1
  cat > "$out/$name.yaml" <<YAML
name: guards-$name
share_gpus: true
model: {path: $model, served_name: kjv-v4-wide}
router: {host: 127.0.0.1, http_port: 18410, health_interval_ms: 5000}
prefill:
  - {name: prefill-0, host: 127.0.0.1, port: 18411, metrics_port: 18412, backend: cuda, gpus: "0"}
decode:
  - {name: decode-0, host: 127.0.0.1, port: 18413, metrics_port: 18414, backend: cuda, gpus: "0"}
transfer: {transport: ucx, lease_ms: 30000}
guards: {degeneration_action: flag, paranoid: false, canary_every: 1,
         canary_tolerance: $tolerance, reference_kernels: $3}
YAML
  local fault=()
  [ "$2" = 1 ] && fault=(PDSERVE_TEST_SCRAMBLE_INDEXER=lowest)
  env "${fault[@]}" "$pdserve" up --config "$out/$name.yaml" > "$out/$name.log" 2>&1 &
  local pid=$!
  if ! wait_ready http://127.0.0.1:18410 240 $pid; then
    row "$name" "$4" "not ready" "$(tail -2 "$out/$name.log" | tr '\n' ' ')"
    kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
    return
  fi
  local rc
  rc=$(check "$name" http://127.0.0.1:18410)
  curl -sf http://127.0.0.1:18414/metrics > "$out/$name.decode.metrics"
  curl -sf http://127.0.0.1:18410/metrics > "$out/$name.router.metrics"
  kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null
  row "$name" "$4" "$rc" "$(failing "$name"); canary checks $(metric "$out/$name.decode.metrics" pdserve_decode_canary_checks_total) mismatches $(metric "$out/$name.decode.metrics" pdserve_decode_canary_mismatches_total); degenerate (router) $(metric "$out/$name.router.metrics" pdserve_router_degenerate_generations_total); $(canary_errors "$out/$name.log")"
}

for r in $runs; do
  case $r in
    serve-healthy) serve_run "$r" 1 0 0 ;;
    serve-wrong) serve_run "$r" 1 1 1 ;;
    serve-wrong-nocanary) serve_run "$r" 0 1 any ;;
    pd-healthy) pd_run "$r" 0 "[]" 0 ;;
    pd-wrong) pd_run "$r" 1 "[]" 1 ;;
    pd-wrong-reference) pd_run "$r" 1 "[indexer]" 0 ;;
  esac
done

grep -h "TEST FAULT\|backend cuda: decode" "$out"/*.log 2>/dev/null | sort | uniq -c | head -6
echo
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1), $(date -u +%FT%TZ)"
echo "| run | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
