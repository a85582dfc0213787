// The model as both workers load it: its config, the CPU engine (only where the worker computes
// on it), the end-of-sequence ids, the state page layout and the per-layer attention types
// kv::PlanTransfer needs. Both workers plan a request's
// transfer from the same config, so slot i names the same state on both.
// Thread-safety: immutable after LoadWorkerModel; share freely.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/deploy_config.h"
#include "engine/config.h"
#include "engine/model.h"
#include "kvtransfer/transfer_plan.h"
#include "serving/state_layout.h"
#include "structured/token_vocabulary.h"

namespace pdserve::worker {

struct WorkerModel {
  engine::ModelConfig config;
  // The CPU engine (weights in host memory); null when loaded without it (a backend cuda worker,
  // whose weights live on the GPU: loading both would hold the model twice in host memory).
  std::unique_ptr<engine::Model> model;
  std::vector<int32_t> eos_ids;  // generation_config.json's, else config.json's (as colocated)
  std::unique_ptr<serving::StateLayout> layout;  // runtime::LayoutForModel: the page format
  std::vector<kv::LayerAttention> layers;
  // The tokenizer's tokens as bytes, for response_format's token mask; null when the model
  // directory has no tokenizer.json (then such requests are refused).
  std::shared_ptr<const structured::TokenVocabulary> vocabulary;
  // The model identity a worker states in Health (and the decode worker in its tickets):
  // common::ModelFingerprint of the model directory, and PageGeometry of layout and layers.
  uint64_t fingerprint = 0;
  std::string page_geometry;
};

// Errors: loading the model (config.json; with `cpu_engine` also the weights) or
// generation_config.json; an unusable layout; a tokenizer.json that is there but does not load.
// `options`: the implementation switches and test-only faults (engine/model_options.h).
// `cpu_engine` false: config only, `model` stays null.
absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& model_dir,
                                            engine::ModelOptions options = {},
                                            bool cpu_engine = true);

// The engine options of a worker of `deploy` on `backend` ("cpu" / "cuda"):
// guards.reference_kernels (validated) and the test-only faults of the environment
// (engine::WithTestFaultsFromEnvironment). Logs the CPU engine's implementation summary (backend
// cpu only: the CUDA workers log their own line), and the test-fault warning when one is on.
// InvalidArgument for an unknown reference kernel name.
absl::StatusOr<engine::ModelOptions> WorkerModelOptions(const config::DeployConfig& deploy,
                                                        const std::string& backend);

std::vector<kv::LayerAttention> LayerAttentions(const engine::ModelConfig& config);

// The page geometry the state transfer relies on, as text: the layers' attention types in order
// (s sliding, c CSA, h HCA), head_dim, index_head_dim, sliding_window, both compression rates and
// entries_per_page, e.g. "layers=sch head_dim=64 index_head_dim=32 window=16 rate_csa=4
// rate_hca=16 entries_per_page=64". Two workers with the same text plan the same pages for a
// request. The element type is left out: a CPU (fp32) and a CUDA (bf16) worker exchange pages.
std::string PageGeometry(const serving::StateLayout& layout,
                         const std::vector<kv::LayerAttention>& layers);

}  // namespace pdserve::worker
