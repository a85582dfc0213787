#!/usr/bin/env bash
# Issue 27 on one H200 in one device call of at most ~150 s: where the time of a CUDA prefill ->
# CUDA decode state transfer goes, with the host work (the prefill's page store, the sender's
# checksums, the decode's page import) spread over several host threads (common/task_pool.h).
#   1. import_host_bench --threads T: the store / import / xxh3 host work of the same state on 1
#      and on T threads (no GPU), and that T threads write the same bytes as one.
#   2. gpu_state_transfer_bench (two processes on the GPU, V4-Flash attention shapes, 8 layers,
#      4K / 32K / 128K prompts; the last chunk computed for real, as GpuModel::ForwardExporting)
#      with shm,self and with UCX_TLS unset (tcp: pdserve's endpoints ask for peer-failure
#      handling), lanes = the workers' default, host threads = the default; then shm,self with
#      1 host thread (the one-thread store, checksums and import), and with the last chunk as a
#      plain Forward (no layer copies during its compute); the second run brings every row of
#      each prompt chunk's logits to the host (--chunk-logits=all; the default, as the serving
#      paths, is the last row only: GpuModel's ChunkLogits).
#      Stage columns: copy wait (device -> pinned copies not yet done when the store wanted
#      them), store (pinned blocks -> pages), post (the sender's checksums of the layer on the
#      pool, then its first sends), send drain (last layer posted -> commit delivered), verify
#      lag (commit delivered -> the receiver's verified outcome), import (pages -> decode slot).
#   3. ucx_perftest ucp_am_bw over the same transports at 64 KiB (most of the pages' bytes).
#   4. engine_gpu_tests of this path when the pack carries them, with PDSERVE_GPU_CHUNK_LOGITS=last
#      (the prefill engine's pages with 1, 4 and the default host threads and the last chunk as
#      ForwardExporting, byte for byte the whole-slot export's; the direct import; the step
#      runner's tests, PD decode from transferred pages among them; the last-row logits against
#      all rows).
# Built on the Debian machine (the device has no UCX) and packed into this folder:
#   cmake --build build --target gpu_state_transfer_bench import_host_bench engine_gpu_tests
#   tools/gpu/pack_binaries.sh <hx>/wire build/bench/kvtransfer/gpu_state_transfer_bench \
#     build/bench/kvtransfer/import_host_bench build/tests/engine_gpu/engine_gpu_tests \
#     "$(command -v ucx_perftest)" "$(command -v ucx_info)"
#   (cd <hx> && tar -cf - wire | xz -6 -T0 > wire.tar.xz && rm -rf wire)
# Run from the folder holding tools/ and wire.tar.xz: OUT=<dir> bash tools/gpu/run_transfer_host_threads.sh
# Environment: OUT (gpu-out/threads), LENGTHS (4096,32768,131072), LAYERS (8), THREADS (0: the
# default, half the cores up to 8), STEPS ("host bench perftest tests"), BUDGET (140 s: every
# step's timeout is cut to what is left of it). The per-length table is printed last.
set -uo pipefail
out=${OUT:-gpu-out/threads}
lengths=${LENGTHS:-4096,32768,131072}
layers=${LAYERS:-8}
threads=${THREADS:-0}
steps=${STEPS:-host bench perftest tests}
mkdir -p "$out"
out=$(cd "$out" && pwd)
t0=$(date +%s)
# The whole script stays within BUDGET seconds (the round's slot), leaving time for the tables:
# each step's timeout is cut to what is left, and a step with under 8 s left is skipped.
budget=${BUDGET:-140}
# shellcheck source=tools/gpu/round_lib.sh
source "$(dirname "$0")/round_lib.sh"
export NCCL_NVLS_ENABLE=0
unpack wire

bench_rows=()
# One bench run: UCX_TLS, host threads (0: default), overlap (1: the stores during the last
# chunk, as the engine does), the sender's window in MiB (0: kv::InFlightBytesForLanes, 256 with
# several lanes), the lengths, the longest timeout it may take, and one extra setting (a UCX
# VAR=value, a bench --flag=value, or "-").
bench() {
  local tls=$1 ht=$2 ov=$3 win=$4 lens=$5 limit=$6 extra=${7:--}
  local name=${tls/,/-}-threads$ht-overlap$ov-window$win
  [ "$extra" = - ] || name=$name-${extra//[^A-Za-z0-9]/_}
  local log=$out/bench-$name.txt
  if ! may; then row "transfer bench, $name" "SKIPPED" "out of time"; return; fi
  if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
  local envs=() flags=()
  case $extra in -) ;; --*) flags=("$extra") ;; *) envs=("$extra") ;; esac
  env "${envs[@]}" timeout "$(cap "$limit")" gpu_state_transfer_bench \
    --layers "$layers" --lengths "$lens" --forward-max 4096 --repeats 3 --host-threads "$ht" \
    --overlap "$ov" --window-mib "$win" --old-import 0 "${flags[@]}" \
    > "$log" 2> "$out/bench-$name.err"
  local rc=$?
  unset UCX_TLS
  row "transfer bench, UCX_TLS=$tls, host threads $ht, overlap $ov, window $win MiB, $extra" \
    "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
    "state equal on $(grep -c '| equal |' "$log") of $(grep -cE '^\| [0-9]' "$log") rows ($(elapsed))"
  while read -r line; do
    bench_rows+=("| $tls ${line#| } $win | $extra |")
  done < <(grep -E '^\| [0-9]' "$log")
}
run_bench=false
[[ " $steps " == *" bench "* ]] && run_bench=true
# Most important first (the round may end early): what the prefill worker does (the 256 MiB
# window with several lanes, the page sends posted by the lane threads) at every length, then at
# 128K the 8 MiB window, the sends posted on the prefill's thread, tcp at every length, and UCX's
# rendezvous threshold at 16 KiB (64 KiB pages then go as rendezvous: the receiver's lanes pull
# them). The forward is measured at 4K only (a 32K forward takes ~11 s); longer prompts' TTFT is
# extrapolated linearly ("est.").
if $run_bench; then
  bench shm,self "$threads" 1 0 "$lengths" 40
  # Every row of the prompt chunks' logits to the host (as before 2026-12-04 19:45 UTC): the
  # fixed ~10 ms "send drain" of the earlier rounds was FinishForward copying them (docs/perf.md).
  bench shm,self "$threads" 1 0 "$lengths" 40 --chunk-logits=all
  bench shm,self "$threads" 1 8 131072 20
  bench shm,self "$threads" 1 0 131072 20 --post-on-lanes=0
  bench default "$threads" 1 0 "$lengths" 35
fi

declare -A perftest
if [[ " $steps " == *" perftest "* ]] && may; then
  port=$((21000 + RANDOM % 20000))
  for tls in default shm,self; do
    flags=""
    [ "$tls" = default ] && flags="-e"
    port=$((port + 1))
    if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
    ucx_perftest -p $port > /dev/null 2>&1 &
    server=$!
    sleep 1
    line=$(timeout "$(cap 20)" ucx_perftest -p $port localhost -t ucp_am_bw -s 65536 -n 16384 -w 16 \
             $flags 2>> "$out/perftest.err" | grep Final || true)
    kill $server 2>/dev/null
    wait $server 2>/dev/null
    unset UCX_TLS
    echo "$tls 65536 $line" >> "$out/perftest.txt"
    perftest[$tls]=$(awk '{printf "%.2f", $7 * 1048576 / 1e9}' <<< "${line:-x x x x x x 0}")
  done
  row "ucx_perftest ucp_am_bw 64 KiB" "done" "default (-e) ${perftest[default]} GB/s, shm,self ${perftest[shm,self]} GB/s ($(elapsed))"
fi

if [[ " $steps " == *" tests "* ]] && command -v engine_gpu_tests > /dev/null && may; then
  # The machine's own NCCL (the expert-parallel tests load it), as run_gpu_tests.sh finds it.
  nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
  # The fixtures and models of the tree this folder sits in (.hx/<name>/ of the repository).
  # With the serving paths asking for the chunks' last logits rows only (as the bench's second
  # run), and the engine's own check of that copy against all rows.
  LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl PDSERVE_SOURCE_DIR=$(cd ../.. && pwd) \
    PDSERVE_GPU_CHUNK_LOGITS=last timeout "$(cap 45)" engine_gpu_tests \
    --gtest_filter='GpuPrefillTest.*:*GpuDirectImportTest*:GpuStepRunnerTest.*:*LastRowLogits*' \
    > "$out/engine_gpu_tests.txt" 2>&1
  rc=$?
  row "engine GPU tests (prefill, direct import, step runner, last-row logits; PDSERVE_GPU_CHUNK_LOGITS=last)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
    "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/engine_gpu_tests.txt" | tr '\n' ' ') ($(elapsed))"
fi

# The comparisons at 128K: rendezvous at 16 KiB, one host thread, no overlap.
if $run_bench; then
  bench shm,self "$threads" 1 0 131072 20 UCX_RNDV_THRESH=16384
  bench shm,self 1 1 0 131072 20
  bench shm,self "$threads" 0 0 131072 20
  ucx_info -d > "$out/ucx_info-d.txt" 2>&1
  cuda_tl=$(grep -E 'Transport: cuda' "$out/ucx_info-d.txt" | sort -u | tr -s ' ' | tr '\n' ' ')
  row "UCX CUDA transports" "info" "${cuda_tl:-none (pages staged through pinned host memory)}"
fi

host_table=""
if [[ " $steps " == *" host "* ]] && may; then
  timeout "$(cap 40)" import_host_bench --layers "$layers" --lengths "$lengths" --repeats 3 \
    --threads "$threads" > "$out/import_host.txt" 2>&1
  rc=$?
  row "host work, 1 vs T threads (import_host_bench)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" "($(elapsed))"
  host_table=$(grep -E '^\|' "$out/import_host.txt")
fi

echo
if [ -n "$host_table" ]; then
  echo "Host work on this host (import_host_bench; ms, median of 3):"
  echo "$host_table"
  echo
fi
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo
if [ ${#bench_rows[@]} -gt 0 ]; then
  echo "Full bench rows (gpu_state_transfer_bench columns, UCX_TLS first):"
  printf '%s\n' "${bench_rows[@]}"
  echo
  # Per prompt length: e2e GB/s, floor, share, perftest of the same transport, time left after
  # compute as % of TTFT, and the stage breakdown (ms).
  echo "| UCX_TLS | host threads | overlap | prompt tokens | MB | end-to-end GB/s | copy floor GB/s | share of floor | ucx_perftest GB/s (64 KiB) | left after compute ms | % of TTFT | copy wait | store | post (checksums) | send drain | verify lag | import | last chunk compute ms | chunk logits | finish forward ms | window MiB (0: 256 with several lanes) | UCX setting |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  for line in "${bench_rows[@]}"; do
    IFS='|' read -r -a f <<< "$line"
    # f[1] "tls tokens", f[2] layers, f[3] lanes, f[4] threads, f[5] bytes, f[6] wait, f[7] store,
    # f[8] post, f[9] drain, f[10] lag, f[11] transfer, f[12] GB/s, f[13] import, f[14] old,
    # f[15] e2e, f[16] floor, f[17] share, f[18] forward, f[19] left, f[20] ttft share,
    # f[21] state, f[22] overlap, f[23] last chunk ms, f[24] chunk logits, f[25] finish forward
    # ms, f[26] window, f[27] UCX setting (the last two added here)
    read -r tls tokens <<< "${f[1]}"
    echo "| $tls |${f[4]}|${f[22]}| $tokens |${f[5]% MB*} |${f[15]}|${f[16]}|${f[17]}| ${perftest[$tls]:-n/a} |${f[19]}|${f[20]}|${f[6]}|${f[7]}|${f[8]}|${f[9]}|${f[10]}|${f[13]}|${f[23]}|${f[24]}|${f[25]}|${f[26]}|${f[27]}|"
  done
fi
