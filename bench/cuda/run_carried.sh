#!/usr/bin/env bash
# One device-machine call over binaries built here and carried (tools/gpu: `run` with carry
# .device-carry): the kernel GPU tests, then the benchmark of each carried bench binary
# (.device-carry/k/*_bench, e.g. the previous kernels and the current ones) in one run, so the
# versions are timed side by side on the same GPU. Logs under $OUT; a table is printed last.
# Environment: K (carried folder, default .device-carry/k), TFILTER (--gtest_filter of the tests),
# SANITIZE (a --gtest_filter to run under compute-sanitizer memcheck and racecheck first), NCU
# ("NAME BATCH CONTEXT KERNEL_REGEX": Nsight Compute on the first matching launch of NAME_bench at
# that size; the details go to $OUT/ncu.txt).
set -uo pipefail
out=${OUT:-out}
k=${K:-.device-carry/k}
mkdir -p "$out"
chmod +x "$k"/* 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
if [ -n "${SANITIZE:-}" ]; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$k/pdserve_kernels_cuda_tests" \
      --gtest_filter="$SANITIZE" > "$out/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY' "$out/sanitize-$tool.log" | tail -1)"
  done
fi
if [ -x "$k/pdserve_kernels_cuda_tests" ]; then
  timeout 300 "$k/pdserve_kernels_cuda_tests" ${TFILTER:+--gtest_filter="$TFILTER"} > "$out/tests.log" 2>&1
  echo "tests: rc=$?"
  grep -E "^\[  FAILED|Failure|Expected|Which is|seed|^\[  PASSED" "$out/tests.log" | head -40
fi
work=$(mktemp -d)
for bench in "$k"/*_bench; do
  name=$(basename "$bench" _bench)
  timeout 200 "$bench" > "$work/bench-$name.csv" 2> "$work/bench-$name.err" || echo "$name: rc=$?"
  head -3 "$work/bench-$name.err"
done
tail -n +1 "$work"/bench-*.csv > "$out/bench.txt"
if [ -n "${NCU:-}" ]; then
  read -r name batch context kernel <<< "$NCU"
  timeout 240 ncu --clock-control none -k "regex:$kernel" -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section LaunchStats --section Occupancy --section SourceCounters \
    --import-source yes -o "$work/ncu" "$k/${name}_bench" "$batch" "$context" > "$out/ncu-run.txt" 2>&1
  echo "ncu: rc=$?"
  ncu -i "$work/ncu.ncu-rep" --print-details all > "$out/ncu.txt" 2>&1
  ncu -i "$work/ncu.ncu-rep" --page source --csv --print-source sass > "$out/ncu-source.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Stall|Issued Warp|No Eligible|Active Warps|Warp Cycles Per Issued" "$out/ncu.txt" | head -30
fi
python3 - "$work" <<'EOF'
import csv, glob, os, sys
out = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "bench-*.csv"))):
    name = os.path.basename(path)[6:-4]
    runs[name] = {tuple(r[:4]): r for r in csv.reader(open(path)) if r}
names = list(runs)
copy = next((r for run in runs.values() for key, r in run.items() if key[0] == "copy"), None)
copy_gbs = float(copy[5]) / float(copy[4]) / 1e3 if copy else float("nan")
print(f"copy roofline {copy_gbs:.0f} GB/s (read + write)")
print("| kernel | batch | context | " + " | ".join(f"{n} us (% BW)" for n in names) + " |")
keys = [key for key in next(iter(runs.values())) if key[0] != "copy"] if runs else []
for key in keys:
    cells = []
    for n in names:
        r = runs[n].get(key)
        if r is None:
            cells.append("-")
            continue
        us = float(r[4])
        gbs = float(r[5]) / us / 1e3
        cells.append(f"{us:.1f} ({100 * gbs / copy_gbs:.0f}%)")
    print(f"| {key[0]} | {key[1]} | {int(key[2]) // 1024}K | " + " | ".join(cells) + " |")
EOF
