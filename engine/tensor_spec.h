// The tensors a DeepSeek-V4 model needs, by canonical (transformers 5.17 in-memory) name, with
// their float32 shapes as functions of the config. Source: the parameter definitions in
// transformers 5.17 modeling_deepseek_v4.py (rotary inv_freq buffers are not persistent and are
// not listed). Thread-safe (pure function).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/config.h"
#include "engine/weights.h"

namespace pdserve::engine {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor the forward pass reads. lm_head.weight is listed even when
// tie_word_embeddings is set (the loader is expected to alias it to model.embed_tokens.weight).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// InvalidArgument naming the first tensor of ExpectedTensors(config) that is missing from
// `weights` or has another shape; also checks that hash-routing tables hold integral expert ids
// in [0, n_routed_experts).
absl::Status ValidateWeights(const ModelConfig& config, const Weights& weights);

}  // namespace pdserve::engine
