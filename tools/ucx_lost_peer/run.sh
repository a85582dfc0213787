#!/bin/bash
# Reproduces the prefill worker's abort at shutdown under UCX's v2 protocols after its decode peer
# was killed mid-transfer (docs/protocol.md, "UCX protocols"): starts a decode and a prefill
# worker of the bundled model on loopback (UCX_TLS=tcp, ports 28750-28755), runs
# prefill_then_kill.py, then stops the prefill worker with SIGTERM and reports its exit status
# (134: SIGABRT in ucp_cleanup). The abort does not come every run: RUNS runs; the log of each
# run whose prefill worker exits non-zero is kept. REGISTER_PAGES (true|false) is the deployment's
# transfer.register_pages (docs/protocol.md, "Registered page memory"). The last line counts runs,
# kills mid-transfer (the Prefill did not answer OK) and aborts; the exit status is 1 after any
# abort.
#
# Usage, from the repository root:
#   tools/ucx_lost_peer/run.sh [PROTOCOLS=v2] [KILL_AFTER_S=0.1] [RUNS=8] [REGISTER_PAGES=false]
# Env: PDSERVE (default build/pdserve), PYTHON (default /var/lib/pdserve/venv/bin/python).
set -u
protocols=${1:-v2}; kill_after=${2:-0.1}; runs=${3:-8}; register=${4:-false}
mid=0; aborts=0
bin=${PDSERVE:-build/pdserve}; python=${PYTHON:-/var/lib/pdserve/venv/bin/python}
here=$(cd "$(dirname "$0")" && pwd); dir=$(mktemp -d)
cat > "$dir/deploy.yaml" <<YAML
name: ucx-lost-peer
model:
  path: $(pwd)/models/kjv-v4-tiny
  served_name: kjv-v4-tiny
router: {host: 127.0.0.1, http_port: 28750, grpc_port: 28751}
prefill:
  - {name: prefill-0, host: 127.0.0.1, port: 28752, metrics_port: 28753, backend: cpu, threads: 1}
decode:
  - {name: decode-0, host: 127.0.0.1, port: 28754, metrics_port: 28755, backend: cpu, threads: 1}
transfer: {transport: ucx, lease_ms: 30000, ucx_protocols: $protocols, register_pages: $register}
YAML
export UCX_TLS=${UCX_TLS:-tcp}
for run in $(seq "$runs"); do
  "$bin" decode --config "$dir/deploy.yaml" --name decode-0 > "$dir/decode.log" 2>&1 & dpid=$!
  "$bin" prefill --config "$dir/deploy.yaml" --name prefill-0 > "$dir/prefill.log" 2>&1 & ppid=$!
  for _ in $(seq 60); do
    grep -q "gRPC on" "$dir/decode.log" && grep -q "gRPC on" "$dir/prefill.log" && break
    sleep 1
  done
  outcome=$(timeout 90 "$python" "$here/prefill_then_kill.py" 127.0.0.1:28752 127.0.0.1:28754 \
    "$dpid" "$kill_after" 2>&1 | tail -1)
  kill -9 "$dpid" 2>/dev/null; wait "$dpid" 2>/dev/null
  sleep 1
  kill -TERM "$ppid"; wait "$ppid"; code=$?
  echo "run $run ($protocols, register_pages $register, kill after ${kill_after}s):" \
    "$outcome; prefill worker exit $code"
  case "$outcome" in *"prefill: OK"*) ;; *) mid=$((mid + 1)) ;; esac
  if [ "$code" -ne 0 ]; then
    aborts=$((aborts + 1))
    grep -E "not returned to mpool|inuse region|Assertion" "$dir/prefill.log" | head -4
    cp "$dir/prefill.log" "$dir/prefill.run$run.log"
    echo "prefill log: $dir/prefill.run$run.log"
  fi
done
echo "summary ($protocols, register_pages $register, kill after ${kill_after}s):" \
  "runs $runs, killed mid-transfer $mid, aborts $aborts"
[ "$aborts" -eq 0 ] && rm -rf "$dir"
[ "$aborts" -eq 0 ]
