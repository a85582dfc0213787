#!/usr/bin/env bash
# Issue 27, the fixed cost of a small same-host device-to-device transfer (docs/perf.md, "The
# fixed cost of a small transfer (branch ipc59)"): old against new in one device call of at most
# BUDGET (default 235) s, from the repository root on a Hopper GPU, with a pack built here (the
# device machine has no gRPC / UCX headers):
#   1. GPU tests of what changed: the CUDA IPC tests (pdserve_kvtransfer_cuda_ipc_tests: the arena,
#      a peer's mapping, the lander in its three modes); the device-pages tests (engine_gpu_tests
#      *GpuDevicePages*: among them KeptMappedDescriptorsServeRequestAfterRequest, a
#      DeviceStatePages a request over one kept, mapped descriptor ring, equal to the host path
#      and allocating nothing after the first request, and LoadLayersInBatchesEqualsImportSlot),
#      the early-import GPU tests (*GpuEarlyImport*: EarlyImporter changed) and
#      GpuPrefillTest.DevicePagesEqualTheHostPagesWithKeptAndFreshBuffers (RunToDevice, the
#      prefill worker's store: kept buffers, kept with the stores during the last chunk, fresh,
#      each equal to the host pages byte for byte with libxxhash's checksums);
#   2. gpu_state_transfer_bench --cuda-ipc 1 (two processes on one GPU, UCX shm,self v1, random
#      state, the whole state sent after the chunk's compute), per length one warm-up transfer
#      (its end-to-end time is the "first use ms" column) then REPEATS (default 5) measured ones
#      (medians, and the best), at 4K / 32K / 128K, with 8 V4-Flash layers (the rows of earlier
#      runs) and with 43 (the real V4-Flash's layer count: a 4K prompt's real state), rows in this
#      order (later ones are dropped first when time runs out):
#        new   the workers' path after this branch: a DeviceStatePages a transfer over kept,
#              mapped descriptors (PDSERVE_DEVICE_PAGES unset), all layers in one StoreLayers,
#              the transfer prepared before the chunk and its checksums set after the store,
#              the decode slot claimed with the ticket and the layers imported as they verify
#              (EarlyImporter over GpuSlotImporter::ClaimFromDevice), the layers queued together
#              in one DeviceStatePages::LoadLayers (two launches), fused lander
#        old   the workers' path before it: PDSERVE_DEVICE_PAGES=fresh (each transfer's
#              DeviceStatePages with buffers of its own, allocated on first use and freed at its
#              end, fresh checksum arrays), a StoreLayer a layer, and a LoadLayer a layer
#              (PDSERVE_EARLY_IMPORT_BATCH=0), otherwise as new
#        fast58 kept buffers, the ordering the 2026-12-05 16:02 rows measured (PrepareDevice after
#              the store, ImportSlotBatched after the verification)
#        lanes1 new with one lane at 4K (four lanes' flushes are four launches and waits)
#      and each run's lander flushes a measured transfer (pages and host us a flush) from stderr.
# Pack (here, from the repository root): `bash tools/gpu/run_ipc59.sh pack [build dir]` builds
# gpu_state_transfer_bench, engine_gpu_tests and pdserve_kvtransfer_cuda_ipc_tests in the build
# dir (default build), packs them with tools/gpu/pack_binaries.sh into
# .device-carry/ipc59.tar.xz; carry that file. Environment: OUT (default gpu-out/ipc59), PACK,
# BUDGET, LENGTHS, REPEATS, LANES (bench --lanes; 0: the workers' default), BENCH_CAP (seconds a
# bench run may take, default 90), RUNS (which of the runs below, as name-layers, comma-separated,
# e.g. new-43,old-43; default all). The comparison table
# is printed last.
set -u
if [ "${1:-}" = pack ]; then
  set -e
  build=${2:-build}
  cmake --build "$build" --target gpu_state_transfer_bench engine_gpu_tests \
    pdserve_kvtransfer_cuda_ipc_tests -j2
  tools/gpu/pack_binaries.sh /tmp/ipc59 "$build/bench/kvtransfer/gpu_state_transfer_bench" \
    "$build/tests/engine_gpu/engine_gpu_tests" \
    "$build/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests"
  mkdir -p .device-carry
  (cd /tmp && tar -cf - ipc59 | xz -6 -T2) > .device-carry/ipc59.tar.xz
  ls -la .device-carry/ipc59.tar.xz
  exit 0
fi
OUT=${OUT:-gpu-out/ipc59}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
budget=${BUDGET:-235}
lengths=${LENGTHS:-4096,32768,131072}
repeats=${REPEATS:-5}
pack=${PACK:-.device-carry/ipc59.tar.xz}
cap() {  # N seconds cut to what is left of the budget (3 s kept for the tables; at least 1)
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
# PACK_DIR: an unpacked pack holding the same binaries (env.sh, bin/), e.g. a combined one.
if [ -n "${PACK_DIR:-}" ]; then
  # shellcheck disable=SC1091
  source "$PACK_DIR/env.sh"
else
  dir=$(mktemp -d)
  if ! tar -xJf "$pack" -C "$dir"; then
    echo "no pack at $pack"
    exit 1
  fi
  # shellcheck disable=SC1091
  source "$dir/ipc59/env.sh"
fi

passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
s=$SECONDS
timeout "$(cap 40)" pdserve_kvtransfer_cuda_ipc_tests > "$OUT/ipc_tests.log" 2>&1
echo "cuda ipc GPU tests: rc=$? $((SECONDS - s)) s $(passed "$OUT/ipc_tests.log")"
grep -E "^\[  FAILED|Failure|Which is|lander peer" "$OUT/ipc_tests.log" | head -12

s=$SECONDS
# The tests find their model fixtures under PDSERVE_SOURCE_DIR (else the build machine's path).
PDSERVE_SOURCE_DIR=$PWD timeout "$(cap 70)" engine_gpu_tests \
  --gtest_filter='*GpuDevicePages*:*GpuEarlyImport*:GpuPrefillTest.DevicePagesEqualTheHostPagesWithKeptAndFreshBuffers' \
  > "$OUT/device_pages_tests.log" 2>&1
echo "device pages GPU tests: rc=$? $((SECONDS - s)) s $(passed "$OUT/device_pages_tests.log")"
grep -E "^\[  FAILED|Failure|Which is" "$OUT/device_pages_tests.log" | head -12

table=()
b() {  # name, layers, lengths, PDSERVE_DEVICE_PAGES, PDSERVE_EARLY_IMPORT_BATCH, bench flags...
  local name=$1 layers=$2 lens=$3 pages=$4 batch=$5
  shift 5
  [[ "${RUNS:-all}" == all || ",$RUNS," == *",$name-$layers,"* ]] || return 0
  local s=$SECONDS need=$((layers > 8 ? 45 : 20))
  [ "$(cap "$need")" -ge "$need" ] || { echo "bench $name $layers layers skipped: out of time"; return; }
  local log="$OUT/bench-$name-$layers"
  PDSERVE_DEVICE_PAGES=$pages PDSERVE_EARLY_IMPORT_BATCH=$batch UCX_TLS=shm,self UCX_PROTO_ENABLE=n timeout "$(cap "${BENCH_CAP:-90}")" \
    gpu_state_transfer_bench --cuda-ipc 1 --layers "$layers" --lengths "$lens" --forward-max 0 \
    --warmup 1 --repeats "$repeats" --overlap 0 --old-import 0 --lanes "${LANES:-0}" \
    --refs 3 --lander fused "$@" > "$log.md" 2> "$log.err"
  echo "bench $name, $layers layers: rc=$? $((SECONDS - s)) s"
  grep -E "lander flushes|: [A-Z_]+: |gpu_state_transfer_bench" "$log.err" | grep -v "UCX  ERROR" |
    head -6
  # run, layers, prompt, MB, store, post, drain, transfer, import, e2e ms median / min, e2e GB/s
  # median / best, floor GB/s, share of floor (median, best), first use ms, state
  while IFS= read -r line; do
    # (MB / ms = GB/s: the median's GB/s from the median end-to-end time)
    table+=("$(echo "$line" | awk -F'|' -v n="$name" '{gsub(/ /, "", $0);
      mb = $6 + 0; med = $29 + 0; b = $31 + 0; f = $17 + 0; m = med > 0 ? mb / med : 0;
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %.2f / %s | %s | %.0f%% / %.0f%% | %s | %s |",
        n, $3, $2, $6, $8, $9, $10, $12, $14, $29, $30, m, $31, $17,
        (f > 0 ? 100 * m / f : 0), (f > 0 ? 100 * b / f : 0), $32, $22}')")
  done < <(grep -E '^\| [0-9]' "$log.md")
}
new=(--store-all 1 --early-import 1 --prepare-early 1)
old=(--store-all 0 --early-import 1 --prepare-early 1)
b new 8 "$lengths" kept 1 "${new[@]}"
b old 8 "$lengths" fresh 0 "${old[@]}"
b new 43 "$lengths" kept 1 "${new[@]}"
b old 43 "$lengths" fresh 0 "${old[@]}"
b fast58 8 "$lengths" kept 1 --store-all 1 --early-import 0 --import-all 1 --prepare-early 0
b lanes1 8 4096 kept 1 "${new[@]}" --lanes 1
b lanes1 43 4096 kept 1 "${new[@]}" --lanes 1
b fast58 43 "$lengths" kept 1 --store-all 1 --early-import 0 --import-all 1 --prepare-early 0
echo "total: $(($(date +%s) - t0)) s"
echo
echo "gpu_state_transfer_bench --cuda-ipc 1 ($(cat "$OUT/gpu.txt"); 1 warm-up + $repeats measured a" \
  "length; e2e = t_imported - t0, the chunk's compute end; floor (a) = D2H + H2D of the same bytes)"
echo "| run | layers | prompt | bytes | store ms | post ms | send drain ms | transfer ms |" \
  "import ms | e2e ms median / min | e2e GB/s median / best | floor (a) GB/s |" \
  "e2e / floor median / best | first use ms | state |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
