// Device helpers of the hyper-connection kernels (kernels/cuda/hyper_connection.cu and
// hyper_connection_fused.cu), so both round the mixing weights alike.
#pragma once

#include <cuda_runtime.h>

namespace pdserve::kernels::cuda {

// kernels/cpu/activations.h Sigmoid; the division is IEEE (no fast-math).
__device__ __forceinline__ float HcSigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// x * s + b rounded twice, as the CPU computes it (no fused multiply-add).
__device__ __forceinline__ float HcScaleShift(float x, float s, float b) {
  return __fadd_rn(__fmul_rn(x, s), b);
}

}  // namespace pdserve::kernels::cuda
