#!/bin/bash
# Transfer bandwidth of 1 GiB of pages: the kvtransfer protocol and raw UCX put / tag / AM
# (kv_transfer_bench) against ucx_perftest with the same message size, in one run, per transport.
# Two references explain the distance to ucx_perftest, which sends every message from (and lands
# it in) one message-sized buffer that stays in cache: `am-hot` (our raw AM loop with the same
# single buffer) and `memcpy` (one core copying the 1 GiB page by page: the memory-copy bound).
# `perftest ucp_am_bw -e` creates its endpoints with peer error handling, as pdserve does over tcp:
# UCX 1.13 then has no zero-copy rendezvous lane on tcp (docs/perf.md), so this is the like-for-like
# reference there; over shm,self pdserve runs without error handling, like plain ucp_am_bw.
# Usage: bench/kvtransfer/run_kvtransfer_bench.sh [build dir] [rounds] [page KiB ...]
# Each figure is the best over `rounds` rounds (ours: best of 3 iterations per round); rounds
# interleave ours and ucx_perftest so that load from other processes hits both alike.
# Prints a markdown table; GB/s = 1e9 bytes per second.
set -euo pipefail
build=${1:-build}
rounds=${2:-3}
shift 2 || shift $# || true
pages_kib=("${@:-1024}")
bench=$build/bench/kvtransfer/kv_transfer_bench
total_mib=1024
port=$((20000 + RANDOM % 20000))

# ucx_perftest's overall bandwidth (MB/s = 2^20 bytes/s) for one test, in GB/s; 0 when it could
# not run (UCX 1.13 refuses error handling, -e, over shared memory alone).
perftest() {
  local tls=$1 test=$2 bytes=$3 flags=${4:-}
  port=$((port + 1))
  UCX_TLS=$tls ucx_perftest -p $port >/dev/null 2>&1 &
  local server=$!
  sleep 1
  local line
  line=$(UCX_TLS=$tls timeout 120 ucx_perftest -p $port localhost -t "$test" -s "$bytes" \
           -n $(( (total_mib << 20) / bytes )) -w 16 $flags 2>/dev/null | grep Final || true)
  wait $server 2>/dev/null || true
  if [[ -z $line ]]; then echo 0; return; fi
  awk '{printf "%.3f", $7 * 1048576 / 1e9}' <<<"$line"
}

ours() {
  local tls=$1 mode=$2 kib=$3
  local best
  best=$(UCX_TLS=$tls timeout 300 "$bench" "$mode" $total_mib "$kib" 3 2>/dev/null |
           awk '/^best/ {print $2}')
  echo "${best:-0}"
}

max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a + 0 > b + 0) ? a : b }'; }

echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'); host: $(uname -n), $(nproc) cores," \
     "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //');" \
     "$(ucx_info -v | head -1 | sed 's/# //'); load average $(cut -d' ' -f1-3 /proc/loadavg);" \
     "best of $rounds rounds"
echo
echo "| UCX_TLS | page | pdserve | raw am | raw am, hot buffer | raw tag | raw put | memcpy, 1 core | perftest ucp_am_bw | perftest ucp_am_bw -e | perftest tag_bw | perftest ucp_put_bw | pdserve / best perftest | pdserve / perftest, same endpoint mode | pdserve / raw am |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for tls in tcp "shm,self"; do
  for kib in "${pages_kib[@]}"; do
    bytes=$((kib << 10))
    p=0 am=0 hot=0 tag=0 put=0 copy=0 pam=0 pame=0 ptag=0 pput=0
    for _ in $(seq "$rounds"); do
      p=$(max "$p" "$(ours "$tls" pdserve "$kib")")
      pam=$(max "$pam" "$(perftest "$tls" ucp_am_bw $bytes)")
      [[ $tls == tcp ]] && pame=$(max "$pame" "$(perftest "$tls" ucp_am_bw $bytes -e)")
      ptag=$(max "$ptag" "$(perftest "$tls" tag_bw $bytes)")
      am=$(max "$am" "$(ours "$tls" am "$kib")")
      hot=$(max "$hot" "$(ours "$tls" am-hot "$kib")")
      tag=$(max "$tag" "$(ours "$tls" tag "$kib")")
      put=$(max "$put" "$(ours "$tls" put "$kib")")
      pput=$(max "$pput" "$(perftest "$tls" ucp_put_bw $bytes)")
      copy=$(max "$copy" "$(ours "$tls" memcpy "$kib")")
    done
    ratio=$(awk -v a="$p" -v b="$(max "$pam" "$ptag")" \
              'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }')
    # Over tcp pdserve's endpoints handle peer errors (ucp_am_bw -e); over shm,self they do not.
    same=$pam
    [[ $tls == tcp ]] && same=$pame
    same_ratio=$(awk -v a="$p" -v b="$same" \
                   'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }')
    raw_ratio=$(awk -v a="$p" -v b="$am" \
                  'BEGIN { if (b > 0) printf "%.0f%%", 100 * a / b; else print "n/a" }')
    echo "| $tls | ${kib} KiB | $p | $am | $hot | $tag | $put | $copy | $pam | $pame | $ptag | $pput | $ratio | $same_ratio | $raw_ratio |"
  done
done
