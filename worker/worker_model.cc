#include "worker/worker_model.h"

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/model_fingerprint.h"
#include "common/status.h"
#include "runtime/paged_state.h"
#include "serving/generation_config.h"
#include "spdlog/spdlog.h"
#include "text/tokenizer.h"

namespace pdserve::worker {

absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& model_dir,
                                            engine::ModelOptions options, bool cpu_engine) {
  WorkerModel w;
  if (cpu_engine) {
    PDSERVE_ASSIGN_OR_RETURN(engine::Model model,
                             engine::Model::Load(model_dir, std::move(options)));
    w.model = std::make_unique<engine::Model>(std::move(model));
    w.config = w.model->config();
  } else {
    PDSERVE_ASSIGN_OR_RETURN(w.config, engine::ModelConfig::Load(model_dir));
  }
  const engine::ModelConfig& config = w.config;
  PDSERVE_ASSIGN_OR_RETURN(serving::GenerationConfig generation,
                           serving::GenerationConfig::Load(model_dir));
  w.eos_ids = generation.eos_token_ids;
  if (w.eos_ids.empty()) {
    for (int64_t id : config.eos_token_ids) w.eos_ids.push_back(static_cast<int32_t>(id));
  }
  // Pages hold the engine's own storage type: fp32 for the CPU engine, bf16 for the CUDA engine
  // (what travels on the wire; docs/protocol.md, "Element types").
  PDSERVE_ASSIGN_OR_RETURN(
      serving::StateLayout layout,
      runtime::LayoutForModel(config, 64, runtime::StorageElement(/*cuda=*/!cpu_engine)));
  w.layout = std::make_unique<serving::StateLayout>(layout);
  w.layers = LayerAttentions(config);
  if (std::filesystem::exists(std::filesystem::path(model_dir) / "tokenizer.json")) {
    PDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<text::Tokenizer> tokenizer,
                             text::Tokenizer::Load(model_dir));
    PDSERVE_ASSIGN_OR_RETURN(w.vocabulary, structured::TokenVocabulary::FromTokenizer(*tokenizer));
  }
  PDSERVE_ASSIGN_OR_RETURN(w.fingerprint, common::ModelFingerprint(model_dir));
  w.page_geometry = PageGeometry(*w.layout, w.layers);
  // What Health states, as the router's identity log prints it (docs/operations.md).
  spdlog::info("model identity of {}: fingerprint {}, geometry {}", model_dir,
               common::FingerprintText(w.fingerprint), w.page_geometry);
  return w;
}

absl::StatusOr<engine::ModelOptions> WorkerModelOptions(const config::DeployConfig& deploy,
                                                        const std::string& backend) {
  engine::ModelOptions options;
  PDSERVE_ASSIGN_OR_RETURN(options.reference_pieces,
                           engine::ParseReferencePieces(deploy.guards.reference_kernels));
  options = engine::WithTestFaultsFromEnvironment(std::move(options));
  if (const std::string warning = engine::TestFaultWarning(options); !warning.empty()) {
    spdlog::warn("{}", warning);
  }
  if (backend == "cpu") spdlog::info("{}", engine::ImplementationSummary(options));
  return options;
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

std::string PageGeometry(const serving::StateLayout& layout,
                         const std::vector<kv::LayerAttention>& layers) {
  std::string types;
  for (kv::LayerAttention layer : layers) {
    types += layer == kv::LayerAttention::kSliding ? 's'
             : layer == kv::LayerAttention::kCsa   ? 'c'
                                                   : 'h';
  }
  const serving::StateDims& d = layout.dims();
  return absl::StrCat("layers=", types, " head_dim=", d.head_dim,
                      " index_head_dim=", d.index_head_dim, " window=", d.sliding_window,
                      " rate_csa=", d.compress_rate_csa, " rate_hca=", d.compress_rate_hca,
                      " entries_per_page=", d.entries_per_page);
}

}  // namespace pdserve::worker
