#!/usr/bin/env bash
# The 2026-12-05 evening session's last device call: main after the ipc59, plan59 and Sinkhorn
# merges, every changed GPU path once, in at most ~450 s, each step under its script's limits:
#   1. tools/gpu/run_sinkhorn59.sh: the Sinkhorn and grouped / W8A16 GEMM GPU tests,
#      bench/cuda/sinkhorn_bench, the engine's whole GPU suite (ipc59's kept descriptor rings,
#      LoadLayers and batched early imports among them), run_layer_profile.sh at batch 1;
#   2. tools/gpu/run_ipc59.sh at 4K (8 and 43 V4-Flash layers, new against old, 3 measured
#      transfers each, BUDGET 140 s);
#   3. tools/gpu/run_ipcwire58.sh with this pdserve: `pdserve up`, CUDA prefill + CUDA decode on
#      one GPU through CUDA IPC, completions equal to colocated CUDA.
# Here: build the seven binaries below, then
#   tools/gpu/run_final59.sh pack       # .device-carry/final59.tar.xz (one pack for all steps)
#   tools/gpu/device_tree.sh tests      # the tree fits a device call (restore afterwards)
# There (carry .device-carry/final59.tar.xz): OUT=<dir> bash tools/gpu/run_final59.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = pack ]; then
  set -e
  b=${BUILD:-build}
  tmp=$(mktemp -d)
  tools/gpu/pack_binaries.sh "$tmp/final59" "$b/pdserve" "$b/tests/engine_gpu/engine_gpu_tests" \
    "$b/tests/kernels_cuda/pdserve_kernels_cuda_tests" "$b/bench/cuda/pdserve_sinkhorn_bench" \
    "$b/bench/engine/gpu_decode_step_bench" "$b/bench/kvtransfer/gpu_state_transfer_bench" \
    "$b/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests" > /dev/null
  mkdir -p .device-carry
  (cd "$tmp" && tar -cf - final59 | xz -9e -T2) > .device-carry/final59.tar.xz
  rm -rf "$tmp"
  ls -la .device-carry/final59.tar.xz
  exit 0
fi
out=${OUT:-gpu-out/final59}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0
tar -xJf .device-carry/final59.tar.xz -C .device-carry ||
  { echo "FAIL: no .device-carry/final59.tar.xz (run '$0 pack' here first)"; exit 2; }
# The other scripts find their binaries under their own pack names.
for name in sinkhorn59 layer_profile; do
  rm -rf ".device-carry/$name" && ln -s final59 ".device-carry/$name"
done
s=$SECONDS
BATCHES=1 OUT="$out/sinkhorn59" timeout -k 5 330 bash tools/gpu/run_sinkhorn59.sh > "$out/sinkhorn59.log" 2>&1
echo "run_sinkhorn59: rc=$? $((SECONDS - s)) s"
s=$SECONDS
PACK_DIR=$PWD/.device-carry/final59 LENGTHS=4096 REPEATS=3 BUDGET=140 OUT="$out/ipc59" \
  timeout -k 5 150 bash tools/gpu/run_ipc59.sh > "$out/ipc59.log" 2>&1
echo "run_ipc59 (4K): rc=$? $((SECONDS - s)) s"
s=$SECONDS
# shellcheck disable=SC1091
source .device-carry/final59/env.sh
PDSERVE=$(command -v pdserve) OUT="$out/e2e" timeout -k 5 150 bash tools/gpu/run_ipcwire58.sh \
  > "$out/e2e.log" 2>&1
echo "run_ipcwire58: rc=$? $((SECONDS - s)) s"
echo
tail -24 "$out/sinkhorn59.log"
echo
grep -E "GPU tests:|^\| (run|new|old|---)" "$out/ipc59.log"
echo
tail -6 "$out/e2e.log"
