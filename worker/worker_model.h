// The model as both workers load it: the engine, the end-of-sequence ids, the state page layout
// and the per-layer attention types kv::PlanTransfer needs. Both workers plan a request's
// transfer from the same config, so slot i names the same state on both.
// Thread-safety: immutable after LoadWorkerModel; share freely.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/config.h"
#include "engine/model.h"
#include "kvtransfer/transfer_plan.h"
#include "serving/state_layout.h"

namespace pdserve::worker {

struct WorkerModel {
  std::unique_ptr<engine::Model> model;
  std::vector<int32_t> eos_ids;  // generation_config.json's, else config.json's (as colocated)
  std::unique_ptr<serving::StateLayout> layout;  // colocated::LayoutForModel: the page format
  std::vector<kv::LayerAttention> layers;
};

// Errors: loading the model or generation_config.json; an unusable layout.
absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& model_dir);

std::vector<kv::LayerAttention> LayerAttentions(const engine::ModelConfig& config);

}  // namespace pdserve::worker
