// Deterministic top-k selection, float32 scores.
//
// Order: descending score, ties broken by ascending index (torch.topk leaves tie order
// unspecified; a fixed order keeps CPU and CUDA results comparable). NaN never occurs in our
// callers and is not handled specially. Thread-safe (no shared state).
#pragma once

#include <cstdint>

namespace pdserve::kernels::cpu {

// Picks the k best of scores[0..n_candidates) into out[0..k). Slots beyond the number of
// candidates are -1 ("invalid"), as the V4 lightning indexer marks picks that would point past a
// query's causal limit (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4Indexer.forward).
// `scratch` holds at least n_candidates ints.
void TopK(const float* scores, int64_t n_candidates, int64_t k, int32_t* out, int32_t* scratch);

}  // namespace pdserve::kernels::cpu
