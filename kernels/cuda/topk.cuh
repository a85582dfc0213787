// Deterministic top-k over rows of float32 scores on the GPU, one thread block per row.
//
// Same result as kernels/cpu/topk.h, element for element: descending score, ties broken by
// ascending index, exactly min(length, k) valid indices followed by -1. +0.0 and -0.0 are equal
// (as the CPU comparison treats them); +-inf order as usual; NaN must not occur (the callers'
// scores are finite sums or +-inf). Why the tie rule matters: docs/engine-reference.md.
//
// Method: one 1024-thread block per row. Rows of at most max(k, 1024) entries are sorted whole.
// Longer rows: a radix select on order-preserving 32-bit keys whose digits adapt to the data.
// The first round counts the top 12 bits of every key while the row is read from global memory
// (once: rows up to 40960 entries stay in shared memory as keys); each further round counts the
// keys of the kept bin in 4096 bins of the remaining width. As soon as the entries at or above
// the bin holding the k-th best fit in a 4096-entry buffer (typically after the first round),
// they are gathered and sorted (bitonic, on (key, index) pairs, so ties order by index) and the
// first k are written. When the k-th best key itself has more ties than fit (after at most three
// rounds), the entries above it and its lowest-index ties, ranked in index order, are.
// Passes over the row: 2 typically, at most 4 (rows past 40960 entries re-read global memory,
// L2 as a rule, in each).
//
// CUDA-graph safe: the launch shape depends only on (rows, stride, k); per-row lengths are read
// from device memory when the kernel runs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxTopK = 2048;

// scores: [rows, stride] fp32 (row r reads scores[r * stride + 0 .. lengths[r])); lengths: [rows]
// int32 in device memory, clamped to [0, stride]; out: [rows, k] int32. 1 <= k <= kMaxTopK,
// stride < 2^31 - 16384. Returns cudaErrorInvalidValue on bad arguments, else the launch status.
// Asynchronous on `stream`; no state besides a one-time kernel attribute (make the first call
// outside graph capture), so concurrent calls on different outputs are safe.
cudaError_t top_k(const float* scores, int64_t rows, int64_t stride, const int32_t* lengths,
                  int64_t k, int32_t* out, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
