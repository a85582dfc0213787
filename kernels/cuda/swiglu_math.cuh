// The clamped SwiGLU of one element in fp32, shared by clamped_swiglu (activations.cu) and
// clamped_swiglu_act_quant (act_quant.cu) so that both compute the same bits. Math and NaN
// behaviour: activations.cuh. Device code; include from .cu files only.
#pragma once

namespace pdserve::kernels::cuda {

__device__ __forceinline__ float ClampedSwiGluValue(float g_in, float u_in, float limit) {
  // std::min(g, limit) and std::clamp(u, -limit, limit): comparisons, so NaN passes through.
  const float g = limit < g_in ? limit : g_in;
  const float u = u_in < -limit ? -limit : (limit < u_in ? limit : u_in);
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  return (g * sigmoid) * u;
}

}  // namespace pdserve::kernels::cuda
