// Interleaved partial rotary position embedding (DeepSeek-V4 layout) on the GPU, fp32 or bf16
// storage, fp32 math, angles computed on the device from positions in device memory.
//
// Each head of `head_dim` channels is laid out [nope | rope]; only the trailing `rope_dim`
// channels rotate, in consecutive pairs (2i, 2i+1), by theta_i = inv_freq[i] * position:
//   out[2i] = x[2i] c_i - x[2i+1] s_i;  out[2i+1] = x[2i+1] c_i + x[2i] s_i
// with c_i = attention_scaling * cos(theta_i), s_i = attention_scaling * sin(theta_i), and s_i
// negated when `inverse` (V4 rotates the attention output's rope slice back by -theta).
// Sources: transformers 5.17 modeling_deepseek_v4.py (apply_rotary_pos_emb, rotate_half) and
// modeling_rope_utils.py (_compute_default_rope_parameters, _compute_yarn_parameters). YaRN enters
// only through `inv_freq` (the ramp between interpolated and extrapolated frequencies) and
// `attention_scaling` (its attention factor), which the host computes once per rope type, as
// engine/rope_table.h does. Matches engine/rope_table.cc's Compute (fp32 angle = inv_freq *
// float(position), cos / sin evaluated in fp64, rounded to fp32, times the scaling) followed by
// kernels/cpu/rope.h's ApplyInterleavedRope (products rounded separately, not fused).
//
// Layouts: x [rows, row_stride] holding heads x head_dim channels per row (row_stride >= heads *
// head_dim), rotated in place; only the rope slices are read or written, so nope channels and row
// tails are untouched. positions [rows] int32 in device memory (row r's token position);
// inv_freq [rope_dim / 2] fp32 in device memory. bf16 rows are rounded to bf16 once per channel.
//
// CUDA-graph safe: no allocation, no synchronization; the launch shape depends only on (rows,
// heads, rope_dim); positions and inv_freq are read when the kernel runs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pdserve::kernels::cuda {

inline constexpr int64_t kMaxRopeDim = 1024;

// rope_dim even, 0 <= rope_dim <= min(head_dim, kMaxRopeDim); heads, rows >= 0; row_stride >=
// heads * head_dim. rows, heads or rope_dim of 0 writes nothing. Returns cudaErrorInvalidValue on
// bad arguments (including null pointers when there is work), else the launch status.
// Asynchronous on `stream`; no state, so concurrent calls on different tensors are safe.
cudaError_t apply_interleaved_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads,
                                   int64_t head_dim, int64_t rope_dim, const int32_t* positions,
                                   const float* inv_freq, float attention_scaling, bool inverse,
                                   cudaStream_t stream);
cudaError_t apply_interleaved_rope(__nv_bfloat16* x, int64_t rows, int64_t row_stride,
                                   int64_t heads, int64_t head_dim, int64_t rope_dim,
                                   const int32_t* positions, const float* inv_freq,
                                   float attention_scaling, bool inverse, cudaStream_t stream);

}  // namespace pdserve::kernels::cuda
