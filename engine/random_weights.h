// Random DeepSeek-V4 weights for tests and benchmarks (no checkpoint needed).
//
// Every tensor of ExpectedTensors(config) gets deterministic pseudo-random values from `seed`:
// projections ~ N(0, 1/in_features), norm weights ~ 1 + N(0, 0.1^2), hyper-connection scales,
// biases, sinks, position biases and correction biases ~ N(0, 0.5^2), tid2eid uniform expert ids.
// Thread-safe (pure function).
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "engine/weights.h"

namespace pdserve::engine {

Weights RandomWeights(const ModelConfig& config, uint64_t seed);

}  // namespace pdserve::engine
