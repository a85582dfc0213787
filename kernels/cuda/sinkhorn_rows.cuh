// The Sinkhorn-Knopp projection of one n x n matrix held by a group of n lanes of a warp, lane j
// of the group holding row j in registers (kernels/cuda/sinkhorn.cuh has the math and its
// sources). Shared by sinkhorn_project's row kernel and hyper_connection_pre_fused, so both make
// the same operations in the same order per entry.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

// Projects the matrix whose row j is `row` in lane first_lane + j (j < N) of this warp, in place.
// Every lane of the warp must call it (the column sums are full-mask shuffles); lanes outside a
// real group pass any finite values (zeros) and ignore what they get back. Column c's sum is the
// fp32 chain 0 + m[0][c] + m[1][c] + ... in row order; the row softmax sums in fp64.
template <int N>
__device__ __forceinline__ void SinkhornRowsInRegisters(float (&row)[N], int first_lane,
                                                        int64_t iters, float eps) {
  float max_value = -INFINITY;
#pragma unroll
  for (int c = 0; c < N; ++c) max_value = fmaxf(max_value, row[c]);
  if (max_value == -INFINITY) {
#pragma unroll
    for (int c = 0; c < N; ++c) row[c] = 0.0f;
  } else {
    double sum = 0.0;
#pragma unroll
    for (int c = 0; c < N; ++c) {
      row[c] = expf(row[c] - max_value);
      sum += row[c];
    }
    const float inv = static_cast<float>(1.0 / sum);
#pragma unroll
    for (int c = 0; c < N; ++c) row[c] *= inv;
  }
#pragma unroll
  for (int c = 0; c < N; ++c) row[c] += eps;
  for (int64_t it = 0; it < (iters > 1 ? iters : 1); ++it) {
    if (it > 0) {
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < N; ++c) sum += row[c];
#pragma unroll
      for (int c = 0; c < N; ++c) row[c] /= (sum + eps);
    }
    float column_sum[N];
#pragma unroll
    for (int c = 0; c < N; ++c) {
      column_sum[c] = 0.0f;
#pragma unroll
      for (int r = 0; r < N; ++r) column_sum[c] += __shfl_sync(0xffffffffu, row[c], first_lane + r);
    }
#pragma unroll
    for (int c = 0; c < N; ++c) row[c] /= (column_sum[c] + eps);
  }
}

}  // namespace pdserve::kernels::cuda
