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

// The same kinds of values as RandomWeights (tid2eid uniform expert ids; norm weights of mean 1
// and standard deviation 0.1; 1-D tensors and position biases of deviation 0.5; projections of
// deviation 1/sqrt(in_features)), but from uniform noise of that mean and variance, value i of
// tensor t a hash of (seed, t, i), filled by `threads` threads (0: the hardware's). Fast enough
// for DeepSeek-V4-Flash-sized benchmarks (6.4 G routed-expert values per layer: bench/ep), and
// the same values for a seed whatever the thread count. Not RandomWeights' values.
Weights FastRandomWeights(const ModelConfig& config, uint64_t seed, int threads = 0);

}  // namespace pdserve::engine
