// The DeepSeek-V4 lightning indexer's selection step (CPU backend, float32).
//
// For a query at position t with x_t (the attention input) and q_residual_t (q_a_norm(q_a_proj
// x_t)), and the indexer keys K (the indexer compressor's entries):
//   q = rope_compress(q_b_proj q_residual_t) viewed [heads, ihd];  w = weights_proj(x_t) /
//   sqrt(heads) score(s) = sum_h w_h * relu(q_h . K_s) / sqrt(ihd)          for s < (t + 1) / rate
// and the query keeps the top min(index_topk, (t + 1) / rate) entries; the remaining slots of its
// index_topk row are -1. Entries at or past (t + 1) / rate are never picked (their windows are not
// complete at t). Reference: transformers 5.17 modeling_deepseek_v4.py, DeepseekV4Indexer /
// DeepseekV4IndexerScorer (one-shot path; ties broken toward the lower index, see
// kernels/cpu/topk.h). Immutable after construction; Select may run concurrently.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"
#include "engine/fp8_emulation.h"
#include "engine/model_options.h"
#include "engine/rope_table.h"
#include "engine/state.h"
#include "engine/weights.h"

namespace pdserve::engine {

class Indexer {
 public:
  // `prefix` is the indexer module, e.g. "model.layers.2.self_attn.compressor.indexer"; needs
  // q_b_proj.weight [heads * ihd, q_lora_rank] and scorer.weights_proj.weight [heads, hidden].
  // `fault` is kNone except in the tests of the coherence guards (engine/model_options.h).
  Indexer(const ModelConfig& config, const Weights& weights, const std::string& prefix,
          const RopeTable* rope, IndexerFault fault = IndexerFault::kNone, Fp8Emulation fp8 = {});

  // x: [tokens, hidden]; q_residual: [tokens, q_lora_rank]; the queries sit at positions
  // first_position + i. `keys` must already include every entry these queries may see.
  // picks: resized to [tokens, index_topk] entry indices, -1 for invalid slots.
  void Select(const float* x, const float* q_residual, int64_t tokens, int64_t first_position,
              const Tensor& keys, std::vector<int32_t>* picks) const;

  int64_t topk() const { return topk_; }

 private:
  int64_t rate_;
  int64_t heads_;
  int64_t head_dim_;
  int64_t topk_;
  int64_t hidden_;
  int64_t q_lora_rank_;
  const RopeTable* rope_;
  IndexerFault fault_;
  Fp8Emulation fp8_;  // ModelOptions::fp8_emulation
  const Tensor& q_b_proj_;
  const Tensor& weights_proj_;
};

}  // namespace pdserve::engine
