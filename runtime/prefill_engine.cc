#include "runtime/prefill_engine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::runtime {
namespace {

class CpuEngine final : public PrefillEngine {
 public:
  CpuEngine(const engine::Model& model, int64_t prefill_block)
      : model_(model), prefill_block_(prefill_block) {}

  absl::StatusOr<std::vector<float>> Run(std::span<const int32_t> prompt,
                                         const runtime::PagedState& paged,
                                         const runtime::SequencePages& pages,
                                         const LayerStored& layer_stored,
                                         const ChunkDone& chunk_done) override {
    if (prompt.empty()) return absl::InvalidArgumentError("the prompt is empty");
    const auto length = static_cast<int64_t>(prompt.size());
    absl::Status storing;  // the first failure of the final block's per-layer stores
    bool final_block = false;
    // Every chunk reports its layers' progress; the final one also stores each layer's state.
    const engine::Model::LayerHook after_layer = [&](int64_t layer, const engine::LayerState& ls,
                                                     int64_t position) {
      NoteLayerForwarded(layer);
      if (!final_block || !storing.ok()) return;
      storing = paged.StoreLayer(layer, ls, position, 0, pages);
      if (storing.ok()) storing = layer_stored(layer);
    };
    engine::ModelState state = model_.NewState();
    engine::Tensor logits;
    for (int64_t from = 0; from < length;) {
      const int64_t to = PrefillBlockEnd(from, length, prefill_block_);
      const std::vector<int32_t> tokens(prompt.begin() + from, prompt.begin() + to);
      final_block = to == length;
      // Only the prompt's last row is sampled from: the head runs on each chunk's last row.
      PDSERVE_ASSIGN_OR_RETURN(
          logits, model_.Forward(&state, tokens, after_layer, engine::ChunkLogits::kLastRow));
      PDSERVE_RETURN_IF_ERROR(storing);
      PDSERVE_RETURN_IF_ERROR(chunk_done(to - from));
      from = to;
    }
    const int64_t vocab = logits.dim(1);
    const float* last = logits.ptr() + (logits.dim(0) - 1) * vocab;
    return std::vector<float>(last, last + vocab);
  }

  int64_t max_context() const override { return model_.config().max_position_embeddings; }
  std::string Describe() const override { return "cpu"; }

 private:
  const engine::Model& model_;
  int64_t prefill_block_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillEngine>> CpuPrefillEngine(const engine::Model& model,
                                                                int64_t prefill_block) {
  if (prefill_block < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefill_block ", prefill_block, " < 1"));
  }
  return std::make_unique<CpuEngine>(model, prefill_block);
}

}  // namespace pdserve::runtime
