#include "engine/indexer.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/topk.h"

namespace pdserve::engine {

namespace cpu = ::pdserve::kernels::cpu;

namespace {

// The test-only wrong indexers of engine/model_options.h, applied to one query's top-k row.
void ApplyFault(IndexerFault fault, int64_t visible, int64_t topk, int32_t* row) {
  if (fault == IndexerFault::kUnmaskedSlots) {
    for (int64_t k = visible; k < topk; ++k) row[k] = static_cast<int32_t>(k);
  }
}

}  // namespace

Indexer::Indexer(const ModelConfig& config, const Weights& weights, const std::string& prefix,
                 const RopeTable* rope, IndexerFault fault, Fp8Emulation fp8)
    : rate_(config.compress_rate_csa),
      heads_(config.index_n_heads),
      head_dim_(config.index_head_dim),
      topk_(config.index_topk),
      hidden_(config.hidden_size),
      q_lora_rank_(config.q_lora_rank),
      rope_(rope),
      fault_(fault),
      fp8_(fp8.ForDense()),
      q_b_proj_(weights.At(prefix + ".q_b_proj.weight")),
      weights_proj_(weights.At(prefix + ".scorer.weights_proj.weight")) {}

void Indexer::Select(const float* x, const float* q_residual, int64_t tokens,
                     int64_t first_position, const Tensor& keys,
                     std::vector<int32_t>* picks) const {
  picks->assign(static_cast<size_t>(tokens * topk_), -1);
  if (tokens == 0) return;
  const int64_t q_width = heads_ * head_dim_;
  std::vector<float> q(static_cast<size_t>(tokens * q_width));
  EmulatedLinear(fp8_, q_residual, tokens, q_lora_rank_, q_b_proj_.ptr(), q_width, q.data());
  std::vector<int64_t> positions(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) positions[i] = first_position + i;
  std::vector<float> cos;
  std::vector<float> sin;
  rope_->Compute(positions, &cos, &sin);
  cpu::ApplyInterleavedRope(q.data(), tokens, q_width, heads_, head_dim_, rope_->rope_dim(),
                            cos.data(), sin.data(), /*inverse=*/false);
  std::vector<float> head_weights(static_cast<size_t>(tokens * heads_));
  EmulatedLinear(fp8_, x, tokens, hidden_, weights_proj_.ptr(), heads_, head_weights.data());

  const float weight_scale = 1.0f / std::sqrt(static_cast<float>(heads_));
  const float score_scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  const int64_t n_keys = keys.dim(0);
  // q . k for a block of queries at once through one GEMM: [block * heads, visible keys].
  constexpr int64_t kBlock = 32;
  std::vector<float> dots;
  for (int64_t b0 = 0; b0 < tokens; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, tokens - b0);
    const int64_t cols = std::min(n_keys, (positions[b0 + nb - 1] + 1) / rate_);
    dots.resize(static_cast<size_t>(nb * heads_ * cols));
    cpu::Linear(q.data() + b0 * q_width, nb * heads_, head_dim_, keys.ptr(), cols, dots.data());
    cpu::ParallelFor(nb, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(static_cast<size_t>(cols));
      std::vector<int32_t> scratch(static_cast<size_t>(cols));
      for (int64_t j = begin; j < end; ++j) {
        const int64_t i = b0 + j;
        const int64_t visible = std::min(cols, (positions[i] + 1) / rate_);
        std::fill(scores.begin(), scores.begin() + visible, 0.0f);
        for (int64_t h = 0; h < heads_; ++h) {
          const float w = head_weights[i * heads_ + h] * weight_scale;
          const float* d = dots.data() + (j * heads_ + h) * cols;
          for (int64_t s = 0; s < visible; ++s) scores[s] += std::max(d[s], 0.0f) * score_scale * w;
        }
        int32_t* row = picks->data() + i * topk_;
        if (fault_ == IndexerFault::kLowestScores) {  // TEST ONLY: the comparator's sign flipped
          for (int64_t s = 0; s < visible; ++s) scores[s] = -scores[s];
        }
        cpu::TopK(scores.data(), visible, topk_, row, scratch.data());
        if (fault_ != IndexerFault::kNone) ApplyFault(fault_, visible, topk_, row);
      }
    });
  }
}

}  // namespace pdserve::engine
