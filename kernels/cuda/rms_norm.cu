#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/rms_norm.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Rows of at most this many vectors go to one warp each; longer rows to a whole block.
constexpr int64_t kMaxWarpRowVectors = 128;

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int ROW_THREADS>
__device__ __forceinline__ double RowSum(double v, double* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  if constexpr (ROW_THREADS > 32) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) scratch[warp] = v;
    __syncthreads();
    v = 0.0;
    for (int w = 0; w < ROW_THREADS / 32; ++w) v += scratch[w];
  }
  return v;
}

// One row per ROW_THREADS threads (a warp or the whole block); VEC elements per access (16 bytes
// when the row is aligned for it, else 1).
template <typename T, int VEC, int ROW_THREADS>
__global__ void __launch_bounds__(kThreads)
    RmsNormKernel(const T* x, const T* weight, int64_t rows, int64_t dim, int64_t stride, float eps,
                  T* y) {
  __shared__ double scratch[kThreads / 32];
  constexpr int kRowsPerBlock = kThreads / ROW_THREADS;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / ROW_THREADS;
  // Uniform per warp (warp rows) or per block (block rows), so no barrier or shuffle is skipped.
  if (row >= rows) return;
  const int lane = threadIdx.x % ROW_THREADS;
  const auto* xr = reinterpret_cast<const Vec<T, VEC>*>(x + row * stride);
  auto* yr = reinterpret_cast<Vec<T, VEC>*>(y + row * stride);
  const auto* wr = reinterpret_cast<const Vec<T, VEC>*>(weight);
  const int64_t vectors = dim / VEC;

  double sum_sq = 0.0;
  for (int64_t i = lane; i < vectors; i += ROW_THREADS) {
    const Vec<T, VEC> v = xr[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const double f = ToFloat(v.v[j]);
      sum_sq += f * f;
    }
  }
  sum_sq = RowSum<ROW_THREADS>(sum_sq, scratch);
  const float inv = 1.0f / sqrtf(static_cast<float>(sum_sq / static_cast<double>(dim)) + eps);

  for (int64_t i = lane; i < vectors; i += ROW_THREADS) {
    const Vec<T, VEC> v = xr[i];
    Vec<T, VEC> w;
    if (wr != nullptr) w = wr[i];
    Vec<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float normed = ToFloat(v.v[j]) * inv;
      out.v[j] = FromFloat<T>(wr != nullptr ? ToFloat(w.v[j]) * normed : normed);
    }
    yr[i] = out;
  }
}

template <typename T, int VEC>
cudaError_t Launch(const T* x, const T* weight, int64_t rows, int64_t dim, int64_t stride,
                   float eps, T* y, cudaStream_t stream) {
  if (dim / VEC <= kMaxWarpRowVectors) {
    constexpr int kRowsPerBlock = kThreads / 32;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    PDSERVE_LAUNCH_REQUIRE("rms_norm", blocks <= INT32_MAX);
    RmsNormKernel<T, VEC, 32><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        x, weight, rows, dim, stride, eps, y);
  } else {
    PDSERVE_LAUNCH_REQUIRE("rms_norm", rows <= INT32_MAX);
    RmsNormKernel<T, VEC, kThreads><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        x, weight, rows, dim, stride, eps, y);
  }
  return cudaGetLastError();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t RmsNorm(const T* x, const T* weight, int64_t rows, int64_t dim, int64_t stride,
                    float eps, T* y, cudaStream_t stream) {
  PDSERVE_LAUNCH_REQUIRE("rms_norm", rows >= 0);
  PDSERVE_LAUNCH_REQUIRE("rms_norm", dim >= 0);
  PDSERVE_LAUNCH_REQUIRE("rms_norm", stride >= dim);
  if (rows == 0 || dim == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE("rms_norm", x != nullptr);
  PDSERVE_LAUNCH_REQUIRE("rms_norm", y != nullptr);
  PDSERVE_LAUNCH_REQUIRE("rms_norm", rows <= (int64_t{1} << 62) / stride);
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vectorized = dim % kVec == 0 && stride % kVec == 0 && Aligned16(x) && Aligned16(y) &&
                          (weight == nullptr || Aligned16(weight));
  return vectorized ? Launch<T, kVec>(x, weight, rows, dim, stride, eps, y, stream)
                    : Launch<T, 1>(x, weight, rows, dim, stride, eps, y, stream);
}

}  // namespace

cudaError_t rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t stride,
                     float eps, float* y, cudaStream_t stream) {
  return RmsNorm(x, weight, rows, dim, stride, eps, y, stream);
}

cudaError_t rms_norm(const __nv_bfloat16* x, const __nv_bfloat16* weight, int64_t rows, int64_t dim,
                     int64_t stride, float eps, __nv_bfloat16* y, cudaStream_t stream) {
  return RmsNorm(x, weight, rows, dim, stride, eps, y, stream);
}

}  // namespace pdserve::kernels::cuda
