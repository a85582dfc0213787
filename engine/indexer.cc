#include "engine/indexer.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/topk.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

Indexer::Indexer(const ModelConfig& config, const Weights& weights, const std::string& prefix,
                 const RopeTable* rope)
    : rate_(config.compress_rate_csa),
      heads_(config.index_n_heads),
      head_dim_(config.index_head_dim),
      topk_(config.index_topk),
      hidden_(config.hidden_size),
      q_lora_rank_(config.q_lora_rank),
      rope_(rope),
      q_b_proj_(weights.At(prefix + ".q_b_proj.weight")),
      weights_proj_(weights.At(prefix + ".scorer.weights_proj.weight")) {}

void Indexer::Select(const float* x, const float* q_residual, int64_t tokens,
                     int64_t first_position, const Tensor& keys,
                     std::vector<int32_t>* picks) const {
  picks->assign(static_cast<size_t>(tokens * topk_), -1);
  if (tokens == 0) return;
  const int64_t q_width = heads_ * head_dim_;
  std::vector<float> q(static_cast<size_t>(tokens * q_width));
  cpu::Linear(q_residual, tokens, q_lora_rank_, q_b_proj_.ptr(), q_width, q.data());
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) positions[i] = first_position + i;
  std::vector<float> cos;
  std::vector<float> sin;
  rope_->Compute(positions, &cos, &sin);
  cpu::ApplyInterleavedRope(q.data(), tokens, q_width, heads_, head_dim_, rope_->rope_dim(),
                            cos.data(), sin.data(), /*inverse=*/false);
  std::vector<float> head_weights(static_cast<size_t>(tokens * heads_));
  cpu::Linear(x, tokens, hidden_, weights_proj_.ptr(), heads_, head_weights.data());

  const float weight_scale = 1.0f / std::sqrt(static_cast<float>(heads_));
  const float score_scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  const int64_t n_keys = keys.dim(0);
  cpu::ParallelFor(tokens, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(n_keys));
    std::vector<int32_t> scratch(static_cast<size_t>(n_keys));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t visible = std::min(n_keys, (positions[i] + 1) / rate_);
      const float* qi = q.data() + i * q_width;
      const float* wi = head_weights.data() + i * heads_;
      for (int64_t s = 0; s < visible; ++s) {
        const float* k = keys.ptr() + s * head_dim_;
        float score = 0.0f;
        for (int64_t h = 0; h < heads_; ++h) {
          const float dot = cpu::Dot(qi + h * head_dim_, k, head_dim_);
          score += std::max(dot, 0.0f) * score_scale * (wi[h] * weight_scale);
        }
        scores[s] = score;
      }
      cpu::TopK(scores.data(), visible, topk_, picks->data() + i * topk_, scratch.data());
    }
  });
}

}  // namespace pdserve::engine
