#!/usr/bin/env bash
# One device call for issue 27's device-to-device data movement (runtime/cuda/device_state_pages.h:
# a CUDA slot's layer to and from state pages in device memory, laid out as the host pages), from
# the repository root on an H100 / H200 with CUDA 13, from a pack built on the Debian machine:
#   1. the GPU tests (engine_gpu_tests, FILTER, default '*GpuDevicePages*'): on the four engine
#      test models after a real forward, at positions 0 .. 511, every device page equals the host
#      page of ExportLayerAsync + PagedState::StoreLayerRing byte for byte, every GPU checksum
#      equals kv::PayloadChecksum (libxxhash), device pages -> a slot equals the host import
#      (exported state and next decode logits bit for bit); the refusals;
#   2. bench/kvtransfer/device_pages_bench: V4-Flash attention shapes (LAYERS, default 8) at
#      LENGTHS (default 4096,32768,131072) tokens: slot -> device pages with and without the GPU
#      checksums, device pages -> slot (with the source pages' checksums), GB/s of the page bytes
#      against floor (a) (cudaMemcpy device -> pinned -> device of the same bytes), state equal;
#   3. SANITIZE=1 (default): compute-sanitizer memcheck on device_pages_bench at 2 layers and 4099
#      tokens (open compressor windows, every kind of run; no forward, so it is quick), at most
#      40 s (a timeout is reported as such, not as a failure);
#   4. GUARD (default '*GpuStateStaging*:*LastRowLogits*:*GpuPrefill*'): the host path's tests
#      over the refactored BeginForwardExporting (now BeginForwardMarked's), in the time left of
#      225 s (a timeout is reported as such);
#   5. prints a short table last.
# Make the pack here (worktree root, after building the two targets):
#   cmake --build build --target engine_gpu_tests device_pages_bench -j2
#   tools/gpu/pack_binaries.sh .device-carry/devpages57 build/tests/engine_gpu/engine_gpu_tests \
#     build/bench/kvtransfer/device_pages_bench
#   (cd .device-carry && tar -cf - devpages57 | xz -6 -T2 > devpages57.tar.xz && rm -rf devpages57)
# then `tools/gpu/device_tree.sh tests` (the tree under the 64 MiB limit with the pack, ~13 MB),
# carry .device-carry/devpages57.tar.xz, and `tools/gpu/device_tree.sh restore` afterwards.
# Environment: OUT (default gpu-out; logs there), PACK, FILTER, LENGTHS, LAYERS, REPEATS (5),
# SANITIZE, GUARD (empty: none). Expected time: tests ~60 s, bench ~60 s, memcheck <= 40 s, the
# guard what is left: at most 230 s (limit 240).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
pack=${PACK:-.device-carry/devpages57.tar.xz}
filter=${FILTER:-*GpuDevicePages*}
lengths=${LENGTHS:-4096,32768,131072}
layers=${LAYERS:-8}
repeats=${REPEATS:-5}
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 |
  tee "$out/gpu.txt"
summary=()

dir=/tmp/devpages57-pack
rm -rf "$dir" && mkdir -p "$dir"
if ! tar -xJf "$pack" -C "$dir" 2> "$out/unpack.log"; then
  cat "$out/unpack.log"
  echo "NO PACK ($pack): nothing to run"
  exit 1
fi
# shellcheck disable=SC1091  # written by tools/gpu/pack_binaries.sh
source "$dir/devpages57/env.sh"

start=$SECONDS
PDSERVE_SOURCE_DIR=$PWD timeout 100 engine_gpu_tests --gtest_filter="$filter" > "$out/tests.log" 2>&1
rc=$?
grep -E "^\[  FAILED|Failure|Expected|Which is|layer .* page" "$out/tests.log" | head -30
summary+=("tests ($filter): rc=$rc $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \] [0-9]+' "$out/tests.log" | tr '\n' ' ')")
[ "$rc" = 124 ] && summary+=("tests: TIMED OUT after 100 s")

start=$SECONDS
timeout 75 device_pages_bench --layers "$layers" --lengths "$lengths" --repeats "$repeats" \
  > "$out/bench.md" 2> "$out/bench.log"
rc=$?
[ "$rc" = 0 ] || { tail -5 "$out/bench.log"; }
summary+=("bench: rc=$rc $((SECONDS - start)) s")

if [ "${SANITIZE:-1}" = 1 ]; then
  start=$SECONDS
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout 40 "$sanitizer" --tool memcheck --error-exitcode 3 \
    "$(command -v device_pages_bench)" --layers 2 --lengths 4099 --repeats 1 \
    > "$out/memcheck.log" 2>&1
  rc=$?
  grep -m10 -E "ERROR SUMMARY|Invalid|out of bounds|^\| 4099" "$out/memcheck.log"
  case $rc in
    0) summary+=("memcheck: clean, $((SECONDS - start)) s") ;;
    124) summary+=("memcheck: timed out after 40 s (no verdict)") ;;
    *) summary+=("memcheck: rc=$rc $(grep -m1 'ERROR SUMMARY' "$out/memcheck.log")") ;;
  esac
fi

guard=${GUARD:-*GpuStateStaging*:*LastRowLogits*:*GpuPrefill*}
left=$((225 - (SECONDS - t0)))
if [ -n "$guard" ] && [ "$left" -gt 10 ]; then
  start=$SECONDS
  PDSERVE_SOURCE_DIR=$PWD timeout "$left" engine_gpu_tests --gtest_filter="$guard" \
    > "$out/guard.log" 2>&1
  rc=$?
  grep -E "^\[  FAILED|Failure" "$out/guard.log" | head -10
  summary+=("guard ($guard): rc=$rc $((SECONDS - start)) s (limit $left s) $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+ test' "$out/guard.log" | tr '\n' ' ')")
else
  summary+=("guard: not run ($left s left)")
fi

echo
echo "## device pages <-> GPU slot (V4-Flash shapes, $layers layers; $(head -1 "$out/gpu.txt"))"
cat "$out/bench.md"
printf '%s\n' "${summary[@]}"
echo "total: $((SECONDS - t0)) s"
