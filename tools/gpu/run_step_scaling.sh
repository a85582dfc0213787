#!/usr/bin/env bash
# Issue 26's step-scaling figure: TPOT as the decode batch grows. `pdserve serve --backend cuda`
# serves MODEL; `pdserve bench` sends completions of INPUT token ids / OUTPUT tokens (ignore_eos,
# the model's sampling defaults) at each concurrency in CONCURRENCY, 4 x concurrency requests
# (at least 8) each, one after another against the same server. Prints one row per concurrency
# (TPOT p50 / p99, ITL p50, output tok/s) and TPOT p50 against the first concurrency's.
#
# Each SAMPLERS entry is one server run: "device" (the default; sampling on the GPU) or "host"
# (PDSERVE_HOST_SAMPLER=1: logits copied to the host and sampled there, the path before on-device
# sampling), so both appear in the same run.
#
# Run from the repository root (MODEL is read there) with binaries packed by
# tools/gpu/pack_binaries.sh:
#   here:  tools/gpu/pack_binaries.sh .device-carry/bin build/pdserve
#   there: source .device-carry/bin/env.sh && tools/gpu/run_step_scaling.sh
# Environment: PDSERVE (pdserve on PATH), MODEL (models/kjv-v4-tiny), OUT (./gpu-out/scaling),
# CONCURRENCY ("1 16 64"), INPUT (128), OUTPUT (256), SAMPLERS ("device host"), PORT (18100),
# SERVE_ARGS (extra `pdserve serve` arguments), BACKEND (cuda; cpu tries the script here). Exit 0 when every run completed without errors.
set -uo pipefail
pdserve=${PDSERVE:-$(command -v pdserve || echo build/pdserve)}
model=${MODEL:-models/kjv-v4-tiny}
out=${OUT:-gpu-out/scaling}
concurrency=${CONCURRENCY:-1 16 64}
input=${INPUT:-128}
output=${OUTPUT:-256}
samplers=${SAMPLERS:-device host}
port=${PORT:-18100}
mkdir -p "$out"
status=0
rows=()
for sampler in $samplers; do
  log="$out/serve-$sampler.log"
  env_sampler=()
  [ "$sampler" = host ] && env_sampler=(PDSERVE_HOST_SAMPLER=1)
  # shellcheck disable=SC2086
  env "${env_sampler[@]}" "$pdserve" serve --model "$model" --backend "${BACKEND:-cuda}" --port "$port" \
    ${SERVE_ARGS:-} >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if ! curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1; then
    echo "server ($sampler) never became ready; see $log" >&2
    tail -5 "$log" >&2
    kill "$pid" 2>/dev/null
    status=1
    continue
  fi
  base=""
  for c in $concurrency; do
    n=$((c * 4 > 8 ? c * 4 : 8))
    json="$out/bench-$sampler-c$c.json"
    "$pdserve" bench --endpoint "http://127.0.0.1:$port" --concurrency "$c" --num-requests "$n" \
      --input-len "$input" --output-len "$output" --token-ids --json --output "$json" \
      >"$out/bench-$sampler-c$c.log" 2>&1 || status=1
    row=$(python3 - "$json" "$sampler" "$c" "$base" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
base = float(sys.argv[4]) if sys.argv[4] else None
tpot = j["tpot_ms"]["p50"]
ratio = f"{tpot / base:.2f}x" if base else "1.00x"
print(f"| {sys.argv[2]} | {sys.argv[3]} | {j['completed']}/{j['failed']} | {tpot:.2f} | "
      f"{j['tpot_ms']['p99']:.2f} | {j['itl_ms']['p50']:.2f} | "
      f"{j['output_token_throughput']:.0f} | {ratio} |")
PY
)
    [ -n "$row" ] || { status=1; row="| $sampler | $c | bench failed | | | | | |"; }
    rows+=("$row")
    [ -z "$base" ] && base=$(python3 -c "import json,sys; print(json.load(open('$json'))['tpot_ms']['p50'])" 2>/dev/null)
  done
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
done
echo
echo "model $model, input $input / output $output token ids, $(date -u +%F)"
echo "| sampler | concurrency | completed/failed | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | output tok/s | TPOT p50 vs first |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit $status
