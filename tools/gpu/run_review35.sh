#!/usr/bin/env bash
# One device-machine call for review35's GPU change (kernels/cuda/topk.cu: the select top-k's
# row barrier after every block reads block 0's gathered count, on the sampled path too), from
# the repository root on a Hopper GPU: tools/gpu/run_topk30.sh without Nsight Compute and without
# the blocks-per-row sweep. Checks: the indexer and top-k GPU tests pass with both top-k kernels,
# and the table printed last gives top_k_select's time against its "before" column (the
# 2026-12-04 rounds; the extra barrier costs one cluster barrier on rows the sample covers).
# Environment: OUT (default ./gpu-out), BUILD (default /tmp/topk30), SANITIZE=1 (memcheck and
# racecheck on two top-k tests: up to 90 s more). Expected: ~80 s (build 30, tests 30, bench 20).
set -uo pipefail
NCU=0 SANITIZE=${SANITIZE:-0} TOPK_SWEEP=${TOPK_SWEEP:-0} exec bash tools/gpu/run_topk30.sh
