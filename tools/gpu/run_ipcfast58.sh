#!/usr/bin/env bash
# Issue 27, making the same-host device-to-device path fast (docs/perf.md, "Device-to-device pages
# through the protocol classes"): old against new in one device call of at most BUDGET (default
# 200) s, from the repository root on a Hopper GPU, with a pack built here (the device machine has
# no UCX headers):
#   1. GPU tests of what changed: kernels copy_pages_xxh3 / xxh3 / copy_pages against libxxhash
#      (every length class, odd lengths, misaligned pages, guard bands); the CUDA IPC tests (a peer
#      process lands 37 odd-length arena pages in each lander mode: staged, mapped, fused); the
#      device-pages tests (StoreLayers of all layers equal to StoreLayer per layer and the host
#      pages; ImportSlotBatched's and ImportSlot's slots equal to the host import's);
#   2. device_ref_bench on this host's cores (the protocol's host costs with a host stand-in for
#      the GPU: version-2 against version-3 references, 4 lanes);
#   3. gpu_state_transfer_bench --cuda-ipc 1 (two processes on one GPU, UCX shm,self v1, 8
#      V4-Flash layers, 4K / 32K / 128K, medians of 3, the whole state sent after the chunk's
#      compute), rows in this order (later ones are dropped first when time runs out):
#        new      version-3 references, mapped lander, StoreLayers, ImportSlotBatched (defaults)
#        main     the binary of main before this branch (version 2, staged, StoreLayer a layer;
#                 its floor is measured after each length, racing the prefill process's frees)
#        linger   new, with the lanes progressing 500 us after their last message before they
#                 sleep (PDSERVE_LANE_LINGER_US: a missed event-fd wake-up costs up to 2 ms)
#        fused    new with the copy-and-hash kernel in the lander
#        host-only version 2, staged, StoreLayer a layer, ImportSlot: only the host-side changes
#                 (batched sink calls, cheaper checks and polls) against main
#      and each bench run's lander flushes a transfer (pages and host us a flush) from stderr.
# Pack (here, from the repository root; main's binary from a checkout of main built the same way):
#   cmake --build build --target gpu_state_transfer_bench engine_gpu_tests \
#     pdserve_kvtransfer_cuda_ipc_tests device_ref_bench
#   cmake -S tools/gpu/ipc54 -B /tmp/ipcfast58-ipc54 -G Ninja -DCMAKE_BUILD_TYPE=Release && \
#     cmake --build /tmp/ipcfast58-ipc54 --target ipc54_xxh3_tests
#   tools/gpu/pack_binaries.sh /tmp/ipcfast58 build/bench/kvtransfer/gpu_state_transfer_bench \
#     build/tests/engine_gpu/engine_gpu_tests build/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests \
#     build/bench/kvtransfer/device_ref_bench /tmp/ipcfast58-ipc54/ipc54_xxh3_tests
#   cp <main checkout>/build/bench/kvtransfer/gpu_state_transfer_bench \
#     /tmp/ipcfast58/bin/gpu_state_transfer_bench_main
#   (cd /tmp && tar -cf - ipcfast58 | xz -6 -T0 > <repo>/.device-carry/ipcfast58.tar.xz)
# and carry .device-carry/ipcfast58.tar.xz. Environment: OUT (default gpu-out/ipcfast58), PACK,
# BUDGET, LENGTHS, LANES (bench --lanes; 0: the workers' default). The comparison table is
# printed last.
set -u
OUT=${OUT:-gpu-out/ipcfast58}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
budget=${BUDGET:-200}
lengths=${LENGTHS:-4096,32768,131072}
pack=${PACK:-.device-carry/ipcfast58.tar.xz}
cap() {  # N seconds cut to what is left of the budget (3 s kept for the tables; at least 1)
  local rest=$((budget - ($(date +%s) - t0) - 3))
  rest=$(($1 < rest ? $1 : rest))
  echo $((rest > 1 ? rest : 1))
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
dir=$(mktemp -d)
if ! tar -xJf "$pack" -C "$dir"; then
  echo "no pack at $pack"
  exit 1
fi
# shellcheck disable=SC1091
source "$dir/ipcfast58/env.sh"

passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
s=$SECONDS
timeout "$(cap 40)" ipc54_xxh3_tests > "$OUT/kernel_tests.log" 2>&1
echo "kernel GPU tests (xxh3, copy_pages, copy_pages_xxh3): rc=$? $((SECONDS - s)) s $(passed "$OUT/kernel_tests.log")"
grep -E "^\[  FAILED|Failure|Which is|got " "$OUT/kernel_tests.log" | head -12

s=$SECONDS
timeout "$(cap 40)" pdserve_kvtransfer_cuda_ipc_tests > "$OUT/ipc_tests.log" 2>&1
echo "cuda ipc GPU tests: rc=$? $((SECONDS - s)) s $(passed "$OUT/ipc_tests.log")"
grep -E "^\[  FAILED|Failure|Which is|lander peer" "$OUT/ipc_tests.log" | head -12

s=$SECONDS
timeout "$(cap 60)" engine_gpu_tests --gtest_filter='*GpuDevicePages*' > "$OUT/device_pages_tests.log" 2>&1
echo "device pages GPU tests: rc=$? $((SECONDS - s)) s $(passed "$OUT/device_pages_tests.log")"
grep -E "^\[  FAILED|Failure|Which is" "$OUT/device_pages_tests.log" | head -12

host_rows=()
for run in "2 0" "3 0" "3 500"; do
  read -r refs linger <<< "$run"
  s=$SECONDS
  PDSERVE_LANE_LINGER_US=$linger UCX_TLS=shm,self UCX_PROTO_ENABLE=n timeout "$(cap 20)" \
    device_ref_bench --lanes 4 --refs "$refs" --repeats 9 > "$OUT/device_ref_v$refs-$linger.md" \
    2> "$OUT/device_ref_v$refs-$linger.err"
  echo "device_ref_bench v$refs linger $linger us: rc=$? $((SECONDS - s)) s"
  while IFS= read -r line; do host_rows+=("$line $linger |"); done < \
    <(grep -E '^\| [0-9]' "$OUT/device_ref_v$refs-$linger.md")
done

table=()
b() {  # name, lane linger us, binary, bench flags...
  local name=$1 linger=$2 binary=$3
  shift 3
  local s=$SECONDS
  [ "$(cap 40)" -ge 40 ] || { echo "bench $name skipped: out of time"; return; }
  PDSERVE_LANE_LINGER_US=$linger UCX_TLS=shm,self UCX_PROTO_ENABLE=n timeout "$(cap 60)" \
    "$binary" --layers 8 \
    --lengths "$lengths" --forward-max 0 --repeats 3 --overlap 0 --old-import 0 \
    --lanes "${LANES:-0}" --cuda-ipc 1 "$@" > "$OUT/bench-$name.md" 2> "$OUT/bench-$name.err"
  echo "bench $name: rc=$? $((SECONDS - s)) s"
  grep -E "lander flushes|: [A-Z_]+: " "$OUT/bench-$name.err" | grep -v "UCX  ERROR" | head -6
  # run, prompt, MB, store ms, post ms, send drain ms, transfer ms, transfer GB/s, import ms,
  # end-to-end GB/s, floor GB/s, share of floor, state
  while IFS= read -r line; do
    table+=("$(echo "$line" | awk -F'|' -v n="$name" '{gsub(/ /, "", $0);
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", n, $2, $6, $8,
        $9, $10, $12, $13, $14, $16, $17, $18, $22}')")
  done < <(grep -E '^\| [0-9]' "$OUT/bench-$name.md")
}
b new 0 gpu_state_transfer_bench --refs 3 --lander mapped --store-all 1 --import-all 1
b main 0 gpu_state_transfer_bench_main
b linger 500 gpu_state_transfer_bench --refs 3 --lander mapped --store-all 1 --import-all 1
b fused 0 gpu_state_transfer_bench --refs 3 --lander fused --store-all 1 --import-all 1
b host-only 0 gpu_state_transfer_bench --refs 2 --lander staged --store-all 0 --import-all 0
echo "total: $(($(date +%s) - t0)) s"
echo
echo "device_ref_bench (host stand-in lander, no GPU; 4 lanes):"
echo "| lanes | refs | lander | pages | MB | messages | flushes | pages / flush | post ms |" \
  "drain ms | verify ms | total ms | host us / page | linger us |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${host_rows[@]}"
echo
echo "| run | prompt | bytes | store ms | post ms | send drain ms | transfer ms | transfer GB/s |" \
  "import ms | end-to-end GB/s | floor (a) GB/s | end-to-end / floor | state |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
