// Multi-query attention with per-head sinks over a shared block of key rows, float32.
//
// DeepSeek-V4 uses a single shared K=V head: every query head attends over the same rows, which
// serve as both keys and values. For query i, head h:
//   p = softmax_with_sink(q_ih . k_j * scale for visible j, sink_h);  out_ih = sum_j p_j k_j
// where invisible keys get probability 0. Source: transformers 5.17 modeling_deepseek_v4.py,
// eager_attention_forward (sinks appended as an extra logit column and dropped after the softmax;
// masked keys carry -inf). Both products run as OpenBLAS GEMMs over the whole block, the softmax
// rows in ParallelFor: do not call this from inside a ParallelFor body. Thread-safe otherwise.
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// q: [queries, heads, dim]; keys: [n, dim] (n may be 0: the output is then zero);
// visible: [queries, n], nonzero where query i may attend to key j; sinks: [heads];
// out: [queries, heads, dim].
void SinkAttention(const float* q, int64_t queries, int64_t heads, int64_t dim, const float* keys,
                   int64_t n, const uint8_t* visible, const float* sinks, float scale, float* out);

}  // namespace pdserve::kernels::cpu
