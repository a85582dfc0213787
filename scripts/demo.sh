#!/usr/bin/env bash
# The main job (`make demo`). Until the disaggregated cluster exists it runs the colocated server
# (`pdserve serve`) on the bundled model, sends one streamed chat request with curl, prints the
# answer and stops the server.
set -euo pipefail
build=${1:-build}
model=${PDSERVE_MODEL:-models/kjv-v4-tiny}
log=$(mktemp)
server_pid=""
cleanup() {
  if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid"
    wait "$server_pid" || true
  fi
  rm -f "$log"
}
trap cleanup EXIT INT TERM

"$build/pdserve" serve --model "$model" --host 127.0.0.1 --port 0 >"$log" &
server_pid=$!
url=""
for _ in $(seq 1 300); do
  url=$(sed -n 's/^pdserve serve: listening on //p' "$log")
  [[ -n "$url" ]] && break
  kill -0 "$server_pid" 2>/dev/null || { echo "demo: pdserve serve exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n "$url" ]] || { echo "demo: pdserve serve did not start" >&2; exit 1; }
echo "demo: pdserve serve ($model) at $url" >&2

question="Who was Moses, and what did he do?"
echo "user: $question"
printf 'assistant: '
curl -sS -N "$url/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON |
{"model": "$(basename "$model")", "stream": true, "max_tokens": 120, "seed": 1,
 "messages": [{"role": "user", "content": "$question"}]}
JSON
  python3 -c '
import json, sys
for line in sys.stdin:
    if line.startswith("data: ") and line.strip() != "data: [DONE]":
        for choice in json.loads(line[6:]).get("choices", []):
            sys.stdout.write(choice.get("delta", {}).get("content") or "")
            sys.stdout.flush()
print()'
