#!/usr/bin/env bash
# The main job (`make demo`): `pdserve up --config deploy/local.yaml` starts the router, one
# prefill and one decode worker on this machine (CPU backend, bundled model); one streamed chat
# request goes through the router with curl, the answer is printed, then everything is stopped.
# A binary built without the workers (`pdserve prefill` missing) runs the colocated server
# (`pdserve serve`) instead.
set -euo pipefail
build=${1:-build}
config=${PDSERVE_CONFIG:-deploy/local.yaml}
model=${PDSERVE_MODEL:-models/kjv-v4-tiny}
log=$(mktemp)
errlog=$(mktemp)  # the processes' own log lines: shown only when something fails
server_pid=""
cleanup() {
  local status=$?
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -INT "$server_pid"
    wait "$server_pid" || true
  fi
  if [[ $status -ne 0 ]]; then
    echo "demo: the last lines the processes logged:" >&2
    tail -n 20 "$errlog" >&2
  fi
  rm -f "$log" "$errlog"
}
trap cleanup EXIT INT TERM

if "$build/pdserve" prefill --help >/dev/null 2>&1; then
  mode="pdserve up ($config)"
  "$build/pdserve" up --config "$config" >"$log" 2>"$errlog" &
  server_pid=$!
  pattern='s/^pdserve up: ready on \([^ ]*\).*/\1/p'
  tries=3000  # model loads in three processes
else
  mode="pdserve serve ($model, colocated: this build has no workers)"
  "$build/pdserve" serve --model "$model" --host 127.0.0.1 --port 0 >"$log" 2>"$errlog" &
  server_pid=$!
  pattern='s/^pdserve serve: listening on //p'
  tries=300
fi
url=""
for _ in $(seq 1 "$tries"); do
  url=$(sed -n "$pattern" "$log")
  [[ -n "$url" ]] && break
  kill -0 "$server_pid" 2>/dev/null || { echo "demo: $mode exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$url" ]] || { echo "demo: $mode did not start" >&2; exit 1; }
echo "demo: $mode at $url" >&2

question="Who was Moses, and what did he do?"
echo "user: $question"
printf 'assistant: '
curl -sS -N "$url/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON |
{"model": "$(basename "$model")", "stream": true, "max_tokens": 120, "seed": 1,
 "messages": [{"role": "user", "content": "$question"}]}
JSON
  python3 -c '
import json, sys
events, other = 0, []
for line in sys.stdin:
    if not line.startswith("data: "):
        other.append(line)  # not a stream: an error response (404, 429, ...) is a JSON body
    elif line.strip() != "data: [DONE]":
        events += 1
        event = json.loads(line[6:])
        if "error" in event:
            print("\ndemo: error from the server:", event["error"].get("message"))
            sys.exit(1)
        for choice in event.get("choices", []):
            sys.stdout.write(choice.get("delta", {}).get("content") or "")
            sys.stdout.flush()
print()
if events == 0:
    print("demo: no answer from the server:", "".join(other).strip()[:500])
    sys.exit(1)'
