#!/usr/bin/env bash
# Issue 26's proof on one H200 in one device call, on the production-shaped model
# models/kjv-v4-wide (V4-Flash attention shapes: its decode runs the fixed-shape sparse-attention
# and indexer kernels). Steps (STEPS, default all, in this order):
#   sampler  the GPU sampler against the CPU sampler over the parameter grid
#            (tools/gpu/run_sampler_tests.sh, packed sampler_gpu_tests; no kernels build)
#   paged    engine_gpu_tests Models/PagedStateTest.*wide*: paged decode == slot-layout decode
#            bit for bit, 96 requests through 64 slots with pages freed and reused == slot layout
#            and == alone runs, a short pool fails the step cleanly, a foreign page (the
#            paranoid test fault) fails only its slot
#   capacity bench/paged/paged_state_bench: requests of 8K / 32K / 128K that fit one H200 at
#            V4-Flash shapes, slot layout vs paged (engine pools == plan), TPOT p50 / p90 at
#            batch 1 / 16 / 64 / 128 on kjv-v4-wide slot layout vs paged; PyTorch's device copy
#            bandwidth in the same run
#   guards   tools/gpu/run_guards_proof.sh: `pdserve check` (long prompts, 4 seeded samples at
#            T 0.6 + greedy) on `pdserve serve --backend cuda` and `pdserve up` with CUDA prefill
#            + CUDA decode: healthy passes, the wrong indexer fails, the canary flags it online,
#            reference_kernels [indexer] passes again
#   scaling  tools/gpu/run_step_scaling.sh on kjv-v4-wide: TPOT at concurrency 1 / 16 / 64,
#            device vs host sampling
# Here: build pdserve, engine_gpu_tests, sampler_gpu_tests and paged_state_bench, then
#   EXTRA_BINS=build/bench/paged/paged_state_bench tools/gpu/device_tree.sh bundle build &&
#   tools/gpu/device_tree.sh wide        # carry .device-carry; restore afterwards
# There: OUT=$OUT tools/gpu/run_issue26_proof.sh (it unpacks the bundle and the model itself).
# Environment: OUT (gpu-out/issue26), STEPS, GUARD_RUNS (run_guards_proof.sh's RUNS). Table last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0
out=${OUT:-gpu-out/issue26}
steps=${STEPS:-sampler paged capacity guards scaling}
mkdir -p "$out"
out=$(cd "$out" && pwd)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

if [ ! -d .device-carry/bin ]; then
  tar -xJf .device-carry/bundle.tar.xz -C .device-carry &&
    (cd .device-carry/bin && XZ_OPT="-0 -T0" tar -cJf ../gpu/libs.tar.xz lib)
fi
[ -f models/kjv-v4-wide/model.safetensors ] || tar -xJf .device-carry/wide.tar.xz
pack=.device-carry/gpu
mkdir -p /tmp/pdserve-libs && tar -xJf "$pack/libs.tar.xz" -C /tmp/pdserve-libs
cublas=$(dirname "$(find / -name 'libcublas.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)")
nccl=$(dirname "$(find / -name 'libnccl.so.2*' -not -path '/proc/*' 2>/dev/null | head -1)")
chmod +x "$pack"/bin/*
nvidia-smi -L > "$out/env.txt" 2>&1

if [[ " $steps " == *" sampler "* ]]; then
  SKIP_KERNELS=1 PACK=$pack OUT=$out/sampler timeout 240 tools/gpu/run_sampler_tests.sh \
    > "$out/sampler.txt" 2>&1
  row "GPU sampler == CPU sampler" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "$(grep -E '^sampler_gpu ' "$out/sampler.txt" | head -3 | tr '\n' ';') ($(elapsed))"
fi

if [[ " $steps " == *" paged "* ]]; then
  LD_LIBRARY_PATH=/tmp/pdserve-libs/lib:$cublas:$nccl:${LD_LIBRARY_PATH:-} PDSERVE_SOURCE_DIR=$PWD \
    timeout 300 "$pack/bin/engine_gpu_tests" --gtest_filter='Models/PagedStateTest.*wide*' \
    > "$out/paged.log" 2>&1
  rc=$?
  row "paged state tests (kjv-v4-wide)" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")" \
    "$(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$out/paged.log" | tr '\n' ' ') $(grep -E '^paged:' "$out/paged.log" | tr '\n' ' ')($(elapsed))"
fi

if [[ " $steps " == *" capacity "* ]]; then
  python3 - > "$out/copy_bw.txt" 2>&1 <<'PY'
import torch
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20): b.copy_(a)
e.record(); torch.cuda.synchronize()
ms = s.elapsed_time(e) / 20
print(f"torch {torch.__version__} device copy of 1 GiB: {ms:.3f} ms, {2 * n / ms / 1e6:.0f} GB/s (read + write)")
PY
  row "PyTorch device copy" "$(tail -1 "$out/copy_bw.txt")" "($(elapsed))"
  (
    # shellcheck disable=SC1091
    source .device-carry/bin/env.sh
    timeout 300 paged_state_bench --flash-config tests/fixtures/v4_configs/flash \
      --model models/kjv-v4-wide --batches 1,16,64,128 --prompt 512 --steps 64 \
      > "$out/capacity.md" 2> "$out/capacity.err"
  )
  row "paged_state_bench" "$([ $? = 0 ] && echo PASS || echo FAIL)" "tables below ($(elapsed))"
fi

if [[ " $steps " == *" guards "* ]]; then
  RUNS=${GUARD_RUNS:-} BINS=.device-carry/bin PACK=$pack OUT=$out/guards timeout 420 \
    tools/gpu/run_guards_proof.sh > "$out/guards.txt" 2>&1
  row "guards on CUDA (run_guards_proof.sh)" "$([ $? = 0 ] && echo PASS || echo FAIL)" \
    "table below ($(elapsed))"
fi

if [[ " $steps " == *" scaling "* ]]; then
  (
    # shellcheck disable=SC1091
    source .device-carry/bin/env.sh
    MODEL=models/kjv-v4-wide OUT=$out/scaling PDSERVE=$(command -v pdserve) timeout 200 \
      tools/gpu/run_step_scaling.sh > "$out/scaling.txt" 2>&1
  )
  row "step scaling kjv-v4-wide" "$([ $? = 0 ] && echo PASS || echo FAIL)" "below ($(elapsed))"
fi

for f in capacity.md scaling.txt; do
  [ -f "$out/$f" ] && { echo; echo "== $f"; tail -40 "$out/$f"; }
done
[ -f "$out/guards.txt" ] && { echo; echo "== guards"; tail -25 "$out/guards.txt"; }
echo
echo "| step | result | detail |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
