#!/usr/bin/env bash
# One device call for the CUDA IPC building blocks of issue 27's same-host device-to-device path
# (docs/protocol.md, "Same-host device-to-device pages (CUDA IPC), design"), from the repository
# root on an H200 with CUDA 13:
#   1. builds tools/gpu/ipc54 (the XXH3 page kernel, the page copy kernel, their GPU tests and
#      the XXH3 benchmark; CUDA + GoogleTest only, ~20 s on 16 cores);
#   2. their GPU tests (fresh random bytes each run; the reference is libxxhash where xxhash.h is
#      present, else kernels/cuda/xxh3_scalar.cuh on the host), with the length-class cases
#      dumped and checked again by Python's xxhash (a third implementation) when it imports;
#      SANITIZE=1 (default): compute-sanitizer memcheck on the length-class test (<= 30 s);
#   3. bench/cuda/xxh3_bench: XXH3 GB/s against the read floor of the same bytes;
#   4. the carried pack (PACK, default .device-carry/ipc54.tar.xz: built on the Debian machine,
#      it needs absl): the arena's GPU tests (tests/kvtransfer/cuda_ipc: a peer process maps the
#      arena, reads, checksums, writes) and bench/kvtransfer/ipc_transfer_bench, two processes on
#      GPU 0, 4K / 32K / 128K-token prompts: once per copy way (COPIES, default "kernel batch
#      memcpy") and once with one byte flipped per repeat (D must name that page);
#   5. prints the tables last.
# Make the pack here (from the worktree root, after building the two targets):
#   cmake --build build --target ipc_transfer_bench pdserve_kvtransfer_cuda_ipc_tests
#   tools/gpu/pack_binaries.sh .device-carry/ipc54 build/bench/kvtransfer/ipc_transfer_bench \
#     build/tests/kvtransfer/pdserve_kvtransfer_cuda_ipc_tests
#   (cd .device-carry && tar -cf - ipc54 | xz -6 -T0 > ipc54.tar.xz && rm -rf ipc54)
# and carry .device-carry/ipc54.tar.xz. Without it steps 1-3 still run.
# Environment: OUT (default gpu-out; logs.tgz has every log), BUILD (default /tmp/ipc54),
# PACK, COPIES, LENGTHS (4096,32768,131072), REPEATS (5), SANITIZE (1).
# Expected time: build ~20 s, tests ~10 s, memcheck ~15 s, bench ~10 s, IPC tests and benches
# ~30 s: under 120 s.
set -uo pipefail
final=${OUT:-gpu-out}
mkdir -p "$final"
final=$(cd "$final" && pwd)
out=$(mktemp -d)
trap 'tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null' EXIT
b=${BUILD:-/tmp/pdserve-ipc54}/ipc54  # a subfolder: run_batch.sh gives every step one BUILD
pack=${PACK:-.device-carry/ipc54.tar.xz}
lengths=${LENGTHS:-4096,32768,131072}
repeats=${REPEATS:-5}
export NCCL_NVLS_ENABLE=0
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 |
  tee "$out/gpu.txt"

start=$SECONDS
built=1
if ! { timeout 30 cmake -S tools/gpu/ipc54 -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
         -DCMAKE_CUDA_COMPILER="$nvcc" &&
       timeout 90 cmake --build "$b" -j"$(nproc)"; } > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED after $((SECONDS - start)) s (steps 2-3 skipped)"
  built=0
else
  echo "build: $((SECONDS - start)) s"
fi

if [ "$built" = 1 ]; then
  start=$SECONDS
  PDSERVE_XXH3_DUMP="$out/xxh3_cases.bin" timeout 30 "$b/ipc54_xxh3_tests" > "$out/tests.log" 2>&1
  echo "xxh3 + page copy GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^reference|^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure|got |seed" "$out/tests.log" | head -20
  if [ -f "$out/xxh3_cases.bin" ]; then
    timeout 20 python3 - "$out/xxh3_cases.bin" > "$out/python_xxhash.log" 2>&1 <<'PY'
import struct, sys
try:
    import xxhash
except ImportError:
    print("python xxhash: not importable, not checked"); sys.exit(0)
data = open(sys.argv[1], "rb").read()
at, n, bad = 0, 0, 0
while at < len(data):
    length, got = struct.unpack_from("<QQ", data, at)
    at += 16
    want = xxhash.xxh3_64_intdigest(data[at:at + length])
    at += length
    n += 1
    if want != got:
        bad += 1
        if bad <= 5:
            print(f"length {length}: GPU {got:016x} python xxhash {want:016x}")
print(f"python xxhash {xxhash.VERSION}: {n - bad}/{n} GPU hashes equal")
sys.exit(1 if bad else 0)
PY
    echo "python xxhash cross-check: rc=$? $(tail -1 "$out/python_xxhash.log")"
    rm -f "$out/xxh3_cases.bin"
  fi
  if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer > /dev/null; then
    start=$SECONDS
    timeout 30 compute-sanitizer --tool memcheck --error-exitcode 9 "$b/ipc54_xxh3_tests" \
      --gtest_filter='CudaXxh3Test.EveryLengthClass' \
      > "$out/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: rc=$? $((SECONDS - start)) s $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/memcheck.log" | tr '\n' ' ')"
  fi
  start=$SECONDS
  timeout 20 "$b/ipc54_xxh3_bench" > "$out/xxh3_bench.csv" 2> "$out/xxh3_bench.err"
  echo "xxh3 bench: rc=$? $((SECONDS - start)) s, $(($(wc -l < "$out/xxh3_bench.csv") - 1)) rows"
  head -5 "$out/xxh3_bench.err"
fi

ipc_runs=()
if [ -f "$pack" ]; then
  mkdir -p "$b/pack" && tar -xJf "$pack" -C "$b/pack"
  # What the pack's env.sh sets, without its search of / for cuBLAS (these binaries link the CUDA
  # runtime statically and need no cuBLAS).
  chmod +x "$b"/pack/ipc54/bin/*
  export PATH=$b/pack/ipc54/bin:$PATH
  export LD_LIBRARY_PATH=$b/pack/ipc54/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  start=$SECONDS
  timeout 20 pdserve_kvtransfer_cuda_ipc_tests > "$out/arena_tests.log" 2>&1
  echo "arena GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+|^\[  SKIPPED \] [0-9]+' "$out/arena_tests.log" | tr '\n' ' ')"
  grep -E "^\[  FAILED|Failure|Expected|Which is|peer:" "$out/arena_tests.log" | head -20
  for copy in ${COPIES:-kernel batch memcpy}; do
    start=$SECONDS
    timeout 20 ipc_transfer_bench --lengths "$lengths" --repeats "$repeats" --copy "$copy" \
      > "$out/ipc_$copy.md" 2> "$out/ipc_$copy.err"
    echo "ipc_transfer_bench --copy $copy: rc=$? $((SECONDS - start)) s"
    tail -3 "$out/ipc_$copy.err"
    ipc_runs+=("$out/ipc_$copy.md")
  done
  start=$SECONDS
  timeout 20 ipc_transfer_bench --lengths "$lengths" --repeats 3 --corrupt 1 \
    > "$out/ipc_corrupt.md" 2> "$out/ipc_corrupt.err"
  echo "ipc_transfer_bench --corrupt 1 (exit 0: every flipped page named): rc=$? $((SECONDS - start)) s"
  tail -3 "$out/ipc_corrupt.err"
else
  echo "no carried pack at $pack: the arena tests and the two-process benchmark did not run"
fi

echo "total: $((SECONDS - t0)) s"
echo
if [ -s "$out/xxh3_bench.csv" ]; then
  echo "XXH3-64 of device pages (bench/cuda/xxh3_bench; L2 flushed, median of 20):"
  python3 - "$out/xxh3_bench.csv" <<'PY'
import csv, sys
print("| set | pages | mean page KiB | MB | xxh3 us | xxh3 GB/s | read floor GB/s | share of floor |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for r in csv.DictReader(open(sys.argv[1])):
    print(f"| {r['set']} | {r['pages']} | {float(r['mean_page_bytes']) / 1024:.0f} | "
          f"{int(r['total_bytes']) / 1e6:.1f} | {r['xxh3_us']} | {r['xxh3_GBps']} | "
          f"{r['floor_GBps']} | {float(r['share_of_floor']) * 100:.0f}% |")
PY
  echo
fi
for f in ${ipc_runs[@]+"${ipc_runs[@]}"} "$out/ipc_corrupt.md"; do
  if [ -s "$f" ]; then cat "$f"; echo; fi
done
