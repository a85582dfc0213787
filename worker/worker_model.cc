#include "worker/worker_model.h"

#include <utility>

#include "colocated/paged_state.h"
#include "common/status.h"
#include "serving/generation_config.h"

namespace pdserve::worker {

absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& model_dir) {
  WorkerModel w;
  PDSERVE_ASSIGN_OR_RETURN(engine::Model model, engine::Model::Load(model_dir));
  w.model = std::make_unique<engine::Model>(std::move(model));
  const engine::ModelConfig& config = w.model->config();
  PDSERVE_ASSIGN_OR_RETURN(serving::GenerationConfig generation,
                           serving::GenerationConfig::Load(model_dir));
  w.eos_ids = generation.eos_token_ids;
  if (w.eos_ids.empty()) {
    for (int64_t id : config.eos_token_ids) w.eos_ids.push_back(static_cast<int32_t>(id));
  }
  PDSERVE_ASSIGN_OR_RETURN(serving::StateLayout layout, colocated::LayoutForModel(config));
  w.layout = std::make_unique<serving::StateLayout>(layout);
  w.layers = LayerAttentions(config);
  return w;
}

std::vector<kv::LayerAttention> LayerAttentions(const engine::ModelConfig& config) {
  std::vector<kv::LayerAttention> layers;
  for (engine::LayerType type : config.layer_types) {
    switch (type) {
      case engine::LayerType::kSlidingAttention:
        layers.push_back(kv::LayerAttention::kSliding);
        break;
      case engine::LayerType::kCompressedSparseAttention:
        layers.push_back(kv::LayerAttention::kCsa);
        break;
      case engine::LayerType::kHeavilyCompressedAttention:
        layers.push_back(kv::LayerAttention::kHca);
        break;
    }
  }
  return layers;
}

}  // namespace pdserve::worker
