#!/bin/bash
# Registered page memory (transfer.register_pages; docs/protocol.md, "Registered page memory"):
# does registering the page memory once and passing its handle with every page change the
# full protocol's rate? kv_transfer_bench's pdserve mode with PDSERVE_BENCH_REGISTER_PAGES=0
# (neither side registers: the workers' default) and =1 (both do), UCX's v1 and v2 protocols,
# beside an older binary (OLD, e.g. main's, run as it is: its receiver registers its pool,
# nothing is passed). Rounds interleave every configuration so that load from other processes
# hits them alike; a figure is the best over the rounds of each round's best of `iterations`,
# with the median of the round bests beside it.
# SWITCH=shm_pull compares the same way with PDSERVE_BENCH_SHM_PULL=0 / 1 (transfer.shm_pull:
# docs/protocol.md, "Same-host pages by shared memory") instead.
# Usage: bench/kvtransfer/run_register_bench.sh NEW_BENCH [OLD_BENCH] [rounds] [MiB] [iterations]
#   TLS (default "shm,self tcp"), PAGES (KiB, default "64 1024"), SWITCH (default
#   register_pages).
# Prints a markdown table (GB/s = 1e9 bytes per second) after a line naming date, host and load.
set -uo pipefail
new=$1
old=${2:-}
rounds=${3:-3}
total_mib=${4:-256}
iterations=${5:-3}
read -r -a transports <<<"${TLS:-shm,self tcp}"
read -r -a pages <<<"${PAGES:-64 1024}"
switch=${SWITCH:-register_pages}
variable=PDSERVE_BENCH_${switch^^}

# name | binary | environment
configs=()
for p in n y; do
  v=$([ "$p" = y ] && echo v2 || echo v1)
  [ -n "$old" ] && configs+=("old $v|$old|UCX_PROTO_ENABLE=$p")
  configs+=("new $v, $switch false|$new|UCX_PROTO_ENABLE=$p $variable=0")
  configs+=("new $v, $switch true|$new|UCX_PROTO_ENABLE=$p $variable=1")
done

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(nproc) cores;" \
     "load average at start $(cut -d' ' -f1-3 /proc/loadavg); ${total_mib} MiB;" \
     "best of $rounds rounds of $iterations iterations"
declare -A results=()
for _ in $(seq "$rounds"); do
  for tls in "${transports[@]}"; do
    for page in "${pages[@]}"; do
      for c in "${configs[@]}"; do
        IFS='|' read -r name binary environment <<<"$c"
        # shellcheck disable=SC2086
        best=$(env UCX_TLS="$tls" $environment timeout 120 "$binary" pdserve "$total_mib" "$page" \
                 "$iterations" 2>/dev/null | awk '/^best/ {print $2}')
        results["$name|$tls|$page"]="${results["$name|$tls|$page"]:-} ${best:-0}"
      done
    done
  done
done
echo "load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
header="| configuration |"
rule="| --- |"
for tls in "${transports[@]}"; do
  for page in "${pages[@]}"; do
    header+=" $tls, $page KiB: best / median |"
    rule+=" --- |"
  done
done
echo "$header"
echo "$rule"
for c in "${configs[@]}"; do
  IFS='|' read -r name _ _ <<<"$c"
  row="| $name |"
  for tls in "${transports[@]}"; do
    for page in "${pages[@]}"; do
      # shellcheck disable=SC2086
      row+=" $(printf '%s\n' ${results["$name|$tls|$page"]} | sort -g |
               awk '{v[NR]=$1} END {printf "%.2f / %.2f", v[NR], v[int((NR+1)/2)]}') |"
    done
  done
  echo "$row"
done
