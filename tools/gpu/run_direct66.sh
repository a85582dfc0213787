#!/usr/bin/env bash
# A one-token batch's routed experts without the grouping kernel (MoeMmaGrouping::kAuto,
# kernels/cuda/moe_gemm.cuh, issue 25): tools/gpu/run_decode_ab.sh with this build (direct66),
# this build with PDSERVE_MOE_DIRECT=group (the grouping kernel as before) as its variant, and
# main f48915d's kernels with this change's decode_bench as the build before (base66). The
# 2026-12-06 09:00 UTC call ran this script's first form (the same steps, its own copy of them).
# Here:
#   cmake --build build --target pdserve_decode_bench pdserve_kernels_cuda_tests engine_gpu_tests
#   tools/gpu/run_direct66.sh pack
# There (carry .device-carry/direct66.tar.xz and base66.tar.xz): OUT=<dir> [ENGINE=1]
#   bash tools/gpu/run_direct66.sh
NAME=direct66 BASE=base66 VARIANT_ENV=PDSERVE_MOE_DIRECT=group \
  exec "$(dirname "$0")/run_decode_ab.sh" "$@"
