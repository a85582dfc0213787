#!/usr/bin/env bash
# The CUDA IPC review's GPU checks (branch review58): the fixes that only a GPU can run, in one
# device call of at most ~300 s on one Hopper GPU, each step under `timeout`, a failed step
# reported and the next one still run, a table printed last:
#   1. the CUDA IPC tests (pdserve_kvtransfer_cuda_ipc_tests): every arena open and lander batch
#      now checks the handle's offset and size against the mapped allocation
#      (cuMemGetAddressRange of the mapping): a legitimate arena must still open (all tests), and
#      the lander peer refuses an oversized and a wrapped-offset arena at Add (exit 39 / 40 of
#      the peer, in each lander mode: staged, mapped, fused);
#   2. the device-pages GPU tests (engine_gpu_tests '*GpuDevicePages*'): DeviceStatePages's launch
#      records its event also after a failed launch (the passing paths unchanged);
#   3. tools/gpu/run_ipcwire58.sh with this branch's pdserve: `pdserve up`, CUDA prefill + CUDA
#      decode on one GPU, transfer.cuda_ipc on / on with overlap / off: completions equal to
#      colocated and >= 12 transfers under path "cuda-ipc" (the lander keeps no arena between
#      batches now, so every batch looks its arena up in PeerArenaCache; the sender no longer
#      disables a decode worker's pulls after a failed GPU page).
# Here (the device machine has no gRPC / UCX headers):
#   cmake --build build --target pdserve engine_gpu_tests pdserve_kvtransfer_cuda_ipc_tests -j2
#   tools/gpu/run_review58.sh pack      # .device-carry/review58.tar.xz
#   tools/gpu/device_tree.sh tests      # the tree fits a device call (restore afterwards)
# There (carry .device-carry/review58.tar.xz): OUT=<dir> bash tools/gpu/run_review58.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  b=${BUILD:-build}
  tools/gpu/pack_binaries.sh "$tmp/review58" "$b/pdserve" "$b/tests/engine_gpu/engine_gpu_tests" \
    "$b/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests" > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - review58 | xz -6 -T0) > .device-carry/review58.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/review58.tar.xz
  exit 0
fi
out=${OUT:-gpu-out/review58}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0
if [ ! -x .device-carry/review58/bin/pdserve ]; then
  tar -xJf .device-carry/review58.tar.xz -C .device-carry ||
    { echo "FAIL: no .device-carry/review58.tar.xz (run '$0 pack' here first)"; exit 2; }
fi
# shellcheck disable=SC1091
source .device-carry/review58/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
declare -A result
s=$SECONDS
timeout -k 5 60 pdserve_kvtransfer_cuda_ipc_tests > "$out/ipc_tests.log" 2>&1
rc=$?
result[ipc]="rc=$rc $((SECONDS - s)) s $(passed "$out/ipc_tests.log")"
echo "cuda ipc GPU tests: ${result[ipc]}"
grep -E "^\[  FAILED|Failure|Which is|lander peer|peer:" "$out/ipc_tests.log" | head -12

s=$SECONDS
timeout -k 5 90 engine_gpu_tests --gtest_filter='*GpuDevicePages*' > "$out/device_pages.log" 2>&1
rc=$?
result[pages]="rc=$rc $((SECONDS - s)) s $(passed "$out/device_pages.log")"
echo "device pages GPU tests: ${result[pages]}"
grep -E "^\[  FAILED|Failure|Which is" "$out/device_pages.log" | head -12

s=$SECONDS
PDSERVE=$(command -v pdserve) OUT="$out/e2e" timeout -k 5 240 bash tools/gpu/run_ipcwire58.sh \
  > "$out/e2e.log" 2>&1
rc=$?
result[e2e]="rc=$rc $((SECONDS - s)) s"
echo "pdserve up, CUDA P + D through cuda ipc: ${result[e2e]}"

echo
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-34s %s\n' step result
printf '%-34s %s\n' "cuda ipc tests (arena, lander x3)" "${result[ipc]}"
printf '%-34s %s\n' "device pages tests" "${result[pages]}"
printf '%-34s %s\n' "pdserve up e2e (run_ipcwire58)" "${result[e2e]}"
tail -6 "$out/e2e.log"
