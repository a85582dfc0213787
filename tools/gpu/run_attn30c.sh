#!/usr/bin/env bash
# One device-machine call for the sparse decode attention's cluster merge (issue 30:
# SparseDecodeVariant::kClusterMerge, the splits of a request as one thread-block cluster merging
# through distributed shared memory, against kDependentLaunch, the default, and kSplitCombine),
# from the repository root on a Hopper GPU with CUDA 13: builds kernels/cuda standalone
# (`cmake -S kernels/cuda`: only the GPU tests and pdserve_cuda_bench), runs the sparse decode
# attention GPU tests (every case with every variant; the cluster's own tests: bits equal to
# kDependentLaunch in clusters of 2-8, graph capture and replay), then pdserve_cuda_bench in graph
# timing with only the attention rows (PDSERVE_BENCH_ONLY=attention: batch 1, 32, 128 x 4K, 32K,
# 128K) and prints, last, kernel / batch / context / read floor / kDependentLaunch / kClusterMerge
# (with and without the queries' multicast) / kDependentLaunch without query clusters /
# kSplitCombine, each in us and x floor (kDependentLaunch: query clusters of 2, the default).
# Environment: OUT (logs, default ./gpu-out), BUILD (build dir), SWEEP=1 (every split size of
# kDependentLaunch, kSplitCombine and kClusterMerge too: rows "<kernel>@<per>", "_split@<per>",
# "_cluster@<per>"; ~15 s more), SANITIZE=1 (compute-sanitizer memcheck on the two graph
# replay tests, kDependentLaunch in query clusters and kClusterMerge, ~20 s more).
# Expected time: build ~25 s on 16 cores, tests ~20 s (and the wgmma GEMM tests, which share the
# tensor-map lookup), bench ~15 s (SWEEP: ~30 s).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=${BUILD:-/tmp/attn30c-build-cuda}
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
start=$SECONDS
if ! timeout 100 bash -c "cmake -S kernels/cuda -B '$b' -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_COMPILER='$nvcc' && cmake --build '$b' -j\$(nproc) \
       --target pdserve_kernels_cuda_tests pdserve_cuda_bench" > "$out/build.log" 2>&1; then
  grep -m30 -E "error|Error" "$out/build.log"
  echo "BUILD FAILED ($((SECONDS - start)) s)"
  exit 1
fi
echo "build: $((SECONDS - start)) s"
tests="$b/tests/pdserve_kernels_cuda_tests"
# The cluster's own tests first, briefly: a cluster that never finishes stops the script here.
start=$SECONDS
timeout 20 "$tests" --gtest_filter='CudaSparseDecodeTest.Cluster*' > "$out/tests-cluster.log" 2>&1
rc=$?
echo "cluster GPU tests (kClusterMerge, query_cluster): rc=$rc $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests-cluster.log" | tr '\n' ' ')"
if [ $rc = 124 ] || [ $rc -ge 128 ]; then
  tail -20 "$out/tests-cluster.log"
  echo "a cluster launch hung or crashed: nothing else run"
  exit 1
fi
start=$SECONDS
timeout 60 "$tests" --gtest_filter='CudaSparseDecode*' > "$out/tests.log" 2>&1
echo "sparse decode attention GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED|^\[       OK|Failure|Expected|Which is|Value of|outputs differ|request" "$out/tests.log" | head -40
# The TMA GEMMs share the tensor-map encoder lookup (kernels/cuda/tensor_map.cuh) since this change.
start=$SECONDS
timeout 40 "$tests" --gtest_filter='CudaFp8GemmTest.Wgmma*:CudaW8a16GemmTest.Wgmma*' > "$out/tests-gemm.log" 2>&1
echo "wgmma GEMM GPU tests: rc=$? $((SECONDS - start)) s $(grep -E '^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/tests-gemm.log" | tr '\n' ' ')"
if [ "${SANITIZE:-0}" = 1 ]; then
  timeout 40 compute-sanitizer --tool memcheck --error-exitcode 9 "$tests" \
    --gtest_filter='CudaSparseDecodeTest.*GraphReplays' > "$out/sanitize-memcheck.log" 2>&1
  echo "compute-sanitizer memcheck: rc=$? $(grep -E 'ERROR SUMMARY|^\[  PASSED|^\[  FAILED  \] [0-9]+' "$out/sanitize-memcheck.log" | tr '\n' ' ')"
fi
start=$SECONDS
PDSERVE_BENCH_TIMING=graph PDSERVE_BENCH_ONLY=attention PDSERVE_BENCH_SPLITS=${SWEEP:-0} \
  timeout 90 "$b/bench/pdserve_cuda_bench" > "$out/bench.csv" 2> "$out/bench.err"
echo "pdserve_cuda_bench (graph timing, attention only): rc=$? $((SECONDS - start)) s; rows: $out/bench.csv"
grep -E "clusters of" "$out/bench.err" | tr "\n" ";"; echo
tail -3 "$out/bench.err"
python3 - "$out/bench.csv" "$out/bench.err" <<'PY' | tee "$out/table.md"
import re, sys
rows = {}
fit_per = {}
for line in open(sys.argv[2]):
    m = re.match(r"(\w+)_cluster,(\d+),(\d+): (\d+) entries per split", line)
    if m:
        fit_per[(m.group(1), int(m.group(2)), int(m.group(3)) // 1024)] = int(m.group(4))
for line in open(sys.argv[1]):
    f = line.strip().split(",")
    if len(f) != 7 or f[0] == "copy":
        continue
    rows[(f[0], int(f[1]), int(f[2]) // 1024)] = float(f[4])
sweep = {}
for (name, batch, ctx), us in rows.items():
    if "@" in name:
        kernel, per = name.split("@")
        best = sweep.get((kernel, batch, ctx))
        if best is None or us < best[1]:
            sweep[(kernel, batch, ctx)] = (int(per), us)
def cell(us, floor):
    return "-" if us is None else f"{us:.1f} ({us / floor:.2f}x)"
print("| kernel | batch | context | read floor us | kDependentLaunch us (x floor) | "
      "kClusterMerge (its split size) | kClusterMerge, no multicast | "
      "kDependentLaunch, query_cluster 2 | query clusters - none us | "
      "kSplitCombine | cluster - dependent us | "
      "goal (cluster) | best swept split per: us (dependent / cluster) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for kernel in ("csa_attention", "hca_attention"):
    for batch in (1, 32, 128):
        for ctx in (4, 32, 128):
            dep = rows.get((kernel, batch, ctx))
            floor = rows.get((kernel + "_read", batch, ctx))
            if dep is None or floor is None:
                continue
            clu = rows.get((kernel + "_cluster", batch, ctx))
            nomc = rows.get((kernel + "_cluster_nomc", batch, ctx))
            old = rows.get((kernel + "_split", batch, ctx))
            qc2 = rows.get((kernel + "_qc2", batch, ctx))
            limit = 2.0 if ctx == 4 else 1.3
            goal = "-" if batch == 1 or clu is None else (
                f"<= {limit:g}x " + ("met" if clu / floor <= limit else "not met"))
            diff = "-" if clu is None else f"{clu - dep:+.1f}"
            best = [sweep.get((k, batch, ctx)) for k in (kernel, kernel + "_cluster")]
            best_s = " / ".join("-" if x is None else f"{x[0]}: {x[1]:.1f}" for x in best)
            per = fit_per.get((kernel, batch, ctx), "?")
            print(f"| {kernel} | {batch} | {ctx}K | {floor:.1f} | {cell(dep, floor)} | "
                  f"{cell(clu, floor)} ({per}) | {cell(nomc, floor)} | {cell(qc2, floor)} | "
                  f"{'-' if qc2 is None else f'{qc2 - dep:+.1f}'} | "
                  f"{cell(old, floor)} | "
                  f"{diff} | {goal} | {best_s} |")
PY
