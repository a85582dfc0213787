#include "engine/moe.h"

#include <string>

#include "engine/quant.h"
#include "kernels/cpu/activations.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/softmax.h"
#include "kernels/cpu/topk.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

namespace {

std::string Prefix(int64_t layer) { return "model.layers." + std::to_string(layer) + ".mlp"; }

}  // namespace

Moe::Moe(const ModelConfig& config, const Weights& weights, int64_t layer, bool bf16_input,
         Fp8Emulation fp8)
    : config_(config),
      hash_(config.mlp_layer_types.at(static_cast<size_t>(layer)) == MlpLayerType::kHashMoe),
      bf16_input_(bf16_input),
      fp8_(fp8),
      gate_(weights.At(Prefix(layer) + ".gate.weight")),
      gate_up_(weights.At(Prefix(layer) + ".experts.gate_up_proj")),
      down_(weights.At(Prefix(layer) + ".experts.down_proj")),
      shared_gate_(weights.At(Prefix(layer) + ".shared_experts.gate_proj.weight")),
      shared_up_(weights.At(Prefix(layer) + ".shared_experts.up_proj.weight")),
      shared_down_(weights.At(Prefix(layer) + ".shared_experts.down_proj.weight")) {
  if (hash_) {
    tid2eid_ = &weights.At(Prefix(layer) + ".gate.tid2eid");
  } else {
    correction_bias_ = &weights.At(Prefix(layer) + ".gate.e_score_correction_bias");
  }
}

void Moe::Route(const float* x, int64_t tokens, const int32_t* token_ids,
                std::vector<int32_t>* experts, std::vector<float>* weights) const {
  const int64_t n_experts = config_.n_routed_experts;
  const int64_t k = config_.num_experts_per_tok;
  std::vector<float> scores(static_cast<size_t>(tokens * n_experts));
  cpu::Linear(x, tokens, config_.hidden_size, gate_.ptr(), n_experts, scores.data());
  experts->resize(static_cast<size_t>(tokens * k));
  weights->resize(static_cast<size_t>(tokens * k));
  std::vector<float> biased(static_cast<size_t>(n_experts));
  std::vector<int32_t> scratch(static_cast<size_t>(n_experts));
  for (int64_t t = 0; t < tokens; ++t) {
    float* s = scores.data() + t * n_experts;
    switch (config_.scoring_func) {
      case ScoringFunc::kSqrtSoftplus:
        for (int64_t e = 0; e < n_experts; ++e) s[e] = cpu::SqrtSoftplus(s[e]);
        break;
      case ScoringFunc::kSigmoid:
        for (int64_t e = 0; e < n_experts; ++e) s[e] = cpu::Sigmoid(s[e]);
        break;
      case ScoringFunc::kSoftmax:
        cpu::Softmax(s, n_experts);
        break;
    }
    int32_t* picked = experts->data() + t * k;
    if (hash_) {
      const float* row = tid2eid_->ptr() + static_cast<int64_t>(token_ids[t]) * k;
      for (int64_t j = 0; j < k; ++j) picked[j] = static_cast<int32_t>(row[j]);
    } else {
      for (int64_t e = 0; e < n_experts; ++e) biased[e] = s[e] + correction_bias_->ptr()[e];
      cpu::TopK(biased.data(), n_experts, k, picked, scratch.data());
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += s[picked[j]];
    const float norm = static_cast<float>(config_.routed_scaling_factor) / (sum + 1e-20f);
    for (int64_t j = 0; j < k; ++j) (*weights)[t * k + j] = s[picked[j]] * norm;
  }
}

void Moe::Forward(const float* x, int64_t tokens, const int32_t* token_ids, float* out) const {
  const int64_t hidden = config_.hidden_size;
  const int64_t inter = config_.moe_intermediate_size;
  const int64_t k = config_.num_experts_per_tok;
  const float limit = static_cast<float>(config_.swiglu_limit);

  // Shared expert first: it initializes `out`.
  std::vector<float> gate(static_cast<size_t>(tokens * inter));
  std::vector<float> up(gate.size());
  const Fp8Emulation shared = fp8_.ForDense();
  EmulatedLinear(shared, x, tokens, hidden, shared_gate_.ptr(), inter, gate.data());
  EmulatedLinear(shared, x, tokens, hidden, shared_up_.ptr(), inter, up.data());
  cpu::ClampedSwiGlu(gate.data(), up.data(), tokens * inter, limit, gate.data());
  EmulatedLinear(shared, gate.data(), tokens, inter, shared_down_.ptr(), hidden, out);
  const Fp8Emulation routed = fp8_.ForExperts();

  std::vector<int32_t> experts;
  std::vector<float> weights;
  Route(x, tokens, token_ids, &experts, &weights);

  // Group the (token, slot) assignments by expert so each expert runs one GEMM.
  std::vector<std::vector<int64_t>> assigned(static_cast<size_t>(config_.n_routed_experts));
  for (int64_t a = 0; a < tokens * k; ++a) assigned[experts[a]].push_back(a);
  std::vector<float> xs;
  std::vector<float> gate_up;
  std::vector<float> act;
  std::vector<float> y;
  for (int64_t e = 0; e < config_.n_routed_experts; ++e) {
    const auto& list = assigned[e];
    if (list.empty()) continue;
    const int64_t n = static_cast<int64_t>(list.size());
    xs.resize(static_cast<size_t>(n * hidden));
    for (int64_t r = 0; r < n; ++r) {
      std::copy_n(x + (list[r] / k) * hidden, hidden, xs.data() + r * hidden);
    }
    if (bf16_input_) RoundToBf16(xs.data(), n * hidden);
    gate_up.resize(static_cast<size_t>(n * 2 * inter));
    EmulatedLinear(routed, xs.data(), n, hidden, gate_up_.ptr() + e * 2 * inter * hidden, 2 * inter,
                   gate_up.data());
    act.resize(static_cast<size_t>(n * inter));
    for (int64_t r = 0; r < n; ++r) {
      const float* row = gate_up.data() + r * 2 * inter;
      cpu::ClampedSwiGlu(row, row + inter, inter, limit, act.data() + r * inter);
    }
    // moe_gemm's bf16 SwiGLU rows (kernels/cuda/moe_gemm.cuh).
    if (routed.bf16_outputs) RoundToBf16(act.data(), n * inter);
    y.resize(static_cast<size_t>(n * hidden));
    EmulatedLinear(routed, act.data(), n, inter, down_.ptr() + e * hidden * inter, hidden,
                   y.data());
    for (int64_t r = 0; r < n; ++r) {
      const float w = weights[list[r]];
      float* o = out + (list[r] / k) * hidden;
      if (routed.bf16_outputs) {
        // moe_gemm writes bf16(weight * dot) per pick.
        for (int64_t c = 0; c < hidden; ++c) o[c] += RoundToBf16(w * y[r * hidden + c]);
      } else {
        for (int64_t c = 0; c < hidden; ++c) o[c] += w * y[r * hidden + c];
      }
    }
  }
}

}  // namespace pdserve::engine
