#!/usr/bin/env bash
# Issue 27: the same-host device-to-device path through the product's protocol classes
# (docs/protocol.md, "Same-host device-to-device pages (CUDA IPC)"), one device call of at most
# BUDGET (default 300) s, from the repository root on a Hopper GPU, with a pack built here:
#   1. the CUDA IPC GPU tests (pdserve_kvtransfer_cuda_ipc_tests: the arena, a peer process's
#      mapping, CudaPageLander landing a batch of 37 odd-length pages with every byte and hash
#      checked, the refusals);
#   2. the device-pages GPU tests (engine_gpu_tests *GpuDevicePages*: a slot's layers to device
#      pages equal to the host pages byte for byte with equal checksums, the import from device
#      pages equal to the host import, stores during the last chunk);
#   3. gpu_state_transfer_bench over shm,self (UCX v1), 8 V4-Flash-shaped layers, random state,
#      4K / 32K / 128K (LENGTHS), medians of 3, the whole state sent after the chunk's compute:
#      --cuda-ipc 1 (pages in the prefill process's GPU arena, landed by the decode process's
#      lanes device to device, imported device to device) and, in the same run, --shm-pull 1
#      (the host path of today, early import on) as the baseline; both against floor (a)
#      (cudaMemcpy device -> pinned -> device of the same bytes, measured in the run).
# Pack (here, from the repository root):
#   cmake --build build --target gpu_state_transfer_bench engine_gpu_tests \
#     pdserve_kvtransfer_cuda_ipc_tests
#   tools/gpu/pack_binaries.sh /tmp/ipc57 build/bench/kvtransfer/gpu_state_transfer_bench \
#     build/tests/engine_gpu/engine_gpu_tests build/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests
#   (cd /tmp && tar -cf - ipc57 | xz -6 -T0 > <repo>/.device-carry/ipc57.tar.xz)
# and carry .device-carry/ipc57.tar.xz (with tools/gpu/device_tree.sh tests for the tree's size).
# Environment: OUT (default gpu-out/ipc57), PACK, BUDGET, LENGTHS, LANES (bench --lanes; 0: the
# workers' default). The comparison table is printed last.
set -u
OUT=${OUT:-gpu-out/ipc57}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export NCCL_NVLS_ENABLE=0
t0=$(date +%s)
budget=${BUDGET:-300}
lengths=${LENGTHS:-4096,32768,131072}
pack=${PACK:-.device-carry/ipc57.tar.xz}
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
source "$dir/ipc57/env.sh"

s=$SECONDS
timeout "$(cap 40)" pdserve_kvtransfer_cuda_ipc_tests > "$OUT/ipc_tests.log" 2>&1
echo "cuda ipc GPU tests: rc=$? $((SECONDS - s)) s" \
  "$(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$OUT/ipc_tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Which is|peer:|lander peer" "$OUT/ipc_tests.log" | head -12

s=$SECONDS
timeout "$(cap 100)" engine_gpu_tests --gtest_filter='*GpuDevicePages*' > "$OUT/device_pages_tests.log" 2>&1
echo "device pages GPU tests: rc=$? $((SECONDS - s)) s" \
  "$(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$OUT/device_pages_tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|Failure|Which is" "$OUT/device_pages_tests.log" | head -12

table=()
b() {  # name, bench flags...
  local name=$1
  shift
  local s=$SECONDS
  [ "$(cap 10)" -ge 10 ] || { echo "bench $name skipped: out of time"; return; }
  UCX_TLS=shm,self UCX_PROTO_ENABLE=n timeout "$(cap 70)" gpu_state_transfer_bench --layers 8 \
    --lengths "$lengths" --forward-max 0 --repeats 3 --overlap 0 --old-import 0 \
    --lanes "${LANES:-0}" "$@" > "$OUT/bench-$name.md" 2> "$OUT/bench-$name.err"
  echo "bench $name: rc=$? $((SECONDS - s)) s"
  tail -3 "$OUT/bench-$name.err"
  # run, prompt, MB, store ms, post ms, transfer ms, transfer GB/s, import ms, end-to-end GB/s,
  # floor GB/s, share of floor, state
  while IFS= read -r line; do
    table+=("$(echo "$line" | awk -F'|' -v n="$name" '{gsub(/ /, "", $0);
      printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |", n, $2, $6, $8, $9,
        $12, $13, $14, $16, $17, $18, $22}')")
  done < <(grep -E '^\| [0-9]' "$OUT/bench-$name.md")
}
b cuda-ipc --cuda-ipc 1
b shm-pull --shm-pull 1 --early-import 1
echo "total: $(($(date +%s) - t0)) s"
echo
echo "| run | prompt | bytes | store ms | post ms | transfer ms | transfer GB/s | import ms |" \
  "end-to-end GB/s | floor (a) GB/s | end-to-end / floor | state |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${table[@]}"
