#!/usr/bin/env bash
# Issue 27: same-host pages by shared memory (transfer.shm_pull; docs/protocol.md, "Same-host pages
# by shared memory") against active messages, on the GPU host, in one device call of at most
# ~150 s (BUDGET):
#   1. gpu_state_transfer_bench (CUDA prefill -> CUDA decode, two processes on one GPU, 8
#      V4-Flash-shaped layers, random state, the whole state sent after the compute: --overlap 0,
#      early import on, medians of 3) over shm,self: active messages under v1 and v2, then
#      --shm-pull 1 under v1 (the messages then carry only references); the path's rate against
#      the copy floor (cudaMemcpy device -> pinned -> device) of the same bytes;
#   2. the same with the transfer overlapped with the last chunk (--overlap 1, the prefill worker's
#      way), shm pull on and off: the time left after the compute as a share of TTFT;
#   3. when kv_transfer_bench is packed: the full protocol on 256 MiB of distinct host pages
#      (64 KiB and 1 MiB pages, 4 lanes, checksum pool of 8), PDSERVE_BENCH_SHM_PULL=1 / 0, v1,
#      shm,self: the host path's own rate with no GPU in it.
# Not yet run (written 2026-12-05 with no device lent).
#   here:  cmake --build build --target gpu_state_transfer_bench kv_transfer_bench
#          tools/gpu/pack_binaries.sh <dir> build/bench/kvtransfer/gpu_state_transfer_bench \
#            build/bench/kvtransfer/kv_transfer_bench "$(command -v ucx_perftest)"
#   there: source <dir>/env.sh && OUT=<out> bash tools/gpu/run_shm_pull.sh
# The comparison tables are printed last.
set -u
OUT=${OUT:-gpu-out/shm-pull}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
budget=${BUDGET:-150}
lengths=${LENGTHS:-32768,131072}
table=()
host=()
cap() {  # N seconds cut to what is left of the budget (3 s kept for the tables; at least 1)
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
b() {  # name protocols shm_pull overlap
  local s=$SECONDS
  [ "$(cap 8)" -ge 8 ] || { echo "wire $1 skipped: out of time"; return; }
  export UCX_TLS=shm,self
  if [ "$2" = v2 ]; then export UCX_PROTO_ENABLE=y; else export UCX_PROTO_ENABLE=n; fi
  timeout "$(cap 30)" gpu_state_transfer_bench --layers 8 --lengths "$lengths" --forward-max 0 \
    --repeats 3 --overlap "$4" --early-import 1 --old-import 0 --shm-pull "$3" \
    > "$OUT/wire-$1.md" 2> "$OUT/wire-$1.err"
  echo "wire $1 rc=$? $((SECONDS - s)) s"
  unset UCX_TLS UCX_PROTO_ENABLE
  grep -E '^\| (prompt|[0-9])' "$OUT/wire-$1.md"
  # run, prompt, MB, post, transfer ms, left after compute ms, end-to-end GB/s, floor GB/s, share
  # of floor, share of TTFT, state, shm pull
  while IFS= read -r line; do
    table+=("$(echo "$line" | awk -F'|' -v n="$1" '{gsub(/ /, "", $0);
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", n, $2, $6, $9, $12,
        $20, $16, $17, $18, $21, $22, $28}')")
  done < <(grep -E '^\| [0-9]' "$OUT/wire-$1.md")
}
b am-v1 v1 0 0
b pull-v1 v1 1 0
b am-v2 v2 0 0
b pull-v1-overlap v1 1 1
b am-v1-overlap v1 0 1
if command -v kv_transfer_bench > /dev/null; then
  for pull in 1 0; do
    for kib in 64 1024; do
      [ "$(cap 6)" -ge 6 ] || { echo "host pull=$pull skipped: out of time"; continue; }
      best=$(UCX_TLS=shm,self UCX_PROTO_ENABLE=n PDSERVE_BENCH_SHM_PULL=$pull \
               timeout "$(cap 12)" kv_transfer_bench pdserve 256 "$kib" 3 4 8 2>> "$OUT/host.err" |
               tee -a "$OUT/host.log" | awk '/^best/ {print $2 " / " $4}')
      host+=("| pdserve-v1-shm-pull-$pull | $kib KiB | ${best:-failed} |")
    done
  done
fi
if [ ${#host[@]} -gt 0 ]; then
  echo
  echo "| host pages (shm,self, 256 MiB, 4 lanes) | page | best / median GB/s |"
  echo "| --- | --- | --- |"
  printf '%s\n' "${host[@]}"
fi
echo
echo "| run | prompt | bytes | post ms | transfer ms | left after compute ms | GB/s | floor GB/s |" \
  "share of floor | share of TTFT | state | shm pull |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
