// Softmax-gated pooling of a compressor window, float32.
//
// For each channel c: out[c] = sum_r softmax_r(gate[r, c]) * kv[r, c] — the per-channel convex
// combination with which the DeepSeek-V4 CSA / HCA compressors and the indexer's compressor turn
// a window of source tokens into one compressed entry (paper §2.3.1 eqs. 9-12, §2.3.2 eqs. 20-23;
// transformers 5.17 modeling_deepseek_v4.py, DeepseekV4CSACompressor / HCACompressor). The caller
// adds the position bias to `gate` first. A gate of -inf gives its row weight 0. Thread-safe.
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// kv, gate: `rows` pointers to rows of `dim` floats (rows may live in different buffers, as the
// overlap window of one call and the new window of the next do). out: [dim].
void GatedPool(const float* const* kv, const float* const* gate, int64_t rows, int64_t dim,
               float* out);

}  // namespace pdserve::kernels::cpu
