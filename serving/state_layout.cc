#include "serving/state_layout.h"

#include "absl/strings/str_cat.h"

namespace pdserve::serving {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

const char* StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kWindow:
      return "window";
    case StateKind::kCompressed:
      return "compressed";
    case StateKind::kIndexer:
      return "indexer";
    case StateKind::kCsaCompressor:
      return "csa_compressor";
    case StateKind::kHcaCompressor:
      return "hca_compressor";
  }
  return "unknown";
}

std::string PoolKindLabel(const std::string& name) {
  if (name == "window") return "sliding";
  if (name == "compressed" || name == "indexer") return name;
  // colocated::ServiceOptions::device_state_tokens' ledger of the CUDA engine's page pools.
  if (name.starts_with("device_state")) return "device";
  return "compressor";
}

std::map<std::string, PoolPages> PoolPagesByLabel(const PagePool& pool) {
  std::map<std::string, PoolPages> by_label;
  for (int32_t k = 0; k < pool.num_kinds(); ++k) {
    PoolPages& pages = by_label[PoolKindLabel(pool.kind(k).name)];
    pages.used += pool.pages_used(k);
    pages.free += pool.pages_free(k);
  }
  return by_label;
}

absl::StatusOr<StateLayout> StateLayout::Create(const StateDims& dims) {
  if (dims.sliding_layers < 0 || dims.csa_layers < 0 || dims.hca_layers < 0 ||
      dims.sliding_layers + dims.csa_layers + dims.hca_layers == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "state layout needs non-negative layer counts with at least one layer, got sliding ",
        dims.sliding_layers, ", csa ", dims.csa_layers, ", hca ", dims.hca_layers));
  }
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"head_dim", dims.head_dim},
                                    {"index_head_dim", dims.index_head_dim},
                                    {"sliding_window", dims.sliding_window},
                                    {"compress_rate_csa", dims.compress_rate_csa},
                                    {"compress_rate_hca", dims.compress_rate_hca},
                                    {"entries_per_page", dims.entries_per_page}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be positive, got ", value));
    }
  }
  if (dims.index_head_dim > dims.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("index_head_dim (", dims.index_head_dim, ") must not exceed head_dim (",
                     dims.head_dim, "): indexer buffers share the CSA compressor page's rows"));
  }
  if (!IsElementType(static_cast<uint64_t>(dims.element))) {
    return absl::InvalidArgumentError("unknown state element type");
  }
  const int64_t element_bytes = ElementBytes(dims.element);
  if ((dims.head_dim * element_bytes) % 4 != 0 || (dims.index_head_dim * element_bytes) % 4 != 0) {
    return absl::InvalidArgumentError(
        "head_dim and index_head_dim rows must be multiples of 4 bytes");
  }
  return StateLayout(dims);
}

StateLayout::StateLayout(const StateDims& dims) : dims_(dims) {
  const int64_t attention_layers = dims.sliding_layers + dims.csa_layers + dims.hca_layers;
  const std::array<int64_t, kNumStateKinds> layers = {
      attention_layers, dims.csa_layers + dims.hca_layers, dims.csa_layers, dims.csa_layers,
      dims.hca_layers};
  int32_t next = 0;
  for (int k = 0; k < kNumStateKinds; ++k) {
    if (layers[k] > 0) kind_index_[k] = next++;
  }
}

ElementType StateLayout::Element(StateKind kind) const {
  return kind == StateKind::kCsaCompressor || kind == StateKind::kHcaCompressor
             ? ElementType::kFloat32
             : dims_.element;
}

PageKind StateLayout::Kind(StateKind kind) const {
  const int64_t d = dims_.head_dim * ElementBytes(Element(kind));
  switch (kind) {
    case StateKind::kWindow:
      return {StateKindName(kind), 0, dims_.sliding_window, d};
    case StateKind::kCompressed:
      return {StateKindName(kind), 0, dims_.entries_per_page, d};
    case StateKind::kIndexer:
      return {StateKindName(kind), 0, dims_.entries_per_page,
              dims_.index_head_dim * ElementBytes(Element(kind))};
    case StateKind::kCsaCompressor:
      // Rows are 4D wide: m open-window rows [kv 2D | gate 2D], m indexer open-window rows
      // [kv 2I | gate 2I], m overlap rows [Ca kv D | Ca gate D | indexer Ca kv I | Ca gate I].
      return {StateKindName(kind), 0, 3 * dims_.compress_rate_csa, 4 * d};
    case StateKind::kHcaCompressor:
      // m' rows [kv D | gate D]; no overlap (HCA windows do not overlap).
      return {StateKindName(kind), 0, dims_.compress_rate_hca, 2 * d};
  }
  return {};
}

int64_t StateLayout::EntryPages(int64_t total_tokens, int64_t rate) const {
  return CeilDiv(Entries(total_tokens, rate), dims_.entries_per_page);
}

PagePoolOptions StateLayout::PoolOptions(int64_t max_sequences, int64_t token_capacity) const {
  const int64_t csa_pages = EntryPages(token_capacity, dims_.compress_rate_csa) + max_sequences;
  const int64_t hca_pages = EntryPages(token_capacity, dims_.compress_rate_hca) + max_sequences;
  const std::array<int64_t, kNumStateKinds> pages = {
      max_sequences * (dims_.sliding_layers + dims_.csa_layers + dims_.hca_layers),
      dims_.csa_layers * csa_pages + dims_.hca_layers * hca_pages, dims_.csa_layers * csa_pages,
      max_sequences * dims_.csa_layers, max_sequences * dims_.hca_layers};
  PagePoolOptions options;
  for (int k = 0; k < kNumStateKinds; ++k) {
    if (!kind_index_[k]) continue;
    PageKind kind = Kind(static_cast<StateKind>(k));
    kind.num_pages = pages[k];
    options.kinds.push_back(kind);
  }
  return options;
}

PageDemand StateLayout::Demand(int64_t total_tokens) const {
  const int64_t csa_pages = EntryPages(total_tokens, dims_.compress_rate_csa);
  const int64_t hca_pages = EntryPages(total_tokens, dims_.compress_rate_hca);
  const std::array<int64_t, kNumStateKinds> pages = {
      dims_.sliding_layers + dims_.csa_layers + dims_.hca_layers,
      dims_.csa_layers * csa_pages + dims_.hca_layers * hca_pages, dims_.csa_layers * csa_pages,
      dims_.csa_layers, dims_.hca_layers};
  PageDemand demand;
  for (int k = 0; k < kNumStateKinds; ++k) {
    if (kind_index_[k]) demand.push_back(pages[k]);
  }
  return demand;
}

StateSlot StateLayout::WindowSlot(int64_t layer, int64_t position) const {
  return {layer, position % dims_.sliding_window};
}

StateSlot StateLayout::CompressedSlot(bool csa, int64_t nth, int64_t entry,
                                      int64_t total_tokens) const {
  const int64_t csa_pages = EntryPages(total_tokens, dims_.compress_rate_csa);
  const int64_t first_page =
      csa ? nth * csa_pages
          : dims_.csa_layers * csa_pages + nth * EntryPages(total_tokens, dims_.compress_rate_hca);
  return {first_page + entry / dims_.entries_per_page, entry % dims_.entries_per_page};
}

StateSlot StateLayout::IndexerSlot(int64_t nth, int64_t entry, int64_t total_tokens) const {
  return {nth * EntryPages(total_tokens, dims_.compress_rate_csa) + entry / dims_.entries_per_page,
          entry % dims_.entries_per_page};
}

}  // namespace pdserve::serving
