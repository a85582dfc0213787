#include "engine/random_weights.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

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

namespace {

// splitmix64's finalizer: a well-mixed 64-bit hash of a counter.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-sqrt(3), sqrt(3)): mean 0, variance 1.
float UnitNoise(uint64_t key) {
  constexpr float kHalfWidth = 1.7320508f;
  const auto bits = static_cast<uint32_t>(Mix(key) >> 40);  // 24 bits
  return (static_cast<float>(bits) / 8388608.0f - 1.0f) * kHalfWidth;
}

}  // namespace

Weights FastRandomWeights(const ModelConfig& config, uint64_t seed, int threads) {
  const int n_threads =
      threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  Weights weights;
  uint64_t index = 0;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    Tensor t(spec.shape);
    const std::string& name = spec.name;
    const uint64_t base = Mix(seed ^ Mix(++index));
    float mean = 0.0f;
    float deviation = 0.0f;
    bool expert_ids = false;
    if (name.ends_with(".tid2eid")) {
      expert_ids = true;
    } else if (name.ends_with("norm.weight")) {
      mean = 1.0f;
      deviation = 0.1f;
    } else if (spec.shape.size() == 1 || name.ends_with("position_bias")) {
      deviation = 0.5f;
    } else {
      deviation = 1.0f / std::sqrt(static_cast<float>(spec.shape.back()));
    }
    const size_t n = t.data.size();
    auto fill = [&](size_t lo, size_t hi) {
      for (size_t i = lo; i < hi; ++i) {
        const uint64_t key = base + i;
        t.data[i] =
            expert_ids
                ? static_cast<float>(Mix(key) % static_cast<uint64_t>(config.n_routed_experts))
                : mean + deviation * UnitNoise(key);
      }
    };
    // Small tensors on this thread; large ones split into equal ranges.
    const size_t parts = n < (size_t{1} << 20) ? 1 : static_cast<size_t>(n_threads);
    std::vector<std::thread> pool;
    for (size_t p = 1; p < parts; ++p) pool.emplace_back(fill, n * p / parts, n * (p + 1) / parts);
    fill(0, n / parts);
    for (std::thread& th : pool) th.join();
    weights.Set(name, std::move(t));
  }
  return weights;
}

}  // namespace pdserve::engine
