// The tensors a DeepSeek-V4 checkpoint holds: the canonical (transformers) names and shapes a
// ModelConfig requires, and the mapping from DeepSeek's original checkpoint names onto them.
//
// Canonical names are those of DeepseekV4ForCausalLM.state_dict() in transformers 5.17
// (models/deepseek_v4/modeling_deepseek_v4.py); the original names are those of DeepSeek's
// released checkpoints, which transformers' conversion_mapping.py ("deepseek_v4") renames on load
// and restores on save_pretrained. The full table is in docs/checkpoints.md. Pure functions;
// thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"

namespace pdserve::engine {

// Where one stored tensor lands among the canonical tensors.
struct TensorTarget {
  // The part of a stacked experts tensor a per-expert original tensor fills:
  // gate_up_proj[e, :I, :] (w1), gate_up_proj[e, I:, :] (w3) or down_proj[e] (w2).
  enum class Part { kWhole, kExpertGate, kExpertUp, kExpertDown };

  std::string canonical;  // e.g. "model.layers.0.mlp.experts.gate_up_proj"
  Part part = Part::kWhole;
  int64_t expert = -1;  // >= 0 for the expert parts
};

// Maps a stored tensor name, canonical or original, to its target. std::nullopt for names that
// are neither (the loader reports those as unexpected). Does not consult a config: the caller
// checks that the canonical name is one the config requires.
std::optional<TensorTarget> ResolveTensorName(std::string_view stored_name);

// The original (DeepSeek) name of a target: the inverse of ResolveTensorName for original
// names. Used in error messages and to write original-name checkpoints in tests.
std::string OriginalName(const TensorTarget& target);

// True for the multi-token-prediction tensors (`mtp.*`) DeepSeek ships beside the model; like
// transformers (_keys_to_ignore_on_load_unexpected) the loader skips them.
bool IsIgnoredTensorName(std::string_view stored_name);

struct RequiredTensor {
  std::vector<int64_t> shape;
  bool integer = false;  // stored as I32 / I64 (tid2eid); float32 values in the Tensor
};

// Every canonical tensor `config` requires with its shape (PyTorch order: Linear weights are
// [out_features, in_features]). lm_head.weight is absent when tie_word_embeddings is set.
std::map<std::string, RequiredTensor> RequiredTensors(const ModelConfig& config);

}  // namespace pdserve::engine
