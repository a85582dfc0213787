#!/bin/bash
# Issue 27: would a receiver-pulled data path (D pulls each page with ucp_get_nbx from P's send
# memory) beat today's active messages over shared memory? Raw UCX operations of
# kv_transfer_bench on distinct pages (get / put from registered or UCX-allocated memory, AM,
# AM from UCX-allocated memory, AM with the rendezvous done by the sender's put) with UCX's v1
# and v2 protocols, a receiver-pulled protocol's shape (get-proto: both checksums, a request and
# an answer per page), the full protocol (pdserve) and
# one core's memcpy beside them, at 64 KiB and 1 MiB pages. Rounds interleave every
# configuration so that load from other processes hits them alike; a figure is the best over the
# rounds of each round's best of `iterations`, with the median of the round bests beside it.
# Usage: bench/kvtransfer/run_get_bench.sh [build dir] [rounds] [total MiB] [iterations]
#   ONLY=<extended regex>: only the configurations whose name matches (e.g. 'memcpy|v1$').
# Prints a markdown table (GB/s = 1e9 bytes per second) after a line naming date, host and load.
set -uo pipefail
build=${1:-build}
rounds=${2:-3}
total_mib=${3:-256}
iterations=${4:-4}
bench=$build/bench/kvtransfer/kv_transfer_bench

# name | environment | mode
configs=(
  "memcpy||memcpy"
  "am v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|am"
  "am v2|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|am"
  "am, UCX-allocated source, v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|am-alloc"
  "am, UCX-allocated source, v2|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|am-alloc"
  "get, registered, v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|get"
  "get, registered, v2|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|get"
  "get, UCX-allocated (sysv), v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|get-alloc"
  "get, UCX-allocated (sysv), v2|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|get-alloc"
  "get, UCX-allocated (posix), v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n UCX_ALLOC_PRIO=md:posix,mmap|get-alloc"
  "put, registered, v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|put"
  "put, UCX-allocated (sysv), v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|put-alloc"
  "am v1, rendezvous put_zcopy|UCX_TLS=shm,self UCX_PROTO_ENABLE=n UCX_RNDV_SCHEME=put_zcopy|am"
  "get-proto v1 (sysv)|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|get-proto"
  "get-proto v2 (sysv)|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|get-proto"
  "get-proto v1 (posix)|UCX_TLS=shm,self UCX_PROTO_ENABLE=n UCX_ALLOC_PRIO=md:posix,mmap|get-proto"
  "pdserve v1|UCX_TLS=shm,self UCX_PROTO_ENABLE=n|pdserve"
  "pdserve v1, rendezvous put_zcopy|UCX_TLS=shm,self UCX_PROTO_ENABLE=n UCX_RNDV_SCHEME=put_zcopy|pdserve"
  "pdserve v2|UCX_TLS=shm,self UCX_PROTO_ENABLE=y|pdserve"
)
pages=(64 1024)

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
     "$(ucx_info -v 2>/dev/null | head -1 | sed 's/# //'); load average at start" \
     "$(cut -d' ' -f1-3 /proc/loadavg); ${total_mib} MiB; best of $rounds rounds of" \
     "$iterations iterations"
declare -A results=()
for _ in $(seq "$rounds"); do
  for page in "${pages[@]}"; do
    for c in "${configs[@]}"; do
      IFS='|' read -r name environment mode <<<"$c"
      [[ -z "${ONLY:-}" || "$name" =~ ${ONLY:-} ]] || continue
      # shellcheck disable=SC2086
      best=$(env $environment timeout 120 "$bench" "$mode" "$total_mib" "$page" "$iterations" \
               2>/dev/null | awk '/^best/ {print $2}')
      results["$name|$page"]="${results["$name|$page"]:-} ${best:-0}"
    done
  done
done
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| configuration | 64 KiB best | 64 KiB median | 1 MiB best | 1 MiB median |"
echo "| --- | --- | --- | --- | --- |"
for c in "${configs[@]}"; do
  IFS='|' read -r name _ _ <<<"$c"
  [[ -z "${ONLY:-}" || "$name" =~ ${ONLY:-} ]] || continue
  row="| $name"
  for page in "${pages[@]}"; do
    # shellcheck disable=SC2086
    row+=$(printf '%s\n' ${results["$name|$page"]} | sort -g |
             awk '{v[NR] = $1} END {printf " | %.2f | %.2f", v[NR], v[int((NR + 1) / 2)]}')
  done
  echo "$row |"
done
