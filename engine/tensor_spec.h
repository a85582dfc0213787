// The tensors the forward pass reads, by canonical (transformers 5.17 in-memory) name, with their
// float32 shapes: the checkpoint's required tensors (checkpoint_layout.h, one list for loader and
// model) plus lm_head.weight when embeddings are tied. Thread-safe (pure functions).
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

// Every tensor the forward pass reads, in name order. lm_head.weight is listed even when
// tie_word_embeddings is set (Model::FromWeights copies model.embed_tokens.weight into it).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// InvalidArgument naming the first tensor of ExpectedTensors(config) that is missing from
// `weights` or has another shape; also checks that hash-routing tables hold integral expert ids
// in [0, n_routed_experts).
absl::Status ValidateWeights(const ModelConfig& config, const Weights& weights);

}  // namespace pdserve::engine
