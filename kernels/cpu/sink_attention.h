// Multi-query attention of one query token over a gathered key set, with per-head sinks, float32.
//
// DeepSeek-V4 uses a single shared K=V head: every query head attends over the same rows, which
// serve as both keys and values. For head h:
//   p = softmax_with_sink(q_h . k_j * scale for j < n, sink_h);  out_h = sum_j p_j k_j
// Source: transformers 5.17 modeling_deepseek_v4.py, eager_attention_forward (sinks appended as an
// extra logit column and dropped after the softmax). Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// q: [heads, dim]; keys: n pointers to rows of dim floats (the window and the compressed entries
// live in different buffers; n may be 0: the output is then zero); sinks: [heads];
// out: [heads, dim]; scratch: at least n floats.
void SinkAttention(const float* q, int64_t heads, int64_t dim, const float* const* keys, int64_t n,
                   const float* sinks, float scale, float* out, float* scratch);

}  // namespace pdserve::kernels::cpu
