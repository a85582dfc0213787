// Interleaved partial rotary position embedding (DeepSeek-V4 layout), float32.
//
// Each head of `head_dim` channels is laid out [nope | rope]; only the trailing `rope_dim`
// channels rotate, in consecutive pairs (2i, 2i+1) by angle theta_i:
//   out[2i]   = x[2i] cos_i - x[2i+1] sin_i
//   out[2i+1] = x[2i+1] cos_i + x[2i] sin_i
// `inverse` rotates by -theta_i (the conjugate), which V4 applies to the attention output's rope
// slice. Source: transformers 5.17 modeling_deepseek_v4.py, apply_rotary_pos_emb / rotate_half.
// Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// x: [rows, heads, head_dim] with rows `row_stride` floats apart (>= heads * head_dim), rotated
// in place. cos, sin: [rows, rope_dim / 2], one angle per pair. rope_dim must be even and
// <= head_dim.
void ApplyInterleavedRope(float* x, int64_t rows, int64_t row_stride, int64_t heads,
                          int64_t head_dim, int64_t rope_dim, const float* cos, const float* sin,
                          bool inverse);

}  // namespace pdserve::kernels::cpu
