#!/usr/bin/env bash
# Issue 27, the workers' CUDA IPC path (transfer.cuda_ipc): one device call runs
# tools/gpu/run_pd_cuda_e2e.sh three ways on one GPU (CUDA prefill + CUDA decode workers of
# `pdserve up` sharing gpus "0"), against the colocated CUDA server run once:
#   1. transfer.cuda_ipc: on  -- both workers log that they set the path up, both count >= 12
#      transfers under the transfer metrics' path "cuda-ipc", tokens as colocated CUDA;
#   2. transfer.cuda_ipc: off -- no transfer under "cuda-ipc" (host pages), tokens as colocated;
#   3. on with transfer.early_import: false -- the decode worker cannot import from device pages
#      without the early importer, so every request goes by host pages (the fallback path), tokens
#      as colocated; the path check of step 2 (none under "cuda-ipc").
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
  env OUT="$out/$name" NO_CPU=1 "$@" timeout "$seconds" bash tools/gpu/run_pd_cuda_e2e.sh \
    > "$out/$name/e2e.log" 2>&1
  local rc=$?
  tail -4 "$out/$name/e2e.log"
  [ -f "$out/serve-cuda.json" ] || cp "$out/$name/serve-cuda.json" "$out/" 2>/dev/null || true
  if [ "$rc" = 0 ]; then result[$name]=PASS; else result[$name]="FAIL (rc $rc, $out/$name/e2e.log)"; fi
}
step cuda-ipc-on 100 CUDA_IPC=on BASE_PORT=18100
step cuda-ipc-off 55 CUDA_IPC=off BASE_PORT=18200
step on-without-early-import 55 CUDA_IPC=on EARLY_IMPORT=0 BASE_PORT=18300
# The third run's path check: on, so the e2e demanded cuda-ipc transfers; without the early
# importer there must be none (every request by host pages). Judge it here from its metrics.
third=$out/on-without-early-import
if [ -f "$third/decode-metrics.txt" ]; then
  n=$(awk '/^pdserve_kv_transfer_bytes_count\{/ && /path="cuda-ipc"/ {n += $NF} END {print n + 0}' \
    "$third/decode-metrics.txt")
  tokens_ok=$(grep -q "first tokens differing from colocated cuda: 0 " "$third/e2e.log" &&
    grep -q "parted later: [012] " "$third/e2e.log" && echo yes || echo no)
  if [ "$n" = 0 ] && [ "$tokens_ok" = yes ]; then
    result[on-without-early-import]="PASS (host pages: 0 cuda-ipc transfers, tokens as colocated)"
  else
    result[on-without-early-import]="FAIL ($n cuda-ipc transfers, tokens ok: $tokens_ok)"
  fi
fi
echo
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-26s %-8s %-8s %s\n' run prefill decode result
for name in cuda-ipc-on cuda-ipc-off on-without-early-import; do
  p=$(awk '/^pdserve_kv_transfer_bytes_count\{/ && /path="cuda-ipc"/ {n += $NF} END {print n + 0}' \
    "$out/$name/prefill-metrics.txt" 2>/dev/null || echo -)
  d=$(awk '/^pdserve_kv_transfer_bytes_count\{/ && /path="cuda-ipc"/ {n += $NF} END {print n + 0}' \
    "$out/$name/decode-metrics.txt" 2>/dev/null || echo -)
  printf '%-26s %-8s %-8s %s\n' "$name" "$p" "$d" "${result[$name]:-not run}"
done
echo "(prefill / decode: transfers counted under path cuda-ipc)"
for name in cuda-ipc-on cuda-ipc-off; do
  [[ "${result[$name]}" == PASS* ]] || exit 1
done
[[ "${result[on-without-early-import]}" == PASS* ]] || exit 1
