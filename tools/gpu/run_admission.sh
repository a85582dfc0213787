#!/usr/bin/env bash
# Issue 26's admission against the CUDA engine's device page pools, one device call:
# `pdserve serve --backend cuda` on models/kjv-v4-wide three times, --max-batch 16 each time:
#   small: --state-tokens 1024, so each rate's pool holds ceil(1024 / r / 64) + 16 pages (rate 4:
#          20 pages) and a request of about 10 + 400 tokens reserves 2 of them: about 10 run at
#          once and the rest wait in the queue although slots are free;
#   full:  --state-tokens 0 (every slot full: nothing waits for pages);
#   auto:  --state-tokens auto (engine::AutoStateTokens from the memory plan, printed at start;
#          here the cap, every slot full, 16 x 4096 = 65536; 8 requests, all must complete).
# 24 greedy completions of 400 tokens are sent at once to small and full; the script checks that every one
# completes (HTTP 200, finish_reason length with 400 tokens, or stop at EOS), that the small server's queue was seen
# non-empty (pdserve_serve_sequences_waiting sampled from /metrics while they run), and compares
# each request's text with the full server's. Same text is expected; a difference can only come
# from a near-tie flipped by another decode batch size (runtime/cuda/gpu_step_runner.h, "Batch
# invariance"), and the table says how many differ.
# Then the same through PD (`pdserve up`, CUDA prefill + CUDA decode with the worker key
# `state_tokens: 1024`): 48 requests at once, the router queues them while the decode worker's
# device pages are short, all complete; an oversized request gets 400 (from the router's context
# check: with `pdserve up`'s 64 decode slots every pool keeps a page a slot, more than a
# 4096-token request needs, so the decode worker's own refusal of a request larger than a whole
# device pool, FAILED_PRECONDITION -> 400, is shown on the CPU instead:
# tests/decode/device_pages_test.cc, tests/router/service_admission_test.cc).
# Also runs, when PACK has them, the packed engine_gpu_tests' GpuBackendTest.SmallDevicePools*
# (the same on the tiny model, fp32 GEMMs, exact equality) and
# GpuStepRunnerTest.PoolsTooSmall* (a scheduler that reserves no device pages: the runner stops
# the two newest of four sequences with ResourceExhausted, the two oldest match full pools).
# Each part runs where its model is in the tree: the serve part needs models/kjv-v4-wide (a
# `tools/gpu/device_tree.sh wide` tree), the engine tests models/kjv-v4-tiny (a `tests` tree);
# the table says SKIPPED for the other.
# Pack here: `tools/gpu/device_tree.sh bundle build` (pdserve in .device-carry/bin, the engine
# tests in .device-carry/gpu; unpack there as device_tree.sh says), or by hand
#   tools/gpu/pack_binaries.sh .device-carry/bin build/pdserve
#   tools/gpu/pack_engine_tests.sh build .device-carry/gpu
# there, from the repository root:
#   OUT=$OUT tools/gpu/run_admission.sh
# Environment: BINS (.device-carry/bin), PACK (.device-carry/gpu), OUT (gpu-out/admit),
# REQUESTS (24), PD_REQUESTS (48), MAX_TOKENS (400). Logs under $OUT; a short table is printed last. Expected run
# time: about 2.5 min (five model loads of a few seconds, four rounds of 400-token decodes).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out/admit}
bins=${BINS:-.device-carry/bin}
pack=${PACK:-.device-carry/gpu}
requests=${REQUESTS:-24}
max_tokens=${MAX_TOKENS:-400}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

if [ ! -f models/kjv-v4-tiny/model.safetensors ]; then
  row "engine_gpu_tests SmallDevicePools + PoolsTooSmall (tiny)" "SKIPPED" "no models/kjv-v4-tiny"
elif [ -f "$pack/libs.tar.xz" ]; then
  mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
  cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
  chmod +x "$pack/bin/engine_gpu_tests"
  LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:${LD_LIBRARY_PATH:-} PDSERVE_SOURCE_DIR=$PWD \
    timeout 200 "$pack/bin/engine_gpu_tests" --gtest_filter='GpuBackendTest.SmallDevicePools*:GpuStepRunnerTest.PoolsTooSmall*' \
    > "$out/engine.log" 2>&1
  row "engine_gpu_tests SmallDevicePools + PoolsTooSmall (tiny)" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "$(grep -E '^\[  PASSED|^\[  FAILED' "$out/engine.log" | tr '\n' ' ')($(elapsed))"
else
  row "engine_gpu_tests SmallDevicePools + PoolsTooSmall (tiny)" "SKIPPED" "no $pack/libs.tar.xz"
fi

if [ ! -d models/kjv-v4-wide ]; then
  row "serve kjv-v4-wide" "SKIPPED" "no models/kjv-v4-wide"
elif [ ! -f "$bins/env.sh" ]; then
  row "serve kjv-v4-wide" "SKIPPED" "no $bins/env.sh (tools/gpu/pack_binaries.sh)"
else
  # shellcheck disable=SC1091
  source "$bins/env.sh"
  cat > "$out/client.py" <<'PY'
import concurrent.futures, json, re, sys, threading, time, urllib.request
port, n, max_tokens, dest = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# The gauge whose largest value while the requests run is "most waiting".
waiting_metric = sys.argv[5]
base = f"http://127.0.0.1:{port}"
prompts = ["In the beginning", "And God said", "The LORD is my shepherd", "Blessed are the meek",
           "For God so loved the world", "And it came to pass", "Thus saith the LORD",
           "Now the serpent was more subtil"]
done = threading.Event()
most_waiting = [0]
def watch():
    while not done.is_set():
        try:
            text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
            m = re.search(r"^" + waiting_metric + r"\S*\s+([0-9.e+]+)", text, re.M)
            if m: most_waiting[0] = max(most_waiting[0], int(float(m.group(1))))
        except Exception:
            pass
        time.sleep(0.05)
def one(i):
    body = {"model": "kjv-v4-wide", "prompt": prompts[i % len(prompts)] + " " * (i // len(prompts)),
            "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        r = json.loads(urllib.request.urlopen(req, timeout=300).read())
        c = r["choices"][0]
        return {"text": c["text"], "finish": c["finish_reason"],
                "tokens": r["usage"]["completion_tokens"]}
    except Exception as e:  # an HTTP error or a dropped connection fails the check
        return {"error": str(e)}
w = threading.Thread(target=watch); w.start()
t = time.time()
with concurrent.futures.ThreadPoolExecutor(n) as pool:
    results = list(pool.map(one, range(n)))
done.set(); w.join()
json.dump({"results": results, "most_waiting": most_waiting[0], "seconds": time.time() - t},
          open(dest, "w"))
PY
  wait_ready() {  # port, pid, seconds: /ready answers 200 while the process lives
    for _ in $(seq 1 $(($3 * 2))); do
      curl -sf "http://127.0.0.1:$1/ready" > /dev/null 2>&1 && return 0
      kill -0 "$2" 2>/dev/null || return 1
      sleep 0.5
    done
    return 1
  }
  serve_and_send() {  # label, state tokens, port[, requests]
    local label=$1 port=$3 n=${4:-$requests}
    pdserve serve --model models/kjv-v4-wide --backend cuda --port "$port" --max-batch 16 \
      --token-budget 512 --state-tokens "$2" > "$out/serve-$label.log" 2>&1 &
    local pid=$!
    if wait_ready "$port" "$pid" 120; then
      python3 "$out/client.py" "$port" "$n" "$max_tokens" "$out/$label.json" \
        pdserve_serve_sequences_waiting > "$out/client-$label.log" 2>&1
    else
      echo "not ready: $(tail -3 "$out/serve-$label.log")" > "$out/client-$label.log"
    fi
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  }
  serve_and_send small 1024 18310
  serve_and_send full 0 18311
  # --state-tokens auto: the memory plan's T (engine::AutoStateTokens), printed at start; on an
  # H200, 16 slots of kjv-v4-wide's 4096 tokens fit many times over, so T is the cap, every slot
  # full: 16 x 4096 = 65536, and nothing waits.
  serve_and_send auto auto 18312 8
  auto_t=$(sed -n 's/.*--state-tokens auto: \([0-9]*\) tokens.*/\1/p' "$out/serve-auto.log" | head -1)
  auto_ok=$(python3 - "$out/auto.json" "$max_tokens" <<'PY' 2>&1
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"no results: {e}"); sys.exit()
want = int(sys.argv[2])
ok = lambda x: "error" not in x and ((x["finish"] == "length" and x["tokens"] == want) or
                                     (x["finish"] == "stop" and x["tokens"] <= want))
print(f"{sum(ok(x) for x in r['results'])}/{len(r['results'])} complete, most waiting "
      f"{r['most_waiting']}")
PY
)
  row "serve --state-tokens auto: T printed, every request completes" \
    "$([ "${auto_t:-}" = 65536 ] && [[ "$auto_ok" == "8/8 complete"* ]] && echo PASS || echo FAIL)" \
    "T ${auto_t:-not printed} (expected 65536, the cap), $auto_ok"
  summary=$(python3 - "$out/small.json" "$out/full.json" "$max_tokens" <<'PY' 2>&1
import json, sys
try:
    small, full = (json.load(open(p)) for p in sys.argv[1:3])
except Exception as e:
    print(f"FAIL|no results: {e}|FAIL|-"); sys.exit()
want = int(sys.argv[3])
# Complete: no error, and either all max_tokens or an EOS before them (greedy KJV text does
# end a verse with EOS: the full server's run on an H200 stopped 2 of 24 early, 2026-12-04).
ok = lambda r: "error" not in r and ((r["finish"] == "length" and r["tokens"] == want) or
                                     (r["finish"] == "stop" and r["tokens"] <= want))
complete = sum(ok(r) for r in small["results"])
n = len(small["results"])
same = sum(ok(a) and ok(b) and a["text"] == b["text"]
           for a, b in zip(small["results"], full["results"]))
first_err = next((r["error"] for r in small["results"] if "error" in r), "")
verdict = "PASS" if complete == n and small["most_waiting"] > 0 else "FAIL"
print(f"{verdict}|{complete}/{n} complete ({want} tokens or EOS), most waiting "
      f"{small['most_waiting']} (full server: {full['most_waiting']}), "
      f"{small['seconds']:.1f} s vs {full['seconds']:.1f} s {first_err[:120]}"
      f"|{'PASS' if same == n else 'DIFF'}|{same}/{n} texts equal to the full server's")
PY
)
  IFS='|' read -r v1 d1 v2 d2 <<< "$summary"
  row "small pool: every request completes, queue seen waiting" "$v1" "$d1 ($(elapsed))"
  row "small pool text == full pool text" "$v2" "$d2"
  grep -iE "error|exhausted" "$out/serve-small.log" | head -5 >&2

  # PD: `pdserve up` with a CUDA prefill and a CUDA decode worker whose `state_tokens` is 1024
  # (64 batch slots: the rate-4 pool holds ceil(1024 / 4 / 64) + 64 = 68 pages, a request of
  # about 10 + 400 tokens reserves 2), PD_REQUESTS (48) requests at once: the decode worker's
  # Reserve answers RESOURCE_EXHAUSTED once its device pages are short, the router queues them
  # (pdserve_router_queue_depth seen > 0, pdserve_router_queued_total > 0) and every request
  # completes; then one request whose prompt + max_tokens exceeds the model's context gets 400.
  cat > "$out/pd.yaml" <<YAML
name: admission-pd
share_gpus: true
model: {path: models/kjv-v4-wide, served_name: kjv-v4-wide}
router: {host: 127.0.0.1, http_port: 18420, health_interval_ms: 5000, queue_timeout_ms: 300000}
prefill:
  - {name: prefill-0, host: 127.0.0.1, port: 18421, metrics_port: 18422, backend: cuda, gpus: "0"}
decode:
  - {name: decode-0, host: 127.0.0.1, port: 18423, metrics_port: 18424, backend: cuda, gpus: "0", state_tokens: 1024}
transfer: {transport: ucx, lease_ms: 30000}
YAML
  pdserve up --config "$out/pd.yaml" > "$out/up.log" 2>&1 &
  up_pid=$!
  if wait_ready 18420 "$up_pid" 240; then
    python3 "$out/client.py" 18420 "${PD_REQUESTS:-48}" "$max_tokens" "$out/pd.json" \
      pdserve_router_queue_depth > "$out/client-pd.log" 2>&1
    curl -sf http://127.0.0.1:18420/metrics > "$out/pd.router.metrics"
    curl -sf http://127.0.0.1:18424/metrics > "$out/pd.decode.metrics"
    too_long=$(curl -s -o "$out/pd-too-long.json" -w '%{http_code}' \
      http://127.0.0.1:18420/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "kjv-v4-wide", "prompt": "In the beginning", "max_tokens": 1000000}')
    pd=$(python3 - "$out/pd.json" "$max_tokens" "$out/pd.router.metrics" <<'PY' 2>&1
import json, re, sys
r = json.load(open(sys.argv[1])); want = int(sys.argv[2])
queued = re.search(r"^pdserve_router_queued_total\S*\s+([0-9.e+]+)", open(sys.argv[3]).read(), re.M)
queued = int(float(queued.group(1))) if queued else -1
ok = lambda x: "error" not in x and ((x["finish"] == "length" and x["tokens"] == want) or
                                     (x["finish"] == "stop" and x["tokens"] <= want))
n = len(r["results"]); complete = sum(ok(x) for x in r["results"])
err = next((x["error"] for x in r["results"] if "error" in x), "")
v = "PASS" if complete == n and r["most_waiting"] > 0 and queued > 0 else "FAIL"
print(f"{v}|{complete}/{n} complete, router queue depth up to {r['most_waiting']}, "
      f"queued_total {queued}, {r['seconds']:.1f} s {err[:120]}")
PY
)
    IFS='|' read -r v3 d3 <<< "$pd"
    row "PD: decode worker state_tokens 1024, requests queue for device pages" "$v3" "$d3 ($(elapsed))"
    row "PD: prompt + max_tokens beyond the context" \
      "$([ "$too_long" = 400 ] && echo PASS || echo FAIL)" \
      "HTTP $too_long $(head -c 200 "$out/pd-too-long.json")"
    # The decode worker's ledger of the device pools (kind="device"): all free again at the end.
    device_free=$(sed -n 's/^pdserve_decode_pool_pages_free{kind="device"} \([0-9.e+]*\)$/\1/p' \
      "$out/pd.decode.metrics")
    row "PD: decode worker's device pages all free after the run" \
      "$([ -n "$device_free" ] && [ "$(grep -c '^pdserve_decode_pool_pages_used{kind="device"} 0$' "$out/pd.decode.metrics")" = 1 ] && echo PASS || echo FAIL)" \
      "pages free ${device_free:-none (no kind=\"device\" series)}, $(grep '^pdserve_decode_pool_pages_used{kind="device"}' "$out/pd.decode.metrics")"
  else
    row "PD: decode worker state_tokens 1024" "FAIL" "not ready: $(tail -2 "$out/up.log" | tr '\n' ' ')"
  fi
  kill -INT "$up_pid" 2>/dev/null
  wait "$up_pid" 2>/dev/null
fi

echo
echo "| check | result | details |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
