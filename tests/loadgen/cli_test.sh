#!/bin/bash
# `pdserve bench` and `pdserve check` end to end through the CLI against a stub OpenAI server
# (fake_openai_server.py): exit codes, JSON output, the shipped KJV prompt set, bench --help.
# Usage: cli_test.sh PDSERVE DEPLOY_DIR
set -euo pipefail
pdserve=$1 deploy=$2
here=$(dirname "$0")
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT

start_stub() {  # start_stub MODE -> sets $port
  python3 "$here/fake_openai_server.py" --mode "$1" >"$tmp/port.$1" &
  pids+=($!)
  for _ in $(seq 50); do
    [[ -s $tmp/port.$1 ]] && break
    sleep 0.1
  done
  port=$(cat "$tmp/port.$1")
}

start_stub varied
varied=http://127.0.0.1:$port/v1
"$pdserve" bench --endpoint "$varied" --api chat --num-requests 12 --concurrency 4 \
  --output-len 8 --slo 5000,1000 --json >"$tmp/bench.json"
python3 - "$tmp/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 12 and r["failed"] == 0, r
assert r["output_tokens"] == 12 * 8, r
assert r["good_requests"] == 12, r
print("bench ok:", r["request_throughput"], "req/s")
PY
"$pdserve" check --endpoint "$varied" --prompts "$deploy/check/kjv-prompts.jsonl" --samples 2 \
  --max-tokens 16 >"$tmp/check_varied.txt"
grep -q "^PASS" "$tmp/check_varied.txt"
echo "check passes a varied server"

# Values JSON cannot carry are refused before anything is sent (a NaN temperature went out as
# null: the server's default sampled; a NaN rate hung the run).
for args in "--temperature nan --num-requests 1" "--rate nan --duration 1"; do
  status=0
  # shellcheck disable=SC2086
  timeout 60 "$pdserve" bench --endpoint "$varied" $args >"$tmp/nan.txt" 2>&1 || status=$?
  [[ $status == 1 ]] || { echo "bench $args exited $status, wanted 1"; cat "$tmp/nan.txt"; exit 1; }
done
echo "bench refuses NaN settings"

# A summary that cannot be written is an error, also a small one a stream would have buffered.
status=0
"$pdserve" bench --endpoint "$varied" --num-requests 1 --output-len 2 --output /dev/full \
  >/dev/null 2>"$tmp/full.txt" || status=$?
if [[ $status != 1 ]] || ! grep -qF "No space left on device" "$tmp/full.txt"; then
  echo "bench --output /dev/full: exit $status, $(cat "$tmp/full.txt")"; exit 1
fi
echo "bench reports an output it could not write"

start_stub repeat
status=0
"$pdserve" check --endpoint "http://127.0.0.1:$port" --prompts "$deploy/check/prompts.jsonl" \
  --samples 2 --max-tokens 40 --json --output "$tmp/check.json" >/dev/null || status=$?
[[ $status == 1 ]] || { echo "check on a degenerate server exited $status, wanted 1"; exit 1; }
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert not r['pass']; \
assert r['prompts'][0]['samples'][0]['tokenization'] == 'logprobs'" "$tmp/check.json"
echo "check fails a degenerate server (exit 1)"

status=0
"$pdserve" bench --endpoint http://10.255.255.1:8000 --num-requests 1 2>/dev/null || status=$?
[[ $status == 1 ]] || { echo "bench accepted a remote endpoint without --allow-remote"; exit 1; }
echo "bench refuses a remote endpoint by default"

# The help says which bound is required and that --ignore-eos is the default; without a bound
# bench stops before contacting the endpoint (nothing listens on port 1).
help=$("$pdserve" bench --help)
grep -qF "Required: --num-requests N or --duration S" <<<"$help" || { echo "$help"; exit 1; }
grep -A1 -- "--ignore-eos" <<<"$help" | grep -qF "the default" || { echo "$help"; exit 1; }
if grep -qF "{false}" <<<"$help"; then echo "help still shows {false}: $help"; exit 1; fi
status=0
"$pdserve" bench --endpoint http://127.0.0.1:1 2>"$tmp/err" || status=$?
[[ $status == 1 ]] && grep -qF "give --num-requests N or --duration SECONDS" "$tmp/err" || {
  echo "bench without a bound: exit $status, $(cat "$tmp/err")"; exit 1; }
echo "bench help and a missing bound are clear"
