#!/usr/bin/env bash
# Issue 27, the workers' CUDA IPC path (transfer.cuda_ipc): one device call runs
# tools/gpu/run_pd_cuda_e2e.sh three ways on one GPU (CUDA prefill + CUDA decode workers of
# `pdserve up` sharing gpus "0"), against the colocated CUDA server run once:
#   1. transfer.cuda_ipc: on  -- both workers log that they set the path up, both count >= 12
#      transfers under the transfer metrics' path "cuda-ipc", tokens as colocated CUDA (the
#      prefill worker stores the layers into its arena after the last chunk);
#   2. the same with PDSERVE_CUDA_IPC_OVERLAP=1 -- the stores are enqueued during the last chunk
#      (GpuModel::BeginForwardStoring), same checks;
#   3. transfer.cuda_ipc: off -- no transfer under "cuda-ipc" (host pages), tokens as colocated;
#   with AUTO=1 also (config::EffectiveCudaIpc, 2026-12-05):
#   4. transfer.cuda_ipc: auto -- read as on (one-GPU CUDA workers, early import): as 1;
#   5. auto with transfer.early_import: false -- read as off: neither worker sets the path up
#      (no arena, no device page pool), no transfer under "cuda-ipc", tokens as colocated.
# A table of the three runs is printed last. Each step under `timeout`; a failed step is reported
# and the next one still runs. Budget: <= 240 s on the device machine.
#
# Here (binaries are built on this machine; the device machine has no gRPC / UCX headers):
#   cmake --build build --target pdserve -j2
#   tools/gpu/run_ipcwire58.sh pack        # .device-carry/ipcwire58.tar.xz (pdserve + its libs)
#   tools/gpu/device_tree.sh tests         # the tree fits a device call (restore afterwards)
# There (carry .device-carry/ipcwire58.tar.xz):
#   OUT=<dir> bash tools/gpu/run_ipcwire58.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  tmp=$(mktemp -d)
  tools/gpu/pack_binaries.sh "$tmp/ipcwire58" "${BUILD:-build}/pdserve" > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - ipcwire58 | xz -6 -T0) > .device-carry/ipcwire58.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/ipcwire58.tar.xz
  exit 0
fi
out=${OUT:-gpu-out/ipcwire58}
mkdir -p "$out"
if [ -z "${PDSERVE:-}" ]; then
  if [ ! -x .device-carry/ipcwire58/bin/pdserve ]; then
    tar -xJf .device-carry/ipcwire58.tar.xz -C .device-carry ||
      { echo "FAIL: no .device-carry/ipcwire58.tar.xz (run '$0 pack' here first)"; exit 2; }
  fi
  # shellcheck disable=SC1091
  source .device-carry/ipcwire58/env.sh
  export PDSERVE=$(command -v pdserve)
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
declare -A result
step() {  # name, seconds, environment assignments...
  local name=$1 seconds=$2
  shift 2
  echo "== $name ($*)"
  mkdir -p "$out/$name"
  cp "$out"/serve-cuda.json "$out/$name/" 2>/dev/null || true
  local started=$SECONDS
  env OUT="$out/$name" NO_CPU=1 "$@" timeout -k 5 "$seconds" bash tools/gpu/run_pd_cuda_e2e.sh \
    > "$out/$name/e2e.log" 2>&1
  local rc=$?
  echo "($((SECONDS - started)) s)"
  tail -4 "$out/$name/e2e.log"
  [ -f "$out/serve-cuda.json" ] || cp "$out/$name/serve-cuda.json" "$out/" 2>/dev/null || true
  if [ "$rc" = 0 ]; then result[$name]=PASS; else result[$name]="FAIL (rc $rc, $out/$name/e2e.log)"; fi
}
step cuda-ipc-on 95 CUDA_IPC=on BASE_PORT=18100
step cuda-ipc-overlap 65 CUDA_IPC=on PDSERVE_CUDA_IPC_OVERLAP=1 BASE_PORT=18200
step cuda-ipc-off 65 CUDA_IPC=off BASE_PORT=18300
if [ -n "${AUTO:-}" ]; then
  step cuda-ipc-auto 65 CUDA_IPC=auto BASE_PORT=18400
  step cuda-ipc-auto-late 65 CUDA_IPC=auto EARLY_IMPORT=0 BASE_PORT=18500
fi
runs=(cuda-ipc-on cuda-ipc-overlap cuda-ipc-off)
[ -z "${AUTO:-}" ] || runs+=(cuda-ipc-auto cuda-ipc-auto-late)
echo
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-26s %-8s %-8s %s\n' run prefill decode result
for name in "${runs[@]}"; do
  p=$(awk '/^pdserve_kv_transfer_bytes_count\{/ && /path="cuda-ipc"/ {n += $NF} END {print n + 0}' \
    "$out/$name/prefill-metrics.txt" 2>/dev/null || echo -)
  d=$(awk '/^pdserve_kv_transfer_bytes_count\{/ && /path="cuda-ipc"/ {n += $NF} END {print n + 0}' \
    "$out/$name/decode-metrics.txt" 2>/dev/null || echo -)
  printf '%-26s %-8s %-8s %s\n' "$name" "$p" "$d" "${result[$name]:-not run}"
done
echo "(prefill / decode: transfers counted under path cuda-ipc)"
for name in "${runs[@]}"; do
  [[ "${result[$name]}" == PASS* ]] || exit 1
done
