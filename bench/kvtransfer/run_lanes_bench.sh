#!/bin/bash
# The full transfer protocol (kv_transfer_bench pdserve: headers, xxh3 on both sides, commit,
# verification) with 1, 2 and 4 lanes (docs/protocol.md, "Lanes") over UCX tcp and shared memory
# on this machine, 1 MiB pages. Rounds interleave the lane counts so that load from other
# processes hits them alike; each figure is the best over `rounds` rounds (best of 3 iterations
# per round), with the median of the round bests beside it.
# Usage: bench/kvtransfer/run_lanes_bench.sh [build dir] [rounds] [total MiB] [lanes ...]
# Prints a markdown table (GB/s = 1e9 bytes per second) after a line naming date, host and load.
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
total_mib=${3:-1024}
shift 3 || shift $# || true
lanes=("${@:-1 2 4}")
read -r -a lanes <<<"${lanes[*]}"
bench=$build/bench/kvtransfer/kv_transfer_bench

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
     "$(ucx_info -v 2>/dev/null | head -1 | sed 's/# //'); load average at start" \
     "$(cut -d' ' -f1-3 /proc/loadavg); ${total_mib} MiB of 1 MiB pages; best of $rounds rounds"
echo
echo "| UCX_TLS | lanes | best GB/s | median of round bests GB/s | load average at end |"
echo "| --- | --- | --- | --- | --- |"
for tls in tcp "shm,self"; do
  declare -A results=()
  for _ in $(seq "$rounds"); do
    for n in "${lanes[@]}"; do
      best=$(UCX_TLS=$tls timeout 300 "$bench" pdserve "$total_mib" 1024 3 "$n" 2>/dev/null |
               awk '/^best/ {print $2}')
      results[$n]="${results[$n]:-} ${best:-0}"
    done
  done
  for n in "${lanes[@]}"; do
    # shellcheck disable=SC2086
    stats=$(printf '%s\n' ${results[$n]} | sort -g |
              awk '{v[NR] = $1} END {printf "%.3f | %.3f", v[NR], v[int((NR + 1) / 2)]}')
    echo "| $tls | $n | $stats | $(cut -d' ' -f1 /proc/loadavg) |"
  done
  unset results
done
