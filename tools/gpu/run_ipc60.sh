#!/usr/bin/env bash
# Issue 27's table at the real V4-Flash layer count, and two checks left from 2026-12-05, in one
# device call of at most ~580 s (each step under its own limit; a failed step does not stop the
# next):
#   1. the Sinkhorn GPU tests (kernels/cuda/sinkhorn.cu: the kEntries kernel after its fix of the
#      full-mask shuffles, bit for bit against the row and shared-memory kernels, -inf rows among
#      the inputs) and bench/cuda/sinkhorn_bench (each kernel inside a CUDA graph);
#   2. tools/gpu/run_ipc59.sh at 4K, 32K and 128K tokens with 8 and 43 V4-Flash layers (the
#      benchmark keeps each length's prefix state on the device: --prefix-slot 1, its first run),
#      new (the workers' path) against old (PDSERVE_DEVICE_PAGES=fresh,
#      PDSERVE_EARLY_IMPORT_BATCH=0), REPEATS measured transfers a length (default 3);
#   3. tools/gpu/run_ipcwire58.sh with AUTO=1: `pdserve up`, CUDA prefill + CUDA decode on one GPU,
#      transfer.cuda_ipc on / on with the overlap / off / auto / auto without the early import
#      (config::EffectiveCudaIpc reads it as off: neither worker sets the path up), completions
#      equal to colocated CUDA.
# Here (the pack holds the same seven binaries as run_final59.sh's):
#   cmake --build build --target pdserve engine_gpu_tests pdserve_kernels_cuda_tests \
#     pdserve_sinkhorn_bench gpu_decode_step_bench gpu_state_transfer_bench \
#     pdserve_kvtransfer_cuda_ipc_tests
#   tools/gpu/run_final59.sh pack        # .device-carry/final59.tar.xz
#   tools/gpu/device_tree.sh tests       # the tree fits a device call (restore afterwards)
# There (carry .device-carry/final59.tar.xz): OUT=<dir> bash tools/gpu/run_ipc60.sh
# Environment: OUT, REPEATS, IPC_BUDGET (run_ipc59's budget, default 330 s).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
out=${OUT:-gpu-out/ipc60}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0
tar -xJf .device-carry/final59.tar.xz -C .device-carry ||
  { echo "FAIL: no .device-carry/final59.tar.xz (run 'tools/gpu/run_final59.sh pack' here)"; exit 2; }
# shellcheck disable=SC1091
source .device-carry/final59/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader \
  > "$out/gpu.txt" 2>&1 || true
passed() {  # log file: gtest's summary lines
  grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$1" | tr '\n' ' '
}
declare -A result
s=$SECONDS
timeout -k 5 40 pdserve_kernels_cuda_tests --gtest_filter='CudaSinkhorn*' > "$out/sinkhorn.log" 2>&1
result[sinkhorn]="rc=$? $((SECONDS - s)) s $(passed "$out/sinkhorn.log")"
s=$SECONDS
timeout -k 5 30 pdserve_sinkhorn_bench > "$out/sinkhorn_bench.csv" 2>&1
result[bench]="rc=$? $((SECONDS - s)) s"
s=$SECONDS
PACK_DIR=$PWD/.device-carry/final59 LENGTHS=4096,32768,131072 REPEATS=${REPEATS:-3} \
  BUDGET=${IPC_BUDGET:-330} BENCH_CAP=150 RUNS=new-8,old-8,new-43,old-43 OUT="$out/ipc59" \
  timeout -k 5 $((${IPC_BUDGET:-330} + 10)) bash tools/gpu/run_ipc59.sh > "$out/ipc59.log" 2>&1
result[ipc]="rc=$? $((SECONDS - s)) s"
s=$SECONDS
PDSERVE=$(command -v pdserve) AUTO=1 OUT="$out/e2e" timeout -k 5 170 bash tools/gpu/run_ipcwire58.sh \
  > "$out/e2e.log" 2>&1
result[e2e]="rc=$? $((SECONDS - s)) s"
echo "GPU: $(cat "$out/gpu.txt")"
printf '%-24s %s\n' step result
printf '%-24s %s\n' "sinkhorn GPU tests" "${result[sinkhorn]}"
printf '%-24s %s\n' "sinkhorn bench" "${result[bench]}"
printf '%-24s %s\n' "run_ipc59 (3 lengths)" "${result[ipc]}"
printf '%-24s %s\n' "run_ipcwire58 AUTO=1" "${result[e2e]}"
grep -E "^\[  FAILED|Failure" "$out/sinkhorn.log" | head -6
head -20 "$out/sinkhorn_bench.csv"
echo
tail -9 "$out/e2e.log"
echo
grep -E "GPU tests:|skipped|^\| (run|new|old|---)" "$out/ipc59.log"
