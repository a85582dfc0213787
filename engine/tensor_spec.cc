#include "engine/tensor_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/checkpoint_layout.h"

namespace pdserve::engine {

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  std::vector<TensorSpec> specs;
  for (auto& [name, required] : RequiredTensors(c)) specs.push_back({name, required.shape});
  if (c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, c.hidden_size}});
  return specs;
}

absl::Status ValidateWeights(const ModelConfig& config, const Weights& weights) {
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto tensor = weights.Get(spec.name);
    if (!tensor.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("missing tensor ", spec.name));
    }
    if ((*tensor)->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.name, " has shape ",
                                                     (*tensor)->ShapeString(), ", expected [",
                                                     absl::StrJoin(spec.shape, ", "), "]"));
    }
    if (spec.name.ends_with(".tid2eid")) {
      for (float v : (*tensor)->data) {
        if (v < 0 || v >= static_cast<float>(config.n_routed_experts) || std::floor(v) != v) {
          return absl::InvalidArgumentError(absl::StrCat("tensor ", spec.name, " holds expert id ",
                                                         v, " outside [0, ",
                                                         config.n_routed_experts, ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::engine
