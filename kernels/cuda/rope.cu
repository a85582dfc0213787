#include <cstdint>

#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/rope.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One block per row: the row's cos / sin are computed once into shared memory, then every
// (head, pair) of the row is rotated.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RopeKernel(T* x, int64_t row_stride, int heads, int head_dim, int rope_dim,
               const int32_t* positions, const float* inv_freq, float attention_scaling,
               float sign) {
  __shared__ float cos_s[kMaxRopeDim / 2];
  __shared__ float sin_s[kMaxRopeDim / 2];
  const int half = rope_dim / 2;
  const int64_t row = blockIdx.x;
  const float position = static_cast<float>(positions[row]);
  for (int i = threadIdx.x; i < half; i += kThreads) {
    // fp32 angle, fp64 cos / sin rounded to fp32, as the CPU rope table computes them.
    const float angle = inv_freq[i] * position;
    double s = 0.0;
    double c = 0.0;
    sincos(static_cast<double>(angle), &s, &c);
    cos_s[i] = static_cast<float>(c) * attention_scaling;
    sin_s[i] = sign * (static_cast<float>(s) * attention_scaling);
  }
  __syncthreads();
  T* base = x + row * row_stride + (head_dim - rope_dim);
  for (int p = threadIdx.x; p < heads * half; p += kThreads) {
    const int head = p / half;
    const int i = p % half;
    T* v = base + static_cast<int64_t>(head) * head_dim + 2 * i;
    const float a = ToFloat(v[0]);
    const float b = ToFloat(v[1]);
    // Unfused products and sums, as the CPU reference rounds them.
    v[0] = FromFloat<T>(__fsub_rn(__fmul_rn(a, cos_s[i]), __fmul_rn(b, sin_s[i])));
    v[1] = FromFloat<T>(__fadd_rn(__fmul_rn(b, cos_s[i]), __fmul_rn(a, sin_s[i])));
  }
}

template <typename T>
cudaError_t Rope(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                 int64_t rope_dim, const int32_t* positions, const float* inv_freq,
                 float attention_scaling, bool inverse, cudaStream_t stream) {
  constexpr const char* kLauncher = "apply_interleaved_rope";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, heads >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_dim >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rope_dim >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rope_dim % 2 == 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rope_dim <= head_dim);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rope_dim <= kMaxRopeDim);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_dim <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, head_dim == 0 || heads <= INT32_MAX / head_dim);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, row_stride >= heads * head_dim);
  if (rows == 0 || heads == 0 || rope_dim == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, x != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, positions != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, inv_freq != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= INT32_MAX);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= (int64_t{1} << 62) / row_stride);
  RopeKernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
      x, row_stride, static_cast<int>(heads), static_cast<int>(head_dim),
      static_cast<int>(rope_dim), positions, inv_freq, attention_scaling, inverse ? -1.0f : 1.0f);
  return cudaGetLastError();
}

}  // namespace

cudaError_t apply_interleaved_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads,
                                   int64_t head_dim, int64_t rope_dim, const int32_t* positions,
                                   const float* inv_freq, float attention_scaling, bool inverse,
                                   cudaStream_t stream) {
  return Rope(x, rows, row_stride, heads, head_dim, rope_dim, positions, inv_freq,
              attention_scaling, inverse, stream);
}

cudaError_t apply_interleaved_rope(__nv_bfloat16* x, int64_t rows, int64_t row_stride,
                                   int64_t heads, int64_t head_dim, int64_t rope_dim,
                                   const int32_t* positions, const float* inv_freq,
                                   float attention_scaling, bool inverse, cudaStream_t stream) {
  return Rope(x, rows, row_stride, heads, head_dim, rope_dim, positions, inv_freq,
              attention_scaling, inverse, stream);
}

}  // namespace pdserve::kernels::cuda
