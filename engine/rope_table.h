// Rotary-embedding angles for one DeepSeek-V4 rope type ("main" or "compress").
//
// Inverse frequencies follow transformers 5.17: compute_default_rope_parameters for "default"
// (inv_freq_i = theta^(-2i/d)) and modeling_rope_utils._compute_yarn_parameters for "yarn"
// (ramp between interpolated and extrapolated frequencies over the correction range of
// beta_fast / beta_slow rotations at original_max_position_embeddings), where d = qk_rope_head_dim.
// Like transformers, the angles are computed in float32 (inv_freq rounded to float, angle =
// inv_freq * position in float) and cos / sin are multiplied by the attention factor.
// Immutable after construction; concurrent reads are safe.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/config.h"

namespace pdserve::engine {

class RopeTable {
 public:
  // rope_dim: the rotated channels per head (config.qk_rope_head_dim, even).
  // max_position_embeddings: fallback for a YaRN original_max_position_embeddings of 0.
  RopeTable(const RopeParams& params, int64_t rope_dim, int64_t max_position_embeddings);

  int64_t rope_dim() const { return rope_dim_; }
  const std::vector<float>& inv_freq() const { return inv_freq_; }
  // The factor cos / sin are multiplied by (YaRN's attention factor; 1 for "default").
  float attention_scaling() const { return attention_scaling_; }

  // Writes cos / sin for each position: both [positions.size(), rope_dim / 2].
  void Compute(const std::vector<int64_t>& positions, std::vector<float>* cos,
               std::vector<float>* sin) const;

 private:
  int64_t rope_dim_;
  float attention_scaling_ = 1.0f;
  std::vector<float> inv_freq_;  // [rope_dim / 2]
};

}  // namespace pdserve::engine
