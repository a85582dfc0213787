#!/usr/bin/env bash
# Issue 27: the CUDA prefill -> CUDA decode transfer's own rate (the whole state sent after the
# compute, --overlap 0, early import on), the path of branch rate27 against the path before it,
# in one device call of at most ~120 s (docs/perf.md, "The path's own rate"; first run 2026-12-04
# 20:41 UTC with the previous version of this script, which measured 2.0 / 2.3 / 3.7 GB/s):
#   1. gpu_state_transfer_bench over shm,self with UCX's v1 protocols (the default) and v2
#      (transfer.ucx_protocols: v2; here through UCX_PROTO_ENABLE, which overrides it), and, when
#      packed, the binary built from main before rate27 (gpu_state_transfer_bench_old) with v1:
#      the path's rate against the copy floor (cudaMemcpy device -> pinned -> device) of the
#      same bytes, and the sender's post time (checksums + sends handed over);
#   2. the same over UCX_TLS unset (tcp with peer-failure handling, what the workers use), v2
#      then v1;
#   3. ucx_perftest ucp_am_bw at 64 KiB over shm,self;
#   4. when kv_transfer_bench is packed too, issue 27's question for a receiver-pulled data path
#      (docs/perf.md, "A receiver-pulled data path"): raw UCX operations on 256 MiB of distinct
#      pages over shm,self, 64 KiB and 1 MiB, best of 3 each: AM (v1, v2), get-proto (the
#      receiver-pulled protocol's shape: P's pages UCX-allocated, a request AM per page, D's get,
#      xxh3 on both sides, an answer per page), get from memory UCX allocated (sysv segment,
#      v1), get from registered memory (v1), one core's memcpy;
#   5. last (what is left of the budget), when kv_transfer_bench is packed: the full protocol
#      (its pdserve mode, v2, shm,self) with the page memory registered once on both sides and
#      without (PDSERVE_BENCH_REGISTER_PAGES=1 / 0: transfer.register_pages, docs/protocol.md,
#      "Registered page memory"; added 2026-12-05, compiled, not yet run on the H200).
#      REGISTERED_ONLY=1 runs this step alone (when the full run leaves it no time).
# 8 V4-Flash-shaped layers, 32K / 128K prompts (LENGTHS), random state (no forward), medians of
# 3; the workers' default lanes (4 on 16 cores) and host threads. Each run is cut to what is left
# of BUDGET (118 s); the rows come out per length, so a cut run keeps its shorter lengths.
#   here:  cmake --build build --target gpu_state_transfer_bench
#          optional, the path before rate27 (b297fef, main at its start) built in a tree of its
#          own: git worktree add --detach /tmp/pre27 b297fef && cmake -S /tmp/pre27 -B
#          /tmp/pre27/build -G Ninja && cmake --build /tmp/pre27/build --target
#          gpu_state_transfer_bench && cp /tmp/pre27/build/bench/kvtransfer/gpu_state_transfer_bench
#          /tmp/gpu_state_transfer_bench_old
#          tools/gpu/pack_binaries.sh <dir> build/bench/kvtransfer/gpu_state_transfer_bench \
#            [/tmp/gpu_state_transfer_bench_old] "$(command -v ucx_perftest)" \
#            "$(command -v ucx_info)" [build/bench/kvtransfer/kv_transfer_bench]
#   there: source <dir>/env.sh && OUT=<out> bash tools/gpu/run_transfer_rate.sh
# The comparison table is printed last.
set -u
OUT=${OUT:-gpu-out/transfer-rate}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
budget=${BUDGET:-118}
lengths=${LENGTHS:-32768,131072}
table=()
# cap N: N seconds cut to what is left of the budget (3 s kept for the table; at least 1).
cap() {
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
raw=()
raw_ops() {  # step 4: before the tcp runs, so a cut run keeps it
  command -v kv_transfer_bench > /dev/null || return 0
  # name protocols mode: one raw figure per page size (first the ones the question needs).
  for spec in "am-v1 n am" "get-proto-v1 n get-proto" "get-alloc-v1 n get-alloc" "am-v2 y am" \
              "memcpy n memcpy" "get-registered-v1 n get"; do
    read -r name proto mode <<<"$spec"
    for kib in 64 1024; do
      [ "$(cap 4)" -ge 4 ] || { echo "raw $name skipped: out of time"; continue; }
      best=$(UCX_TLS=shm,self UCX_PROTO_ENABLE=$proto timeout "$(cap 8)" kv_transfer_bench \
               "$mode" 256 "$kib" 3 2>> "$OUT/raw.err" | tee -a "$OUT/raw.log" |
               awk '/^best/ {print $2 " / " $4}')
      raw+=("| $name | $kib KiB | ${best:-failed} |")
    done
  done
}
registered_ops() {  # step 5
  command -v kv_transfer_bench > /dev/null || return 0
  for register in 0 1; do
    for kib in 64 1024; do
      [ "$(cap 4)" -ge 4 ] || { echo "pdserve register=$register skipped: out of time"; continue; }
      best=$(UCX_TLS=shm,self UCX_PROTO_ENABLE=y PDSERVE_BENCH_REGISTER_PAGES=$register \
               timeout "$(cap 8)" kv_transfer_bench pdserve 256 "$kib" 3 2>> "$OUT/raw.err" |
               tee -a "$OUT/raw.log" | awk '/^best/ {print $2 " / " $4}')
      raw+=("| pdserve-v2-register-pages-$register | $kib KiB | ${best:-failed} |")
    done
  done
}
b() {  # name tls protocols [binary]
  local s=$SECONDS bin=${4:-gpu_state_transfer_bench}
  [ "$(cap 8)" -ge 8 ] || { echo "wire $1 skipped: out of time"; return; }
  if [ "$2" = default ]; then unset UCX_TLS; else export UCX_TLS=$2; fi
  if [ "$3" = v2 ]; then export UCX_PROTO_ENABLE=y; else export UCX_PROTO_ENABLE=n; fi
  timeout "$(cap 24)" "$bin" --layers 8 --lengths "$lengths" --forward-max 0 --repeats 3 \
    --overlap 0 --early-import 1 --old-import 0 > "$OUT/wire-$1.md" 2> "$OUT/wire-$1.err"
  echo "wire $1 rc=$? $((SECONDS - s)) s"
  unset UCX_TLS UCX_PROTO_ENABLE
  grep -E '^\| (prompt|[0-9])' "$OUT/wire-$1.md"
  # prompt, MB, post, transfer, left after compute (ms), end-to-end GB/s (bytes / left, the
  # figure docs/perf.md compares with the floor), floor GB/s, its share, state
  while IFS= read -r line; do
    table+=("$(echo "$line" | awk -F'|' -v n="$1" '{gsub(/ /, "", $0);
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", n, $2, $6, $9, $12, $20, $16,
        $17, $18, $22}')")
  done < <(grep -E '^\| [0-9]' "$OUT/wire-$1.md")
}
if [ "${REGISTERED_ONLY:-0}" = 1 ]; then
  registered_ops
  echo "| raw operation (shm,self, 256 MiB distinct pages) | page | best / median GB/s |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${raw[@]}"
  exit 0
fi
b shm-v1 shm,self v1
b shm-v2 shm,self v2
raw_ops
if command -v gpu_state_transfer_bench_old > /dev/null; then
  b shm-v1-old shm,self v1 gpu_state_transfer_bench_old
fi
b tcp-v2 default v2
b tcp-v1 default v1
port=$((21000 + RANDOM % 20000))
if [ "$(cap 8)" -ge 8 ]; then
  export UCX_TLS=shm,self
  ucx_perftest -p $port > /dev/null 2>&1 &
  server=$!
  sleep 1
  line=$(timeout "$(cap 10)" ucx_perftest -p $port localhost -t ucp_am_bw -s 65536 -n 16384 -w 16 \
           2>> "$OUT/perftest.err" | grep Final || true)
  kill $server 2> /dev/null
  wait $server 2> /dev/null
  unset UCX_TLS
  echo "perftest shm,self 64KiB: $line"
fi
registered_ops
if [ ${#raw[@]} -gt 0 ]; then
  echo
  echo "| raw operation (shm,self, 256 MiB distinct pages) | page | best / median GB/s |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${raw[@]}"
fi
echo
echo "| run | prompt | bytes | post ms | transfer ms | left after compute ms | GB/s | floor GB/s |" \
  "share of floor | state |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
