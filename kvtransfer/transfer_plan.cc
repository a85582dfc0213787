#include "kvtransfer/transfer_plan.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

using serving::StateKind;

// Appends the page of `kind` at index `page` covering tokens [begin, end) of `layer`.
absl::Status Add(const serving::StateLayout& layout, const serving::PageTable& table,
                 StateKind kind, int64_t page, uint32_t layer, int64_t begin, int64_t end,
                 std::vector<PlannedPage>& plan) {
  const std::optional<int32_t> index = layout.KindIndex(kind);
  if (!index.has_value() || static_cast<size_t>(*index) >= table.pages.size() ||
      page >= static_cast<int64_t>(table.pages[*index].size())) {
    return absl::InvalidArgumentError(absl::StrCat("page table has no ",
                                                   serving::StateKindName(kind), " page ", page,
                                                   " (layer ", layer, ")"));
  }
  plan.push_back({table.pages[*index][page],
                  {.layer = layer,
                   .page_index = static_cast<uint32_t>(page),
                   .token_begin = static_cast<uint32_t>(begin),
                   .token_end = static_cast<uint32_t>(end),
                   .bytes = static_cast<uint64_t>(layout.Kind(kind).page_bytes()),
                   .element = layout.Element(kind)}});
  return absl::OkStatus();
}

}  // namespace

uint64_t TableEpoch(const serving::PageTable& table) {
  uint64_t epoch = std::numeric_limits<uint64_t>::max();
  for (const auto& kind : table.pages) {
    for (const serving::PageHandle& handle : kind) epoch = std::min(epoch, handle.epoch);
  }
  return epoch;
}

absl::StatusOr<std::vector<PlannedPage>> PlanTransfer(const serving::StateLayout& layout,
                                                      std::span<const LayerAttention> layers,
                                                      const serving::PageTable& table,
                                                      int64_t prompt_tokens, int64_t total_tokens) {
  const serving::StateDims& dims = layout.dims();
  const auto count = [&](LayerAttention type) {
    return static_cast<int64_t>(std::count(layers.begin(), layers.end(), type));
  };
  if (count(LayerAttention::kSliding) != dims.sliding_layers ||
      count(LayerAttention::kCsa) != dims.csa_layers ||
      count(LayerAttention::kHca) != dims.hca_layers) {
    return absl::InvalidArgumentError("layer types disagree with the state layout's layer counts");
  }
  if (prompt_tokens < 1 || prompt_tokens > total_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", prompt_tokens, " tokens for a total of ", total_tokens));
  }
  const serving::PageDemand demand = layout.Demand(total_tokens);
  for (size_t k = 0; k < demand.size(); ++k) {
    if (k >= table.pages.size() || static_cast<int64_t>(table.pages[k].size()) != demand[k]) {
      return absl::InvalidArgumentError(
          absl::StrCat("page table does not match the demand of ", total_tokens, " tokens"));
    }
  }
  std::vector<PlannedPage> plan;
  int64_t nth_csa = 0;
  int64_t nth_hca = 0;
  const int64_t per_page = dims.entries_per_page;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto layer = static_cast<uint32_t>(l);
    absl::Status added =
        Add(layout, table, StateKind::kWindow, layout.WindowSlot(layer, 0).page, layer,
            std::max<int64_t>(0, prompt_tokens - dims.sliding_window), prompt_tokens, plan);
    if (!added.ok()) return added;
    if (layers[l] == LayerAttention::kSliding) continue;
    const bool csa = layers[l] == LayerAttention::kCsa;
    const int64_t rate = csa ? dims.compress_rate_csa : dims.compress_rate_hca;
    const int64_t nth = csa ? nth_csa++ : nth_hca++;
    const int64_t entries = serving::StateLayout::Entries(prompt_tokens, rate);
    for (int64_t first = 0; first < entries; first += per_page) {
      const int64_t last = std::min(entries, first + per_page);
      const int64_t page = layout.CompressedSlot(csa, nth, first, total_tokens).page;
      added =
          Add(layout, table, StateKind::kCompressed, page, layer, first * rate, last * rate, plan);
      if (!added.ok()) return added;
      if (csa) {
        added = Add(layout, table, StateKind::kIndexer,
                    layout.IndexerSlot(nth, first, total_tokens).page, layer, first * rate,
                    last * rate, plan);
        if (!added.ok()) return added;
      }
    }
    added = Add(layout, table, csa ? StateKind::kCsaCompressor : StateKind::kHcaCompressor, nth,
                layer, entries * rate, prompt_tokens, plan);
    if (!added.ok()) return added;
  }
  return plan;
}

}  // namespace pdserve::kv
