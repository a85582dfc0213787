#!/usr/bin/env bash
# Issue 27: the CUDA prefill -> CUDA decode transfer's own rate and the workers' transport, with
# the decode side's early import (docs/perf.md, "The decode side's early import", 2026-12-04
# 20:41 UTC: these commands, run from the lead's round folder, committed here after the run):
#   1. gpu_state_transfer_bench with the whole state sent after the compute (--overlap 0), shm,
#      early import on and off: the path's rate against the copy floor of the same bytes;
#   2. the same with the layers posted during the last chunk (--overlap 1) over UCX_TLS unset
#      (tcp with peer-failure handling, what the workers use);
#   3. ucx_perftest ucp_am_bw at 64 KiB over both (tcp with -e).
# 8 V4-Flash-shaped layers, 4K / 32K / 128K prompts, medians of 3.
#   here:  tools/gpu/pack_binaries.sh <dir> build/bench/kvtransfer/gpu_state_transfer_bench \
#            "$(command -v ucx_perftest)" "$(command -v ucx_info)"
#   there: source <dir>/env.sh && OUT=<out> bash tools/gpu/run_transfer_rate.sh   (~110 s)
set -u
OUT=${OUT:-gpu-out/transfer-rate}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
b() {  # name tls overlap early
  local s=$SECONDS
  if [ "$2" = default ]; then unset UCX_TLS; else export UCX_TLS=$2; fi
  timeout 45 gpu_state_transfer_bench --layers 8 --lengths 4096,32768,131072 --forward-max 4096 \
    --repeats 3 --overlap "$3" --early-import "$4" --old-import 0 > "$OUT/wire-$1.md" \
    2> "$OUT/wire-$1.err"
  echo "wire $1 rc=$? $((SECONDS - s)) s"
  unset UCX_TLS
  grep -E '^\| (prompt|[0-9])' "$OUT/wire-$1.md"
}
b shm-ov0-early1 shm,self 0 1
b shm-ov0-early0 shm,self 0 0
b tcp-ov1-early1 default 1 1
port=$((21000 + RANDOM % 20000))
for tls in default shm,self; do
  if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
  flags=""
  [ "$tls" = default ] && flags="-e"
  ucx_perftest -p $port > /dev/null 2>&1 &
  server=$!
  sleep 1
  # shellcheck disable=SC2086
  line=$(timeout 20 ucx_perftest -p $port localhost -t ucp_am_bw -s 65536 -n 16384 -w 16 $flags \
           2>> "$OUT/perftest.err" | grep Final || true)
  kill $server 2> /dev/null
  wait $server 2> /dev/null
  unset UCX_TLS
  echo "perftest $tls 64KiB: $line"
  port=$((port + 1))
done
