#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sinkhorn.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// A group of n lanes of one warp owns one matrix, held in shared memory: lane j of the group
// normalizes row j, then column j. A warp holds 32 / n groups; lanes past the last group, and
// groups past `count`, only join the warp barriers.
__global__ void __launch_bounds__(kThreads)
    SinkhornKernel(float* m, int64_t count, int n, int64_t iters, float eps) {
  __shared__ float tiles[kWarps][32 * kMaxSinkhornN];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int groups = 32 / n;
  const int group = lane / n;
  const int j = lane % n;
  const int64_t matrix = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * groups + group;
  const bool active = group < groups && matrix < count;
  float* tile = tiles[warp] + group * n * n;
  float* global = m + matrix * n * n;
  float* row = tile + j * n;

  if (active) {
    for (int c = 0; c < n; ++c) row[c] = global[j * n + c];
    float max_value = -INFINITY;
    for (int c = 0; c < n; ++c) max_value = fmaxf(max_value, row[c]);
    if (max_value == -INFINITY) {
      for (int c = 0; c < n; ++c) row[c] = 0.0f;
    } else {
      double sum = 0.0;
      for (int c = 0; c < n; ++c) {
        row[c] = expf(row[c] - max_value);
        sum += row[c];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int c = 0; c < n; ++c) row[c] *= inv;
    }
    for (int c = 0; c < n; ++c) row[c] += eps;
  }
  for (int64_t it = 0; it < (iters > 1 ? iters : 1); ++it) {
    if (it > 0 && active) {
      float sum = 0.0f;
      for (int c = 0; c < n; ++c) sum += row[c];
      for (int c = 0; c < n; ++c) row[c] /= (sum + eps);
    }
    __syncwarp();
    if (active) {
      float sum = 0.0f;
      for (int r = 0; r < n; ++r) sum += tile[r * n + j];
      for (int r = 0; r < n; ++r) tile[r * n + j] /= (sum + eps);
    }
    __syncwarp();
  }
  if (active) {
    for (int c = 0; c < n; ++c) global[j * n + c] = row[c];
  }
}

}  // namespace

cudaError_t sinkhorn_project(float* m, int64_t count, int64_t n, int64_t iters, float eps,
                             cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", count >= 0);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", n >= 1);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", n <= kMaxSinkhornN);
  if (count == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", m != nullptr);
  const int64_t per_block = kWarps * (32 / n);
  const int64_t blocks = (count + per_block - 1) / per_block;
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", blocks <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", count <= (int64_t{1} << 62) / (n * n));
  SinkhornKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      m, count, static_cast<int>(n), iters, eps);
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
