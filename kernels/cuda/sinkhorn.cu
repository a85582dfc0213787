#include <cstdint>

#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/sinkhorn.cuh"
#include "kernels/cuda/sinkhorn_rows.cuh"

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

// The same arithmetic for n in {2, 4, 8}, the matrix in registers (kernels/cuda/
// sinkhorn_rows.cuh, also called by hyper_connection_pre_fused): lane j of a group of N lanes
// holds row j. A row normalization is the lane's own; a column normalization gathers column c's
// entries from the group's lanes in row order (shuffles) so each sum is the same fp32 chain
// 0 + m[0][c] + m[1][c] + ..., and each lane divides its own entries by the column sums: the
// divisions, their operands and their order per element are SinkhornKernel's, so the results
// are bit-identical to it (tested), without its shared-memory round trips and warp barriers in
// each of the 2 x iters normalizations (the engine's 4 x 4 matrices at 20 iterations, under ncu
// on 2026-12-05: SinkhornKernel ~16 us a launch on an H200, this kernel ~9 us on an H100).
template <int N>
__global__ void __launch_bounds__(kThreads)
    SinkhornRegistersKernel(float* m, int64_t count, int64_t iters, float eps) {
  static_assert(32 % N == 0, "a warp holds whole groups");
  constexpr int kGroups = 32 / N;
  const int lane = threadIdx.x % 32;
  const int group = lane / N;
  const int j = lane % N;
  const int first_lane = group * N;
  const int64_t matrix =
      (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kGroups + group;
  const bool active = matrix < count;
  float* global = m + matrix * N * N;
  float row[N];
#pragma unroll
  for (int c = 0; c < N; ++c) row[c] = active ? global[j * N + c] : 0.0f;
  // Every lane of the warp runs it (inactive ones on zeros): the shuffles need them all.
  SinkhornRowsInRegisters<N>(row, first_lane, iters, eps);
  if (active) {
#pragma unroll
    for (int c = 0; c < N; ++c) global[j * N + c] = row[c];
  }
}

// The same arithmetic for n in {2, 4}, one entry per lane (SinkhornVariant::kEntries, kAuto's
// pick for those n):
// a group of n x n lanes holds one matrix, lane r * n + c entry (r, c). Each sum (the softmax's
// fp64 row sum, a row's or a column's fp32 sum) gathers its n entries by shuffles in index
// order, so it is the same chain as the other kernels'; each lane then makes its entry's one
// division. The 2 x iters normalizations are each n shuffles, n adds and one division deep
// instead of n divisions (the row kernel above). On an H100 (bench/cuda/sinkhorn_bench, graph
// timing, 2026-12-05) its first version took 3.9-4.1 us a launch at 1-1024 matrices against the
// row kernel's 7.8-8.2 and the shared-memory kernel's 15.3-16.7, but failed the bit-for-bit
// test on rows of -inf; this version (the softmax's shuffles taken by every lane) passed every
// Sinkhorn GPU test on an H100 (2026-12-06 00:25 UTC, tools/gpu/run_ipc60.sh) and took 3.7-3.9
// us a launch there (6.4 at 8192 matrices, the row kernel 8.4).
template <int N>
__global__ void __launch_bounds__(kThreads)
    SinkhornEntriesKernel(float* m, int64_t count, int64_t iters, float eps) {
  constexpr int kLanes = N * N;
  static_assert(32 % kLanes == 0, "a warp holds whole groups");
  constexpr int kGroups = 32 / kLanes;
  const int lane = threadIdx.x % 32;
  const int group = lane / kLanes;
  const int first_lane = group * kLanes;
  const int r = (lane % kLanes) / N;
  const int c = lane % N;
  const int64_t matrix =
      (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kGroups + group;
  const bool active = matrix < count;
  float* global = m + matrix * kLanes;
  float v = active ? global[r * N + c] : 0.0f;
  // Entry (row, k) of this lane's matrix, from its lane.
  auto at = [&](float x, int row, int k) {
    return __shfl_sync(0xffffffffu, x, first_lane + row * N + k);
  };
  float max_value = -INFINITY;
#pragma unroll
  for (int k = 0; k < N; ++k) max_value = fmaxf(max_value, at(v, r, k));
  // Every lane of the warp takes the same path through the shuffles (a row of -inf only
  // selects 0 at the end): a shuffle with a full mask inside a branch some lanes skip is
  // undefined (the first version of this kernel did that and failed the bit-for-bit test on
  // such rows on an H100). __fmul_rn / __fadd_rn: the product and the sum rounded apart, as the
  // other kernels' separate statements are, never contracted into one fma.
  const bool all_minus_inf = max_value == -INFINITY;
  const float e = all_minus_inf ? 0.0f : expf(v - max_value);
  double sum = 0.0;
#pragma unroll
  for (int k = 0; k < N; ++k) sum += at(e, r, k);
  const float inv = static_cast<float>(1.0 / sum);
  v = all_minus_inf ? 0.0f : __fmul_rn(e, inv);
  v = __fadd_rn(v, eps);
  for (int64_t it = 0; it < (iters > 1 ? iters : 1); ++it) {
    if (it > 0) {
      float sum = 0.0f;
#pragma unroll
      for (int k = 0; k < N; ++k) sum += at(v, r, k);
      v /= (sum + eps);
    }
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < N; ++k) sum += at(v, k, c);
    v /= (sum + eps);
  }
  if (active) global[r * N + c] = v;
}

}  // namespace

cudaError_t sinkhorn_project(float* m, int64_t count, int64_t n, int64_t iters, float eps,
                             cudaStream_t stream, SinkhornVariant variant) {
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", count >= 0);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", n >= 1);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", n <= kMaxSinkhornN);
  if (count == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", m != nullptr);
  const bool entries =
      (variant == SinkhornVariant::kEntries || variant == SinkhornVariant::kAuto) &&
      (n == 2 || n == 4);
  const bool rows =
      !entries && variant != SinkhornVariant::kSharedMemory && (n == 2 || n == 4 || n == 8);
  const int64_t per_block = kWarps * (32 / (entries ? n * n : n));
  const int64_t blocks = (count + per_block - 1) / per_block;
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", blocks <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE("sinkhorn_project", count <= (int64_t{1} << 62) / (n * n));
  const auto grid = static_cast<unsigned>(blocks);
  if (entries && n == 4) {
    SinkhornEntriesKernel<4><<<grid, kThreads, 0, stream>>>(m, count, iters, eps);
  } else if (entries) {
    SinkhornEntriesKernel<2><<<grid, kThreads, 0, stream>>>(m, count, iters, eps);
  } else if (rows && n == 4) {
    SinkhornRegistersKernel<4><<<grid, kThreads, 0, stream>>>(m, count, iters, eps);
  } else if (rows && n == 2) {
    SinkhornRegistersKernel<2><<<grid, kThreads, 0, stream>>>(m, count, iters, eps);
  } else if (rows) {
    SinkhornRegistersKernel<8><<<grid, kThreads, 0, stream>>>(m, count, iters, eps);
  } else {
    SinkhornKernel<<<grid, kThreads, 0, stream>>>(m, count, static_cast<int>(n), iters, eps);
  }
  return cudaGetLastError();
}

}  // namespace pdserve::kernels::cuda
