#!/usr/bin/env bash
# One device-machine call: standalone Release build of kernels/cuda (+ bench), the benchmark's
# CSV (every size; indexer split into its score and top-k stages), then Nsight Compute on one
# large case (batch B, context C; default 128 x 128K) for the indexer and attention kernels.
# Logs under $OUT (default ./out); a short summary is printed last.
# Usage: bash bench/cuda/profile_h200.sh [B C]
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
batch=${1:-128}
context=${2:-131072}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt"
b=/tmp/pdserve-build-cuda
if ! { cmake -S kernels/cuda -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release &&
       cmake --build "$b" -j"$(nproc)" --target pdserve_cuda_bench; } >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
timeout 120 "$b/bench/pdserve_cuda_bench" > "$out/bench.csv" 2> "$out/bench.err"
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu_bin" ]; then
  sections="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active"
  # Launch order per case: indexer (scores, top_k) x 23, scores x 23, top_k x 23, CSA x 23, HCA x 23.
  prof() {  # name regex skip count
    timeout 150 "$ncu_bin" --clock-control none -k regex:"$2" --launch-skip "$3" --launch-count "$4" \
      $sections "$b/bench/pdserve_cuda_bench" "$batch" "$context" > "$out/ncu_$1.txt" 2>&1
    echo "== $1"
    grep -E "^  [A-Za-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy|L1/TEX Hit|Dynamic Shared Memory Per Block|One or More Eligible|Issued Warp Per Scheduler" "$out/ncu_$1.txt" | head -40
    grep -E "stalled_.*ratio|pipe_tensor" "$out/ncu_$1.txt" | awk '$NF+0 >= 0.05' | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
  }
  prof indexer 'IndexerScoresKernel|TopKKernel' 2 2
  prof attention SparseDecodeSplitKernel 3 1
  prof hca SparseDecodeSplitKernel 26 1
fi
awk -F, 'NR==1{copy=$6/($5*1e-6)} $1!="copy"{gbs=$6/($5*1e-6); printf "%-15s b%-4s ctx%-7s %9.1f us %6.0f GB/s %4.0f%%\n",$1,$2,$3,$5,gbs/1e9,100*gbs/copy}' "$out/bench.csv"
