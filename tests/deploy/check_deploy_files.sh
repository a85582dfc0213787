#!/bin/bash
# Checks the shipped deployment files with the tools that consume them (ctest deploy.*).
# Usage: check_deploy_files.sh MODE ARGS...; exit 77 (ctest SKIP_RETURN_CODE) when a tool is
# missing, with a message saying which.
#   promtool-rules RULES.yml           promtool check rules
#   promtool-config PROMETHEUS.yml     promtool check config (also checks its rule files)
#   promtool-test RULE_TESTS.yml       promtool test rules (alert cases: tests/deploy/alerts_test.yml)
#   ldd-prometheus PDSERVE             the binary links Prometheus's C++ client (libprometheus-cpp)
#   systemd-verify UNIT_DIR PDSERVE    systemd-analyze verify on copies of the units whose
#                                      ExecStart names the built binary; any warning fails
#   configs-valid PDSERVE CONFIG_DIR   `pdserve validate-config` accepts every shipped config
#   configs-broken PDSERVE CONFIG_DIR  broken copies are rejected with file:line:column: key
#   port-taken PDSERVE REPO_DIR         a second decode worker on a taken gRPC port exits with an
#                                      error instead of sharing the port (SO_REUSEPORT off)
#   cuda-accepted PDSERVE CONFIG_DIR BACKENDS
#                                      validate-config takes backend cuda workers without a
#                                      warning, and a cuda prefill worker is not refused; with
#                                      BACKENDS=cpu (a build without the CUDA backend) it is
#                                      refused for that reason only
#   dashboard DEPLOY_DIR METRICS_MD    every pdserve_* name used by the dashboard and the
#                                      alert rules is listed in docs/metrics.md
#   up-model-path PDSERVE CONFIG_DIR   `pdserve up` run where local.yaml's relative model path
#                                      does not exist starts no child and names the path and
#                                      the working directory (validate-config warns the same)
#   router-grpc-taken PDSERVE REPO_DIR a router whose gRPC port is taken exits 1 naming it and
#                                      never prints "listening" (a launcher trusts that line)
#   serve-gpu-flags PDSERVE            `pdserve serve` refuses GPU flags that would do nothing
#                                      (--devices / --expert-comm / --weights with --backend cpu,
#                                      an unknown --weights, an empty
#                                      --devices) with exit 1 or CLI11's usage error, no server
set -euo pipefail
mode=$1
shift

need() {
  if ! command -v "$1" >/dev/null 2>&1; then
    echo "SKIP: $1 is not installed (Debian package $2)"
    exit 77
  fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

case $mode in
  promtool-rules)
    need promtool prometheus
    promtool check rules "$1"
    ;;
  promtool-config)
    need promtool prometheus
    promtool check config "$1"
    ;;
  promtool-test)
    need promtool prometheus
    promtool test rules "$1"
    ;;
  ldd-prometheus)
    libs=$(ldd "$1")
    grep -E '^\s*libprometheus-cpp-core\.so' <<<"$libs" || {
      echo "FAIL: $1 does not link libprometheus-cpp-core:"
      echo "$libs"
      exit 1
    }
    ;;
  systemd-verify)
    need systemd-analyze systemd
    units=$1 binary=$2
    cp "$units"/*.service "$tmp"/
    sed -i "s|/usr/local/bin/pdserve|$binary|" "$tmp"/*.service
    grep -q "ExecStart=$binary " "$tmp"/pdserve-router.service
    ln -s pdserve-prefill@.service "$tmp"/pdserve-prefill@gpu0.service
    ln -s pdserve-decode@.service "$tmp"/pdserve-decode@gpu0.service
    out=$(cd "$tmp" && systemd-analyze verify --man=no ./pdserve-router.service \
      ./pdserve-prefill@gpu0.service ./pdserve-decode@gpu0.service 2>&1) || {
      echo "$out"
      exit 1
    }
    if [[ -n $out ]]; then
      echo "systemd-analyze verify warned:"
      echo "$out"
      exit 1
    fi
    # Every flag a unit passes must be one its subcommand accepts (systemd cannot check that).
    for unit in "$units"/*.service; do
      cmdline=$(sed -n 's/^ExecStart=[^ ]* //p' "$unit")
      sub=${cmdline%% *}
      help=$("$binary" "$sub" --help)
      for flag in $(grep -oE -- '--[a-z-]+' <<<"$cmdline"); do
        grep -qE -- "(^|[ ,])$flag( |,|$)" <<<"$help" || {
          echo "$(basename "$unit"): 'pdserve $sub' has no flag $flag"
          exit 1
        }
      done
    done
    echo "units verified"
    ;;
  configs-valid)
    "$1" validate-config "$2"/local.yaml "$2"/h200x2.yaml "$2"/h200x4-ep.yaml "$2"/cluster-8gpu.yaml "$2"/cluster-2host.yaml
    ;;
  configs-broken)
    pdserve=$1 dir=$2
    status=0
    # expect FILE SED_EXPR EXPECTED_ERROR_PREFIX (the file name and line come from the copy).
    expect() {
      local name=$1 expr=$2 want=$3
      sed "$expr" "$dir/$name" >"$tmp/$name"
      if "$pdserve" validate-config "$tmp/$name" >"$tmp/out" 2>"$tmp/err"; then
        echo "FAIL: $name with '$expr' was accepted"
        status=1
      elif ! grep -qF "$tmp/$name:$want" "$tmp/err"; then
        echo "FAIL: $name with '$expr': wanted '$want', got:"
        cat "$tmp/err"
        status=1
      else
        echo "ok: $(cat "$tmp/err")"
      fi
    }
    expect local.yaml 's/^  http_port: 8000/  http_port: 80000/' '9:14: router.http_port: '
    expect local.yaml 's/^    backend: cpu/    backend: gpu/' '19:14: prefill[0].backend: '
    expect local.yaml 's/^  transport: ucx/  transport: local/' '29:14: transfer.transport: '
    expect local.yaml 's/^  http_port: 8000/  http_port: "8000"/' '9:14: router.http_port: '
    expect local.yaml 's/^  host: 127.0.0.1/  host: 999.1.1.1/' '8:9: router.host: '
    expect local.yaml 's/^    host: 127.0.0.1/    host: "a b;rm -rf"/' '16:11: prefill[0].host: '
    expect local.yaml 's/^  lease_ms: 30000/  lease_ms: 100/' '30:13: transfer.lease_ms: '
    # A short lease is valid but warned about (the prefill queue gives up after half of it).
    sed 's/^  lease_ms: 30000/  lease_ms: 2000/' "$dir/local.yaml" >"$tmp/lease.yaml"
    if ! "$pdserve" validate-config "$tmp/lease.yaml" >"$tmp/out" 2>"$tmp/err" ||
      ! grep -qF "warning: transfer.lease_ms 2000 is below 10000" "$tmp/err"; then
      echo "FAIL: lease_ms 2000 not accepted with a warning:"
      cat "$tmp/err"
      status=1
    fi
    # Health checks no more often than the workers' idle limit: valid, warned about (the
    # router's channels to the workers go idle between checks).
    { cat "$dir/local.yaml"; printf 'grpc:\n  max_connection_idle_ms: 1000\n'; } >"$tmp/idle.yaml"
    if ! "$pdserve" validate-config "$tmp/idle.yaml" >"$tmp/out" 2>"$tmp/err" ||
      ! grep -qF "warning: router.health_interval_ms 1000 is not below grpc.max_connection_idle_ms 1000" "$tmp/err"; then
      echo "FAIL: max_connection_idle_ms 1000 not accepted with a warning:"
      cat "$tmp/err"
      status=1
    fi
    expect h200x2.yaml 's/^    gpus: "1"/    gpus: "0"/' '26:11: decode[0].gpus: '
    expect cluster-2host.yaml 's/^  prefill_policy: prefix_aware/  prefill_policy: sticky/' \
      '12:19: router.prefill_policy: '
    expect cluster-2host.yaml 's/^    port: 9210/    prot: 9210/' '49:5: decode[1].prot: '
    exit $status
    ;;
  port-taken)
    pdserve=$1 repo=$2
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    cd "$repo"  # the config's model path is relative to the repository root
    "$pdserve" decode --config deploy/local.yaml --name decode-0 --port "$port" --metrics-port 0 \
      >"$tmp/first.out" 2>"$tmp/first.err" &
    first=$!
    trap 'kill $first 2>/dev/null; rm -rf "$tmp"' EXIT
    for _ in $(seq 1 600); do
      grep -q "serving on" "$tmp/first.out" && break
      kill -0 $first 2>/dev/null || { echo "FAIL: first worker died:"; cat "$tmp/first.err"; exit 1; }
      sleep 0.1
    done
    grep -q "serving on" "$tmp/first.out" || { echo "FAIL: first worker not serving"; exit 1; }
    if timeout 30 "$pdserve" decode --config deploy/local.yaml --name decode-0 --port "$port" \
        --metrics-port 0 >"$tmp/second.out" 2>"$tmp/second.err"; then
      echo "FAIL: a second worker started on taken port $port"
      exit 1
    fi
    grep -qF "cannot serve gRPC on 127.0.0.1:$port" "$tmp/second.err" || {
      echo "FAIL: the second worker's error does not name the port:"; cat "$tmp/second.err"; exit 1; }
    kill -0 $first || { echo "FAIL: the first worker died"; exit 1; }
    echo "ok: $(grep -F 'cannot serve' "$tmp/second.err")"
    ;;
  router-grpc-taken)
    pdserve=$1 repo=$2
    # Hold a listening socket on a free port, then give that port to the router as grpc_port.
    python3 -c 'import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True); time.sleep(120)' >"$tmp/port" &
    holder=$!
    trap 'kill $holder 2>/dev/null; rm -rf "$tmp"' EXIT
    for _ in $(seq 1 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
    port=$(cat "$tmp/port")
    [ -n "$port" ] || { echo "FAIL: no port held"; exit 1; }
    sed "s/^  grpc_port: 8001$/  grpc_port: $port/" "$repo"/deploy/local.yaml >"$tmp/router.yaml"
    grep -q "grpc_port: $port" "$tmp/router.yaml" || { echo "FAIL: no grpc_port set"; exit 1; }
    if (cd "$repo" && timeout 60 "$pdserve" router --config "$tmp/router.yaml" --port 0) \
        >"$tmp/out" 2>"$tmp/err"; then
      echo "FAIL: the router started on a taken gRPC port"
      exit 1
    fi
    grep -qF "$port" "$tmp/err" || { echo "FAIL: the error does not name port $port:"; cat "$tmp/err"; exit 1; }
    if grep -q "listening" "$tmp/out"; then
      echo "FAIL: the router announced itself before failing:"; cat "$tmp/out"; exit 1
    fi
    echo "ok: $(tail -1 "$tmp/err")"
    ;;
  cuda-accepted)
    pdserve=$1 dir=$2 backends=$3
    "$pdserve" validate-config "$dir"/h200x2.yaml >"$tmp/out" 2>"$tmp/err"
    if grep -qF "warning: prefill worker" "$tmp/err"; then
      echo "FAIL: validate-config still warns about a backend cuda prefill worker:"; cat "$tmp/err"
      exit 1
    fi
    grep -qF "h200x2.yaml: ok" "$tmp/out" || { echo "FAIL: h200x2.yaml not valid"; exit 1; }
    # A backend cuda prefill worker is no longer refused: it gets as far as loading the model,
    # which is not here (nor, on CI, a GPU), and fails there.
    if timeout 60 "$pdserve" prefill --config "$dir"/h200x2.yaml --name prefill-0 \
        >"$tmp/out" 2>"$tmp/err"; then
      echo "FAIL: a prefill worker started without its model"
      exit 1
    fi
    if grep -qF "runs only the CPU engine" "$tmp/err"; then
      echo "FAIL: the backend cuda prefill worker was refused:"; cat "$tmp/err"; exit 1
    fi
    if [[ $backends == cpu ]]; then
      grep -qF "backend cuda: this pdserve was built without the CUDA backend" "$tmp/err" || {
        echo "FAIL: a build without CUDA did not say so:"; cat "$tmp/err"; exit 1; }
      echo "ok (no CUDA backend in this build): $(tail -1 "$tmp/err")"
      exit 0
    fi
    # The memory plan (engine/memory_plan.h) reads the model's config.json before the engine is
    # made, so without the model the worker stops there; either way it was not refused.
    grep -qE "backend cuda: prefill on CUDA_VISIBLE_DEVICES=0|config.json: cannot open model config" \
        "$tmp/err" || {
      echo "FAIL: the prefill worker did not take the CUDA engine:"; cat "$tmp/err"; exit 1; }
    echo "ok: $(tail -1 "$tmp/err")"
    ;;
  dashboard)
    deploy=$1 metrics=$2
    status=0
    for name in $(grep -ohE 'pdserve_[a-z0-9_]+' "$deploy"/grafana/*.json \
        "$deploy"/prometheus/alerts.yml | sed -E 's/_(bucket|sum|count)$//' | sort -u); do
      if ! grep -qF "\`$name\`" "$metrics"; then
        echo "FAIL: $name is used but not listed in $metrics"
        status=1
      fi
    done
    exit $status
    ;;
  up-model-path)
    pdserve=$1 dir=$(cd "$2" && pwd -P)
    here=$(cd "$tmp" && pwd -P)
    want="model path 'models/kjv-v4-tiny' has no config.json as seen from the working directory $here"
    if (cd "$here" && timeout 60 "$pdserve" up --config "$dir"/local.yaml) >"$tmp/out" \
        2>"$tmp/err"; then
      echo "FAIL: pdserve up started without the model"
      exit 1
    fi
    grep -qF "pdserve up: $dir/local.yaml: $want" "$tmp/err" || {
      echo "FAIL: the refusal does not name the path and the directory:"; cat "$tmp/err"; exit 1; }
    if grep -q "started" "$tmp/err"; then
      echo "FAIL: children were started before the refusal:"; cat "$tmp/err"; exit 1
    fi
    (cd "$here" && "$pdserve" validate-config "$dir"/local.yaml) >"$tmp/out" 2>"$tmp/err"
    grep -qF "local.yaml: warning: $want" "$tmp/err" || {
      echo "FAIL: validate-config does not warn the same way:"; cat "$tmp/err"; exit 1; }
    echo "ok: $(head -1 "$tmp/err")"
    ;;
  up-foreign-host)
    # A config naming another machine's address (192.0.2.1, TEST-NET-1: never this machine's):
    # `up` refuses before starting anything and says so, not "port not free".
    pdserve=$1 repo=$2
    sed 's/^  host: 127.0.0.1$/  host: 192.0.2.1/' "$repo"/deploy/local.yaml > "$tmp/foreign.yaml"
    grep -q "host: 192.0.2.1" "$tmp/foreign.yaml" || { echo "FAIL: no router host to replace"; exit 1; }
    if (cd "$repo" && timeout 60 "$pdserve" up --config "$tmp/foreign.yaml") >"$tmp/out" \
        2>"$tmp/err"; then
      echo "FAIL: pdserve up started with a foreign router host"
      exit 1
    fi
    grep -qF "router HTTP host 192.0.2.1 is not an address of this machine" "$tmp/err" || {
      echo "FAIL: the refusal does not say the host is not this machine's:"; cat "$tmp/err"; exit 1; }
    if grep -q "not free\|started" "$tmp/err"; then
      echo "FAIL: blamed a busy port or started children:"; cat "$tmp/err"; exit 1
    fi
    echo "ok: $(head -1 "$tmp/err")"
    ;;
  serve-gpu-flags)
    pdserve=$1
    refused() {  # refused WANT ARGS...: the command exits non-zero and its stderr names WANT
      local want=$1
      shift
      if timeout 20 "$pdserve" serve --port 0 "$@" >"$tmp/out" 2>"$tmp/err"; then
        echo "FAIL: serve $* was accepted"; cat "$tmp/err"; exit 1
      fi
      grep -qF -- "$want" "$tmp/err" || {
        echo "FAIL: serve $* did not say '$want':"; cat "$tmp/err"; exit 1; }
      ! grep -q "listening on" "$tmp/out" || { echo "FAIL: serve $* started"; exit 1; }
      echo "ok: serve $*: $(head -1 "$tmp/err")"
    }
    refused "the CPU engine uses neither" --backend cpu --devices 0,1
    refused "the CPU engine uses neither" --backend cpu --expert-comm local
    refused "an empty list names no GPU" --backend cuda --devices ""
    refused "the CPU engine dequantizes every weight" --backend cpu --weights fp8
    refused "--weights: fp4 not in {bf16,fp8}" --backend cuda --weights fp4
    refused "the CPU engine cuts prompts at every 64 tokens" --backend cpu --prefill-chunk 1024
    refused "must be 0 or a multiple of 64 in [64, 8192]" --backend cuda --prefill-chunk 100
    refused "must be 0 or a multiple of 64 in [64, 8192]" --backend cuda --prefill-chunk 16384
    ;;
  *)
    echo "unknown mode $mode"
    exit 2
    ;;
esac
