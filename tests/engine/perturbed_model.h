// A checkpoint with one value moved, for tests that show a comparison against reference logits
// can fail. Test-only.
#pragma once

#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "common/status.h"
#include "engine/config.h"
#include "engine/model.h"
#include "engine/weights.h"

namespace pdserve::engine::testing {

// Loads the model in `dir` with element 0 of tensor `name` (a canonical name) increased by
// `delta`. Errors: those of ModelConfig::Load, Weights::Load / Get and Model::FromWeights.
inline absl::StatusOr<Model> LoadPerturbedModel(const std::string& dir, const std::string& name,
                                                float delta) {
  PDSERVE_ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Load(dir));
  PDSERVE_ASSIGN_OR_RETURN(Weights weights, Weights::Load(dir, config));
  PDSERVE_ASSIGN_OR_RETURN(const Tensor* original, weights.Get(name));
  Tensor perturbed = *original;
  perturbed.data[0] += delta;
  weights.Set(name, std::move(perturbed));
  return Model::FromWeights(std::move(config), std::move(weights));
}

}  // namespace pdserve::engine::testing
