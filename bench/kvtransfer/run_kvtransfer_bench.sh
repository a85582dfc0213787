#!/bin/bash
# Transfer bandwidth of 1 GiB of pages: the kvtransfer protocol and raw UCX put / tag / AM
# (kv_transfer_bench) against ucx_perftest with the same message size, in one run, per transport.
# Usage: bench/kvtransfer/run_kvtransfer_bench.sh [build dir] [page KiB ...]
# Prints a markdown table; GB/s = 1e9 bytes per second, best of the iterations.
set -euo pipefail
build=${1:-build}
shift || true
pages_kib=("${@:-1024}")
bench=$build/bench/kvtransfer/kv_transfer_bench
total_mib=1024
iterations=5
port=$((20000 + RANDOM % 20000))

# ucx_perftest's overall bandwidth (MB/s = 2^20 bytes/s) for one test, in GB/s.
perftest() {
  local tls=$1 test=$2 bytes=$3
  port=$((port + 1))
  UCX_TLS=$tls ucx_perftest -p $port >/dev/null 2>&1 &
  local server=$!
  sleep 1
  local line
  line=$(UCX_TLS=$tls timeout 120 ucx_perftest -p $port localhost -t "$test" -s "$bytes" \
           -n $(( (total_mib << 20) / bytes )) -w 16 2>/dev/null | grep Final || true)
  wait $server 2>/dev/null || true
  if [[ -z $line ]]; then echo "n/a"; return; fi
  awk '{printf "%.3f", $7 * 1048576 / 1e9}' <<<"$line"
}

ours() {
  local tls=$1 mode=$2 kib=$3
  UCX_TLS=$tls timeout 300 "$bench" "$mode" $total_mib "$kib" $iterations 2>/dev/null |
    awk '/^best/ {print $2}'
}

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); $(ucx_info -v | head -1 | sed 's/# //');" \
     "load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| UCX_TLS | page | pdserve | raw am | raw tag | raw put | perftest am_bw | perftest tag_bw | perftest put_bw | pdserve / perftest am |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for tls in tcp "shm,self"; do
  for kib in "${pages_kib[@]}"; do
    bytes=$((kib << 10))
    p=$(ours "$tls" pdserve "$kib"); am=$(ours "$tls" am "$kib"); tag=$(ours "$tls" tag "$kib")
    put=$(ours "$tls" put "$kib")
    pam=$(perftest "$tls" ucp_am_bw $bytes); ptag=$(perftest "$tls" tag_bw $bytes)
    pput=$(perftest "$tls" ucp_put_bw $bytes)
    ratio=$(awk -v a="$p" -v b="$pam" 'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }')
    echo "| $tls | ${kib} KiB | $p | $am | $tag | $put | $pam | $ptag | $pput | $ratio |"
  done
done
