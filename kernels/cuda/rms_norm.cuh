// RMSNorm over the last dimension on the GPU, fp32 or bf16 storage, fp32 math.
//
// Math (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4RMSNorm / UnweightedRMSNorm; CPU
// reference kernels/cpu/rms_norm.h, which this matches operation for operation):
//   inv = 1 / sqrt(float(sum(x^2) / dim) + eps);  y = weight * (x * inv)   (or x * inv unweighted)
// The sum of squares is accumulated in fp64 as the CPU reference does, so rows whose squares
// overflow fp32 (|x| up to ~1e19 with a finite mean square) normalize instead of collapsing to 0;
// everything after the sum is fp32. For bf16 the result is rounded to bf16 once, at the store
// (transformers rounds x * inv to bf16 before the weight multiply; the difference is within one
// bf16 rounding).
//
// Layouts: x, y [rows, stride] (row r reads x[r * stride + 0 .. dim), writes the same slots of y;
// slots dim .. stride are neither read nor written, so stale or NaN tails cannot leak); weight
// [dim] of the same dtype as x, or nullptr for the unweighted form. y may alias x exactly (in
// place); partial overlap is not supported.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends only on (rows, dim).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

// rows >= 0, dim >= 0, stride >= dim, rows * stride < 2^62. rows == 0 or dim == 0 writes nothing.
// Returns cudaErrorInvalidValue on bad arguments (including null x / y when there is work), else
// the launch status. Asynchronous on `stream`; no state, so concurrent calls on different outputs
// are safe.
cudaError_t rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t stride,
                     float eps, float* y, cudaStream_t stream);
cudaError_t rms_norm(const __nv_bfloat16* x, const __nv_bfloat16* weight, int64_t rows, int64_t dim,
                     int64_t stride, float eps, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
