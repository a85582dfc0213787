#!/usr/bin/env bash
# Issue 12's benchmark. The disaggregated cluster of deploy/config/cluster-8gpu.yaml (router, a
# prefill worker on GPUs 0-3 and a decode worker on GPUs 4-7, each expert-parallel over its four)
# serves a random-weight model with DeepSeek-V4-Flash layer shapes (tools/gpu/make_random_model.py),
# started the way the systemd units start it: one process each, all reading the same file.
# `pdserve bench` measures it at several request rates (input 4096 / output 512 tokens as token
# ids: TTFT, TPOT, output tokens/s, goodput under TTFT <= 2 s and TPOT <= 50 ms); then the same
# model colocated on all eight GPUs (`pdserve serve --backend cuda --devices 0,...,7`) the same
# way, in the same run. Logs and the bench JSON go to $OUT; a table is printed last, with TPOT
# also scaled linearly from LAYERS to the model's 43 layers.
#
# From the repository root (tools/ and models/ are read there), with the pdserve binary at BIN.
# Environment:
#   BIN (build/pdserve), CONFIG (deploy/config/cluster-8gpu.yaml; its model path is replaced by
#   the random model), OUT (./cluster-out), LAYERS (8: every worker process builds the weights
#   in host fp32 first, about 26 GB a layer at Flash shapes), SHAPES (flash, or tiny to try the
#   script on a CPU with a CPU config), RATES (requests/s, "0.5 1 2 4"), REQUESTS (per rate, 64),
#   INPUT (4096), OUTPUT (512), GPUS (GPUs the cluster uses, 8: for tokens/s per GPU),
#   COLOCATED (serve's engine arguments, "--backend cuda --devices 0,1,2,3,4,5,6,7"; "none"
#   skips the colocated run), COLOCATED_PORT (8100), READY_TIMEOUT (seconds, 1800).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). Exit 0 when every step ran.
set -uo pipefail
bin=${BIN:-build/pdserve}
config=${CONFIG:-deploy/config/cluster-8gpu.yaml}
out=${OUT:-cluster-out}
layers=${LAYERS:-8}
shapes=${SHAPES:-flash}
rates=${RATES:-0.5 1 2 4}
requests=${REQUESTS:-64}
input=${INPUT:-4096}
output=${OUTPUT:-512}
gpus=${GPUS:-8}
colocated=${COLOCATED:---backend cuda --devices 0,1,2,3,4,5,6,7}
colocated_port=${COLOCATED_PORT:-8100}
ready_timeout=${READY_TIMEOUT:-1800}
export NCCL_NVLS_ENABLE=0
mkdir -p "$out"
out=$(cd "$out" && pwd)
pids=()
stop_all() {
  [ ${#pids[@]} -gt 0 ] || return 0
  kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 150); do
    kill -0 "${pids[@]}" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  pids=()
}
trap stop_all EXIT
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

# 1. The model directory and a copy of the config that names it.
model=$out/model
rm -rf "$model"
python3 tools/gpu/make_random_model.py --out "$model" --layers "$layers" --shapes "$shapes" ||
  fail "make_random_model"
cfg=$out/cluster.yaml
awk -v model="$model" '/^model:/ { in_model = 1 } /^[a-z]/ && !/^model:/ { in_model = 0 }
  in_model && /^  path:/ { print "  path: " model; next } { print }' "$config" >"$cfg"
"$bin" validate-config "$cfg" || fail "validate-config $cfg"
# Worker names per role and the router's HTTP port, from the file.
names() {
  awk -v role="$1" '/^[a-z]/ { section = $1 } section == role ":" && /^  - name:/ { print $3 }' "$cfg"
}
router_port=$(awk '/^[a-z]/ { section = $1 } section == "router:" && /^  http_port:/ { print $2 }' "$cfg")

# Waits until GET http://127.0.0.1:$1/ready answers 200, or a started process exits.
wait_ready() {
  local deadline=$((SECONDS + ready_timeout))
  while [ $SECONDS -lt $deadline ]; do
    if python3 -c "import sys, urllib.request as u; u.urlopen('http://127.0.0.1:$1/ready', timeout=2)" \
      2>/dev/null; then
      return 0
    fi
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done
    sleep 2
  done
  return 1
}

# Runs the rates against port $2, writing $out/$1-rate-R.json.
bench_rates() {
  for rate in $rates; do
    "$bin" bench --endpoint "http://127.0.0.1:$2" --token-ids --input-len "$input" \
      --output-len "$output" --rate "$rate" --num-requests "$requests" --slo 2000,50 \
      --output "$out/$1-rate-$rate.json" >"$out/$1-rate-$rate.txt" 2>&1 ||
      echo "bench $1 at $rate req/s: rc=$? (see $out/$1-rate-$rate.txt)"
  done
}

# 2. The disaggregated cluster, one process per unit.
started=$SECONDS
"$bin" router --config "$cfg" >"$out/router.log" 2>&1 &
pids+=($!)
for name in $(names prefill); do
  "$bin" prefill --config "$cfg" --name "$name" >"$out/$name.log" 2>&1 &
  pids+=($!)
done
for name in $(names decode); do
  "$bin" decode --config "$cfg" --name "$name" >"$out/$name.log" 2>&1 &
  pids+=($!)
done
wait_ready "$router_port" || { tail -5 "$out"/*.log; fail "the cluster did not become ready"; }
echo "cluster ready after $((SECONDS - started)) s"
bench_rates pd "$router_port"
stop_all

# 3. The same model colocated.
if [ "$colocated" != none ]; then
  started=$SECONDS
  # shellcheck disable=SC2086  # COLOCATED is a list of arguments
  "$bin" serve --model "$model" --port "$colocated_port" $colocated >"$out/colocated.log" 2>&1 &
  pids+=($!)
  wait_ready "$colocated_port" || { tail -5 "$out/colocated.log"; fail "serve did not become ready"; }
  echo "colocated ready after $((SECONDS - started)) s"
  bench_rates colocated "$colocated_port"
  stop_all
fi

# 4. The table.
python3 - "$out" "$layers" "$gpus" <<'EOF'
import glob, json, os, sys
out, layers, gpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print(f"| mode | rate req/s | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p50 x 43/{layers} ms "
      "| output tok/s | per GPU | goodput req/s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
rows = []
for path in glob.glob(os.path.join(out, "*-rate-*.json")):
    mode, rate = os.path.basename(path)[:-5].split("-rate-")
    rows.append((mode, float(rate), json.load(open(path))))
for mode, rate, s in sorted(rows, key=lambda r: (r[0] != "pd", r[1])):
    ttft, tpot = s["ttft_ms"], s["tpot_ms"]
    tok = s["output_token_throughput"]
    done = s["completed"]
    print(f"| {mode} | {rate:g} | {done}/{done + s['failed']} | {ttft['p50']:.0f} | {ttft['p99']:.0f} "
          f"| {tpot['p50']:.1f} | {tpot['p50'] * 43 / layers:.1f} | {tok:.0f} | {tok / gpus:.0f} "
          f"| {s.get('goodput', float('nan')):.2f} |")
EOF
