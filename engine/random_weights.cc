#include "engine/random_weights.h"

#include <cmath>
#include <random>
#include <string>

#include "engine/tensor_spec.h"

namespace pdserve::engine {

Weights RandomWeights(const ModelConfig& config, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Weights weights;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    Tensor t(spec.shape);
    const std::string& name = spec.name;
    if (name.ends_with(".tid2eid")) {
      std::uniform_int_distribution<int64_t> expert(0, config.n_routed_experts - 1);
      for (float& v : t.data) v = static_cast<float>(expert(rng));
    } else if (name.ends_with("norm.weight")) {
      for (float& v : t.data) v = 1.0f + 0.1f * normal(rng);
    } else if (spec.shape.size() == 1 || name.ends_with("position_bias")) {
      for (float& v : t.data) v = 0.5f * normal(rng);
    } else {
      const float scale = 1.0f / std::sqrt(static_cast<float>(spec.shape.back()));
      for (float& v : t.data) v = scale * normal(rng);
    }
    weights.Set(name, std::move(t));
  }
  return weights;
}

}  // namespace pdserve::engine
