#include <cstdint>

#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/device_utils.cuh"
#include "kernels/cuda/launch_check.h"
#include "kernels/cuda/swiglu_math.cuh"

namespace pdserve::kernels::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks to fill an H200 several times over; larger tensors loop (grid stride).
constexpr int64_t kMaxBlocks = 132 * 16;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    ClampedSwiGluKernel(const T* gate, const T* up, int64_t rows, int64_t cols, int64_t in_stride,
                        float limit, T* out, int64_t out_stride) {
  const int64_t total = rows * cols;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = e / cols;
    const int64_t c = e % cols;
    const float g_in = ToFloat(gate[r * in_stride + c]);
    const float u_in = ToFloat(up[r * in_stride + c]);
    out[r * out_stride + c] = FromFloat<T>(ClampedSwiGluValue(g_in, u_in, limit));
  }
}

template <typename T>
cudaError_t ClampedSwiGlu(const T* gate, const T* up, int64_t rows, int64_t cols, int64_t in_stride,
                          float limit, T* out, int64_t out_stride, cudaStream_t stream) {
  constexpr const char* kLauncher = "clamped_swiglu";
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, cols >= 0);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, in_stride >= cols);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out_stride >= cols);
  if (rows == 0 || cols == 0) return cudaSuccess;
  PDSERVE_LAUNCH_REQUIRE(kLauncher, gate != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, up != nullptr);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, out != nullptr);
  const int64_t limit_rows = (int64_t{1} << 62) / (in_stride > out_stride ? in_stride : out_stride);
  PDSERVE_LAUNCH_REQUIRE(kLauncher, rows <= limit_rows);
  const int64_t wanted = (rows * cols + kThreads - 1) / kThreads;
  const int64_t blocks = wanted < kMaxBlocks ? wanted : kMaxBlocks;
  ClampedSwiGluKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      gate, up, rows, cols, in_stride, limit, out, out_stride);
  return cudaGetLastError();
}

}  // namespace

cudaError_t clamped_swiglu(const float* gate, const float* up, int64_t rows, int64_t cols,
                           int64_t in_stride, float limit, float* out, int64_t out_stride,
                           cudaStream_t stream) {
  return ClampedSwiGlu(gate, up, rows, cols, in_stride, limit, out, out_stride, stream);
}

cudaError_t clamped_swiglu(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t rows,
                           int64_t cols, int64_t in_stride, float limit, __nv_bfloat16* out,
                           int64_t out_stride, cudaStream_t stream) {
  return ClampedSwiGlu(gate, up, rows, cols, in_stride, limit, out, out_stride, stream);
}

}  // namespace pdserve::kernels::cuda
