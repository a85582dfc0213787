// DeepSeek-V4 mixture-of-experts block (CPU backend, float32).
//
// Router (transformers 5.17 modeling_deepseek_v4.py, DeepseekV4TopKRouter / DeepseekV4HashRouter;
// paper §2.1): scores = f(x W_gate^T) with f = sqrtsoftplus, sigmoid or softmax (over experts).
// Routed layers pick the top-k of scores + e_score_correction_bias (the bias steers selection
// only); hash layers take the experts tid2eid[token]. Weights are the picked scores divided by
// their sum (+1e-20), times routed_scaling_factor. Each routed expert is a SwiGLU MLP with the
// gate clamped to <= swiglu_limit and the up projection to [-limit, limit]; the shared expert is
// the same MLP over every token. out = sum_k weight_k expert_k(x) + shared(x).
// Immutable after construction; Forward may run concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "engine/fp8_emulation.h"
#include "engine/weights.h"

namespace pdserve::engine {

class Moe {
 public:
  // Reads model.layers.<layer>.mlp.* (validated by the model). tid2eid holds expert ids as floats
  // [vocab, k]; they were range-checked by the model.
  // bf16_input: ModelOptions::bf16_expert_input (the routed experts see x rounded to bf16).
  // fp8: ModelOptions::fp8_emulation (engine/fp8_emulation.h).
  Moe(const ModelConfig& config, const Weights& weights, int64_t layer, bool bf16_input = false,
      Fp8Emulation fp8 = {});

  // x: [tokens, hidden] (post_attention_layernorm output); token_ids: [tokens] (used by hash
  // layers); out: [tokens, hidden].
  void Forward(const float* x, int64_t tokens, const int32_t* token_ids, float* out) const;

 private:
  // Fills experts / weights, each [tokens, k].
  void Route(const float* x, int64_t tokens, const int32_t* token_ids,
             std::vector<int32_t>* experts, std::vector<float>* weights) const;

  const ModelConfig& config_;
  bool hash_;
  bool bf16_input_;
  Fp8Emulation fp8_;
  const Tensor& gate_;
  const Tensor* correction_bias_ = nullptr;  // routed layers
  const Tensor* tid2eid_ = nullptr;          // hash layers
  const Tensor& gate_up_;                    // [E, 2I, H]
  const Tensor& down_;                       // [E, H, I]
  const Tensor& shared_gate_;
  const Tensor& shared_up_;
  const Tensor& shared_down_;
};

}  // namespace pdserve::engine
