#!/usr/bin/env bash
# Issue 27 on one H200, one device call: bf16 state pages from a CUDA prefill to a CUDA decode.
#   1. GPU tests of the export path (engine_gpu_tests: the staged export into fp32 and bf16
#      pages equals the whole-slot export byte for byte; the prefill engine's pages decode to the
#      CPU prefill's tokens; the staging's layer export and import; the direct import from bf16
#      and fp32 pages equals Load + ImportState bit for bit, state and next-token logits).
#   2. bench/kvtransfer/gpu_state_transfer_bench: CUDA prefill -> CUDA decode of 4K, 32K and 128K
#      token prompts at V4-Flash attention shapes (8 layers, CSA / HCA alternating), two
#      processes on the GPU, with the workers' default lanes (and once with 1 lane over shm, the
#      previous table's configuration), over UCX with UCX_TLS unset (what run_pd_cuda_e2e.sh's
#      workers use:
#      pdserve's endpoints then handle peer errors, which UCX 1.13 grants only over tcp, so the
#      pages go over tcp loopback; docs/protocol.md) and with UCX_TLS=shm,self (shared memory, no
#      peer detection); GB/s against the copy floor
#      (cudaMemcpy D2H + H2D of the same bytes) in the same run, and the transfer time left after
#      the last layer's compute as a share of TTFT.
#   3. ucx_perftest ucp_am_bw (-e with UCX_TLS unset, like pdserve's endpoints) between two
#      processes with the same UCX_TLS and the pages' message
#      sizes (64 KiB: compressed-entry pages, most of the bytes at long prompts; 128 KiB: window
#      pages), 1 GiB each.
#   4. Which UCX protocol carried the pages: one short bench run per UCX_TLS with UCX_PROTO_ENABLE=y
#      UCX_PROTO_INFO=y (UCX 1.13 prints its protocol selection only with the v2 protocols on),
#      and `ucx_info -d` transports (does this UCX have cuda_copy / cuda_ipc? Debian's has none).
#   5. tools/gpu/run_pd_cuda_e2e.sh: tokens through PD on CUDA (prefill and decode workers on
#      GPU 0, bf16 pages now) equal the colocated CUDA server's.
# Binaries (built here; the device has no UCX): pdserve and the engine GPU tests from the lead's
# bundle (tools/gpu/device_tree.sh bundle: .device-carry/bin and .device-carry/gpu, with
# gpu/libs.tar.xz made there as device_tree.sh says), plus this script's own pack, 8 MB as xz:
#   cmake --build build --target gpu_state_transfer_bench import_host_bench pdserve engine_gpu_tests
#   tools/gpu/pack_binaries.sh .device-carry/wire build/bench/kvtransfer/gpu_state_transfer_bench \
#     build/bench/kvtransfer/import_host_bench "$(command -v ucx_perftest)" "$(command -v ucx_info)"
#   (cd .device-carry && tar -cf - wire | xz -6 -T0 > wire.tar.xz && rm -rf wire)
# There, from the repository root (models/kjv-v4-tiny must be in the tree for step 5):
#   OUT=$OUT tools/gpu/run_gpu_transfer_bench.sh   (extracts .device-carry/wire.tar.xz itself)
# Environment: WIRE (.device-carry/wire), BINS (.device-carry/bin: pdserve), PACK
# (.device-carry/gpu), OUT (gpu-out/wire), STEPS ("tests bench perftest e2e"), LENGTHS
# ("4096,32768,131072"), LAYERS (8). Logs under OUT; the summary tables are printed last.
# Expected run time: about 3-4 minutes (estimate: the 11:46 run of this script without the third
# bench run took about 3; the 32K prompt's forward, run once, and the e2e script's three servers
# take most of it; STEPS="tests bench perftest" leaves the e2e out). Also step "host":
# import_host_bench (host work of the old and the direct import, no GPU), a few seconds.
set -uo pipefail
out=${OUT:-gpu-out/wire}
wire=${WIRE:-.device-carry/wire}
bins=${BINS:-.device-carry/bin}
pack=${PACK:-.device-carry/gpu}
steps=${STEPS:-tests host bench perftest e2e}
lengths=${LENGTHS:-4096,32768,131072}
layers=${LAYERS:-8}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }
export NCCL_NVLS_ENABLE=0

if [[ " $steps " == *" tests "* ]]; then
  # As tools/gpu/run_gpu_tests.sh runs the packed engine tests, for the tests of this path only.
  if [ -f "$pack/libs.tar.xz" ]; then
    mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
    cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
    nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
    chmod +x "$pack/bin/engine_gpu_tests"
    LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-} PDSERVE_SOURCE_DIR=$PWD \
      timeout 300 "$pack/bin/engine_gpu_tests" \
      --gtest_filter='GpuPrefillTest.*:*GpuStateStagingTest*:*GpuDirectImportTest*:GpuStepRunnerTest.DecodesFromATransferredPromptState' \
      > "$out/engine_gpu_tests.txt" 2>&1
    rc=$?
    row "engine GPU tests (prefill, staging, direct import, PD import)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
      "$(grep -E '^\[  (PASSED|FAILED)  \]' "$out/engine_gpu_tests.txt" | tr '\n' ' ') ($(elapsed))"
  else
    row "engine GPU tests" "NOT RUN" "no $pack/libs.tar.xz (tools/gpu/pack_engine_tests.sh)"
  fi
fi

[ -d "$wire" ] || [ ! -f "$wire.tar.xz" ] || tar -xJf "$wire.tar.xz" -C "$(dirname "$wire")"
# shellcheck disable=SC1091
source "$bins/env.sh"
# shellcheck disable=SC1091
source "$wire/env.sh"

host_table=""
if [[ " $steps " == *" host "* ]] && command -v import_host_bench > /dev/null; then
  timeout 120 import_host_bench --layers "$layers" --lengths "$lengths" > "$out/import_host.txt" 2>&1
  rc=$?
  row "import host work (import_host_bench)" "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
    "table below ($(elapsed))"
  host_table=$(grep -E '^\|' "$out/import_host.txt")
fi

bench_rows=()
if [[ " $steps " == *" bench "* ]]; then
  # UCX_TLS:lanes (0: the workers' default, one lane per four cores); the one-lane shm run is
  # the previous table's configuration, for the lanes' effect.
  for run in default:0 shm,self:0 shm,self:1; do
    tls=${run%:*}
    lanes=${run#*:}
    name=${tls/,/-}-lanes$lanes
    log=$out/bench-$name.txt
    if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
    # The forward (TTFT) is measured up to 32K in the first run only, to keep the call short.
    fmax=32768
    [ "$tls" = default ] || fmax=4096
    timeout 420 gpu_state_transfer_bench --layers "$layers" --lengths "$lengths" \
      --forward-max $fmax --repeats 3 --lanes "$lanes" > "$log" 2> "$out/bench-$name.err"
    rc=$?
    unset UCX_TLS
    row "transfer bench, UCX_TLS=$tls, --lanes $lanes" \
      "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" \
      "table below; state after import equals prefill's: $(grep -c '| equal |' "$log") of \
$(grep -cE '^\| [0-9]' "$log") rows ($(elapsed))"
    while read -r line; do bench_rows+=("| $tls ${line#| }"); done < <(grep -E '^\| [0-9]' "$log")
  done
  # Which protocol UCX chose for the pages (v2 protocols print their selection), per UCX_TLS.
  ucx_info -d > "$out/ucx_info-d.txt" 2>&1
  ucx_info -v > "$out/ucx_info-v.txt" 2>&1
  cuda_tl=$(grep -E 'Transport: cuda' "$out/ucx_info-d.txt" | sort -u | tr -s ' ' | tr '\n' ' ')
  row "UCX" "info" "$(head -1 "$out/ucx_info-v.txt" | sed 's/# //'); CUDA transports: \
${cuda_tl:-none (pages staged through pinned host memory)}"
  for tls in default shm,self; do
    log=$out/proto-info-${tls/,/-}.txt
    if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
    UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y timeout 120 gpu_state_transfer_bench --layers 2 \
      --lengths 4096 --forward-max 0 --repeats 1 > "$log" 2>&1
    unset UCX_TLS
    proto=$(grep -iE 'active message|am_send|ucp_am' "$log" | grep -iE 'rndv|zcopy|bcopy|eager' |
            head -3 | tr -s ' ' | tr '\n' ';')
    row "UCX path, UCX_TLS=$tls" "info" "${proto:-no protocol lines (see $(basename "$log"))}"
  done
fi

perf_rows=()
if [[ " $steps " == *" perftest "* ]]; then
  port=$((21000 + RANDOM % 20000))
  for tls in default shm,self; do
    # pdserve's endpoints handle peer errors where UCX allows it (not over shared memory alone):
    # the like-for-like perftest is ucp_am_bw -e with UCX_TLS unset, plain with shm,self.
    flags=""
    [ "$tls" = default ] && flags="-e"
    for bytes in 65536 131072; do
      port=$((port + 1))
      if [ "$tls" = default ]; then unset UCX_TLS; else export UCX_TLS=$tls; fi
      ucx_perftest -p $port > /dev/null 2>&1 &
      server=$!
      sleep 1
      line=$(timeout 120 ucx_perftest -p $port localhost -t ucp_am_bw -s $bytes \
               -n $(((1 << 30) / bytes)) -w 16 $flags 2>> "$out/perftest.err" | grep Final || true)
      wait $server 2>/dev/null || true
      unset UCX_TLS
      echo "$tls $bytes $line" >> "$out/perftest.txt"
      gbps=$(awk '{printf "%.2f", $7 * 1048576 / 1e9}' <<< "${line:-x x x x x x 0}")
      perf_rows+=("| $tls | ucp_am_bw $flags | $((bytes >> 10)) KiB | $gbps |")
    done
  done
  row "ucx_perftest ucp_am_bw" "$([ ${#perf_rows[@]} -gt 0 ] && echo done || echo FAIL)" \
    "table below ($(elapsed))"
fi

if [[ " $steps " == *" e2e "* ]]; then
  OUT=$out/pd-e2e PDSERVE=$(command -v pdserve) timeout 300 tools/gpu/run_pd_cuda_e2e.sh \
    > "$out/pd-e2e.txt" 2>&1
  rc=$?
  row "PD on CUDA equals colocated CUDA (run_pd_cuda_e2e.sh)" \
    "$([ $rc = 0 ] && echo PASS || echo "FAIL rc $rc")" "$(tail -2 "$out/pd-e2e.txt" | tr '\n' ' ') ($(elapsed))"
fi

echo
if [ ${#bench_rows[@]} -gt 0 ]; then
  echo "What changed since the 2026-12-04 11:46 table: import ms is GpuModel::ImportLayers straight"
  echo "from the pages (PagedState::LoadLayerRing, what the decode runner now does); old import ms is"
  echo "that table's path (PagedState::Load + ImportState; 'state' covers both); lanes: that table ran"
  echo "1 lane, the default is the workers' (one per four cores); checksums now run off the receiver's"
  echo "lock; prefill store ms: the part of transfer ms spent in the prefill's StoreSlotStaged."
  echo "| UCX_TLS prompt tokens | layers | lanes | bytes on the wire (bf16) | transfer ms | prefill store ms | transfer GB/s | import ms | old import ms | end-to-end GB/s | copy floor GB/s (D2H + H2D) | end-to-end / floor | forward ms | left after compute ms | share of TTFT | state |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  printf '%s\n' "${bench_rows[@]}"
  echo
fi
if [ -n "$host_table" ]; then
  echo "Host work of the import on the GPU host (one thread, no GPU; import_host_bench):"
  echo "$host_table"
  echo
fi
if [ ${#perf_rows[@]} -gt 0 ]; then
  echo "| UCX_TLS | ucx_perftest | message | GB/s |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${perf_rows[@]}"
  echo
fi
echo "| step | result | detail |"
echo "| --- | --- | --- |"
printf '%s\n' "${rows[@]}"
