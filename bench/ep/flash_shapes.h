// Shared by issue 11's GPU benchmarks (bench/ep): a model configuration with DeepSeek-V4-Flash
// layer shapes (engine::ModelConfig's defaults) and a few timing helpers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "engine/config.h"
#include "engine/ring_state.h"
#include "engine/state.h"

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

// A random state of `config` at `position` tokens in the CUDA engine's ring layout for a slot of
// `max_context` tokens (entry pages of 64): every ring value in [-1, 1), drawn from `seed`.
inline engine::ModelState RandomRingState(const engine::ModelConfig& config, int64_t max_context,
                                          int64_t position, uint64_t seed = 88172645463325252ull) {
  const engine::RingGeometry geometry = engine::RingGeometryFor(config, max_context, 64);
  engine::RingImage image = engine::NewRingImage(geometry);
  image.position = position;
  uint64_t x = seed;
  auto next = [&x] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<float>(x >> 40) / static_cast<float>(1 << 23) - 1.0f;
  };
  for (engine::RingLayerImage& l : image.layers) {
    for (std::vector<float>* v :
         {&l.window, &l.compressor.ring_kv, &l.compressor.ring_gate, &l.compressor.entries,
          &l.indexer.ring_kv, &l.indexer.ring_gate, &l.indexer.entries}) {
      for (float& f : *v) f = next();
    }
  }
  return *engine::StateFromRingImage(geometry, image);
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
