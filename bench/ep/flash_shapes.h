// Shared by issue 11's GPU benchmarks (bench/ep): a model configuration with DeepSeek-V4-Flash
// layer shapes (engine::ModelConfig's defaults) and a few timing helpers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "engine/config.h"

namespace pdserve::bench {

using Clock = std::chrono::steady_clock;

// V4-Flash layer shapes with `layers` layers and `vocab` tokens: CSA and HCA alternating, the
// first layer's MoE hash-routed (V4 routes its first layers by token hash), 65536 positions.
inline engine::ModelConfig FlashShapes(int64_t layers, int64_t vocab) {
  engine::ModelConfig c;
  c.num_hidden_layers = layers;
  c.vocab_size = vocab;
  c.max_position_embeddings = 65536;
  for (int64_t l = 0; l < layers; ++l) {
    c.layer_types.push_back(l % 2 == 0 ? engine::LayerType::kCompressedSparseAttention
                                       : engine::LayerType::kHeavilyCompressedAttention);
    c.mlp_layer_types.push_back(l == 0 ? engine::MlpLayerType::kHashMoe
                                       : engine::MlpLayerType::kMoe);
  }
  return c;
}

inline double Seconds(Clock::time_point from) {
  return std::chrono::duration<double>(Clock::now() - from).count();
}

// REQUIRES !v.empty().
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace pdserve::bench
