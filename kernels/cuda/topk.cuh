// Deterministic top-k over rows of float32 scores on the GPU, one thread block per row.
//
// Same result as kernels/cpu/topk.h, element for element: descending score, ties broken by
// ascending index, exactly min(length, k) valid indices followed by -1. +0.0 and -0.0 are equal
// (as the CPU comparison treats them); +-inf order as usual; NaN must not occur (the callers'
// scores are finite sums or +-inf). Why the tie rule matters: docs/engine-reference.md.
//
// Method: a 4-pass radix select on order-preserving 32-bit keys finds the k-th best score v and
// how many entries equal to v are still needed; one ordered pass keeps every score above v and
// the lowest-index ties at v; a bitonic sort of the at most k survivors orders them.
//
// CUDA-graph safe: the launch shape depends only on (rows, k); per-row lengths are read from
// device memory when the kernel runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxTopK = 2048;

// scores: [rows, stride] fp32 (row r reads scores[r * stride + 0 .. lengths[r])); lengths: [rows]
// int32 in device memory, clamped to [0, stride]; out: [rows, k] int32. 1 <= k <= kMaxTopK.
// Returns cudaErrorInvalidValue on bad arguments, else the launch status. Asynchronous on `stream`;
// no state, so concurrent calls on different outputs are safe.
cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
