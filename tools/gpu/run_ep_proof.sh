#!/usr/bin/env bash
# Issue 11's proof and benchmark on a GPU machine, from the repository root (models/ and
# tests/fixtures are read there), with the pack of tools/gpu/pack_ep_proof.sh:
#   here:  cmake --build build --target pdserve ep_bench engine_gpu_tests &&
#          tools/gpu/pack_ep_proof.sh build .device-carry/ep
#   there: .device-carry/ep/tools/run_ep_proof.sh
#
# With 2+ GPUs (the proof):
#   1. engine tests (EFILTER, default the expert-parallel ones): a 2-rank NCCL group on GPUs 0 and
#      1 against the 1-GPU model on every fixture (argmax agreement >= 99%, greedy tokens equal),
#      the NCCL collectives' exact values, and the one-GPU expert-parallel tests;
#   2. PD with prefill on GPU 0 and decode on GPU 1 against `pdserve serve --backend cuda` on one
#      GPU (tools/gpu/run_pd_cuda_e2e.sh: first tokens equal, <= 2 of 12 parting later), then the
#      same PD cluster against a colocated 2-GPU expert-parallel server (--devices 0,1);
#   3. ep_bench: state transfer GPU 0 -> GPU 1 (export + import vs cudaMemcpyPeer vs NCCL send)
#      and decode tokens/s at batch 1..64, 1-GPU decode worker vs colocated 2-GPU group, on
#      V4-Flash layer shapes with BENCH_LAYERS (default 4) layers.
# With 1 GPU: every engine GPU test (EFILTER default '*'), and the PD e2e on GPU 0 against a
# colocated server of two ranks on GPU 0 (--devices 0,0, in-process communicator).
#
# Environment: PACK (default: the pack beside this script), OUT (logs, default ./gpu-out),
# EFILTER, BENCH_LAYERS, SKIP_E2E=1, SKIP_BENCH=1, ENGINE_TIMEOUT / E2E_TIMEOUT / BENCH_TIMEOUT
# (seconds per step: 540 / 400 / 540). NVLink multicast stays off (exported below).
# Prints a summary table last; exit 0 when every step run passed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
pack=${PACK:-$here/..}
out=${OUT:-gpu-out}
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{ nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader; } > "$out/env.txt" 2>&1
[ "$gpus" -ge 1 ] || { echo "no GPU"; exit 2; }
rm -rf /tmp/pdserve-ep && mkdir -p /tmp/pdserve-ep && tar -xJf "$pack/pack.tar.xz" -C /tmp/pdserve-ep
# shellcheck disable=SC1091
source /tmp/pdserve-ep/pack/env.sh
nccl=$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)
[ -z "$nccl" ] || export LD_LIBRARY_PATH=$(dirname "$nccl"):$LD_LIBRARY_PATH
echo "GPUs: $gpus; NCCL: ${nccl:-not found}" | tee -a "$out/env.txt"
summary=()
status=0

if [ "$gpus" -ge 2 ]; then filter=${EFILTER:-'*Expert*:*Comm*:*Padding*'}; else filter=${EFILTER:-'*'}; fi
PDSERVE_SOURCE_DIR=$PWD timeout "${ENGINE_TIMEOUT:-540}" engine_gpu_tests --gtest_filter="$filter" > "$out/engine.log" 2>&1
rc=$?
grep -E "^\[  FAILED|Failure|Expected|Which is" "$out/engine.log" | head -20
grep -E "vs 1 (rank|GPU)|vs no communicator|padded vs|NCCL 2" "$out/engine.log"
summary+=("engine tests ($filter): rc=$rc $(grep -E '^\[  PASSED' "$out/engine.log") $(grep -E '^\[  SKIPPED \] [0-9]+' "$out/engine.log") $(grep -E '^\[  FAILED  \] [0-9]+ test' "$out/engine.log")")
[ "$rc" = 0 ] || status=1

e2e() {  # name, then PREFILL_GPUS DECODE_GPUS SERVE_DEVICES as environment words
  local name=$1
  shift
  env "$@" OUT="$out/$name" BASE_PORT=$((18000 + 10 * ${#summary[@]})) PDSERVE=$(command -v pdserve) \
    timeout "${E2E_TIMEOUT:-400}" "$here/run_pd_cuda_e2e.sh" > "$out/$name.log" 2>&1
  local rc=$?
  tail -16 "$out/$name.log"
  summary+=("e2e $name ($*): rc=$rc $(tail -1 "$out/$name.log")")
  [ "$rc" = 0 ] || status=1
}
if [ "${SKIP_E2E:-0}" != 1 ]; then
  if [ "$gpus" -ge 2 ]; then
    e2e pd-0-1-vs-serve-0 PREFILL_GPUS=0 DECODE_GPUS=1 SERVE_DEVICES=0
    e2e pd-0-1-vs-serve-ep01 PREFILL_GPUS=0 DECODE_GPUS=1 SERVE_DEVICES=0,1
  else
    e2e pd-0-0-vs-serve-ep00 PREFILL_GPUS=0 DECODE_GPUS=0 SERVE_DEVICES=0,0
  fi
fi

if [ "$gpus" -ge 2 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout "${BENCH_TIMEOUT:-540}" ep_bench --layers "${BENCH_LAYERS:-4}" > "$out/bench.md" 2> "$out/bench.log"
  rc=$?
  cat "$out/bench.md"
  summary+=("ep_bench (${BENCH_LAYERS:-4} layers): rc=$rc, $(grep -c '^| decode |' "$out/bench.md") decode rows")
  [ "$rc" = 0 ] || { tail -5 "$out/bench.log"; status=1; }
fi

echo "== summary ($gpus GPU(s))"
printf '%s\n' "${summary[@]}"
exit $status
