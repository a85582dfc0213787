// DeepSeek-V4 attention block, incremental form (CPU backend, float32).
//
// Per query token at position t (paper §2.3; transformers 5.17 modeling_deepseek_v4.py,
// DeepseekV4Attention, one-shot semantics):
//   q_res = q_a_norm(q_a_proj x);  q = rope(rms(q_b_proj q_res) per head)      [heads, hd]
//   kv = rope(kv_norm(kv_proj x))                                              [hd], K = V
//   keys = kv of positions (t - W, t]  (sliding window)
//        + compressed entries w < (t + 1) / m   (HCA: all of them; CSA: the indexer's top-k)
//   o_h = sum_j softmax_with_sink(q_h . k_j / sqrt(hd), sink_h) k_j, then the rope slice of o_h is
//   rotated back by -t; out = o_b_proj(o_a_proj grouped by o_groups).
// Sliding layers use the "main" rope, CSA / HCA layers the "compress" rope everywhere.
// Immutable after construction; Forward may run concurrently on distinct states.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/compressor.h"
#include "engine/config.h"
#include "engine/fp8_emulation.h"
#include "engine/indexer.h"
#include "engine/rope_table.h"
#include "engine/state.h"
#include "engine/weights.h"

namespace pdserve::engine {

class Attention {
 public:
  // Reads model.layers.<layer>.self_attn.* from `weights` (validated by the model); `weights`,
  // `config` and the rope tables must outlive the block.
  // `indexer_fault` is kNone except in the guards' tests (engine/model_options.h).
  Attention(const ModelConfig& config, const Weights& weights, int64_t layer,
            const RopeTable* main_rope, const RopeTable* compress_rope,
            IndexerFault indexer_fault = IndexerFault::kNone, bool bf16_state = false,
            Fp8Emulation fp8 = {});

  LayerState NewState() const;

  // x: [tokens, hidden] (input_layernorm output) at positions first_position + i; extends `state`
  // by these tokens and writes out: [tokens, hidden].
  void Forward(const float* x, int64_t tokens, int64_t first_position, LayerState* state,
               float* out) const;

 private:
  const ModelConfig& config_;
  LayerType type_;
  int64_t rate_;
  const RopeTable* rope_;
  bool bf16_state_;   // ModelOptions::bf16_state
  Fp8Emulation fp8_;  // ModelOptions::fp8_emulation
  const Tensor& q_a_proj_;
  const Tensor& q_a_norm_;
  const Tensor& q_b_proj_;
  const Tensor& kv_proj_;
  const Tensor& kv_norm_;
  const Tensor& o_a_proj_;
  const Tensor& o_b_proj_;
  const Tensor& sinks_;
  std::unique_ptr<Compressor> compressor_;          // CSA / HCA
  std::unique_ptr<Compressor> indexer_compressor_;  // CSA
  std::unique_ptr<Indexer> indexer_;                // CSA
};

}  // namespace pdserve::engine
