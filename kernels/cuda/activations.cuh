// Clamped SwiGLU of DeepSeek-V4's experts on the GPU, fp32 or bf16 storage, fp32 math.
//
// Math (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4Experts._apply_gate / DeepseekV4MLP;
// CPU reference kernels/cpu/activations.h, ClampedSwiGlu, matched operation for operation):
//   out = silu(min(gate, limit)) * clamp(up, -limit, limit),  silu(g) = g * (1 / (1 + exp(-g)))
// with std::min / std::clamp's NaN behaviour (a NaN gate or up stays NaN; it is not clamped away).
//
// Layouts: gate, up [rows, in_stride] (row r reads columns 0 .. cols of each; the fused expert
// layout [gate | up] is gate = row, up = row + inter, in_stride = 2 * inter); out [rows,
// out_stride]. Columns past `cols` are neither read nor written. out may alias gate or up exactly
// (same element, same strides). bf16 results are rounded once, at the store.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends only on (rows,
// cols).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

// rows, cols >= 0; in_stride, out_stride >= cols. rows or cols of 0 writes nothing. Returns
// cudaErrorInvalidValue on bad arguments (including null pointers when there is work), else the
// launch status. Asynchronous on `stream`; no state, so concurrent calls on different outputs are
// safe.
cudaError_t clamped_swiglu(const float* gate, const float* up, int64_t rows, int64_t cols,
                           int64_t in_stride, float limit, float* out, int64_t out_stride,
                           cudaStream_t stream);
cudaError_t clamped_swiglu(const __nv_bfloat16* gate, const __nv_bfloat16* up, int64_t rows,
                           int64_t cols, int64_t in_stride, float limit, __nv_bfloat16* out,
                           int64_t out_stride, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
