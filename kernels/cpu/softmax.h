// Softmax variants, float32, numerically stabilized by subtracting the row maximum.
// Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// In place: x[0..n) <- softmax(x). Entries equal to -inf get probability 0; n == 0 is a no-op.
// If every entry is -inf the result is all zeros.
void Softmax(float* x, int64_t n);

// In place: x[0..n) <- the first n probabilities of softmax([x, sink]); the sink's own share is
// dropped, so the row sums to < 1. The learnable per-head "attention sink" of gpt-oss / V4
// (transformers 5.17 modeling_deepseek_v4.py, eager_attention_forward).
void SoftmaxWithSink(float* x, int64_t n, float sink);

}  // namespace pdserve::kernels::cpu
