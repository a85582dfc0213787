#include "runtime/paged_state.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::runtime {
namespace {

using engine::LayerType;
using serving::StateKind;
using serving::StateSlot;

void CopyFloats(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

absl::StatusOr<serving::StateLayout> LayoutForModel(const engine::ModelConfig& config,
                                                    int64_t entries_per_page) {
  serving::StateDims dims;
  for (LayerType type : config.layer_types) {
    switch (type) {
      case LayerType::kSlidingAttention:
        ++dims.sliding_layers;
        break;
      case LayerType::kCompressedSparseAttention:
        ++dims.csa_layers;
        break;
      case LayerType::kHeavilyCompressedAttention:
        ++dims.hca_layers;
        break;
    }
  }
  dims.head_dim = config.head_dim;
  dims.index_head_dim = config.index_head_dim;
  dims.sliding_window = config.sliding_window;
  dims.compress_rate_csa = config.compress_rate_csa;
  dims.compress_rate_hca = config.compress_rate_hca;
  dims.element_bytes = sizeof(float);
  dims.entries_per_page = entries_per_page;
  return serving::StateLayout::Create(dims);
}

absl::StatusOr<SequencePages> MapPages(serving::PagePool& pool, const serving::PageTable& table) {
  SequencePages out;
  out.pages.resize(table.pages.size());
  for (size_t k = 0; k < table.pages.size(); ++k) {
    for (const serving::PageHandle& handle : table.pages[k]) {
      PDSERVE_ASSIGN_OR_RETURN(std::span<std::byte> bytes, pool.Data(table.owner, handle));
      out.pages[k].push_back(bytes);
    }
  }
  return out;
}

PagedState::PagedState(const engine::ModelConfig& config, const serving::StateLayout& layout,
                       int64_t total_tokens)
    : config_(config), layout_(layout), total_tokens_(total_tokens) {
  int64_t csa = 0;
  int64_t hca = 0;
  for (LayerType type : config.layer_types) {
    const int64_t nth = type == LayerType::kCompressedSparseAttention    ? csa++
                        : type == LayerType::kHeavilyCompressedAttention ? hca++
                                                                         : 0;
    layers_.push_back({type, nth});
  }
}

absl::StatusOr<float*> PagedState::Row(const SequencePages& pages, StateKind kind,
                                       StateSlot slot) const {
  const std::optional<int32_t> k = layout_.KindIndex(kind);
  if (!k || static_cast<size_t>(*k) >= pages.pages.size() ||
      slot.page >= static_cast<int64_t>(pages.pages[*k].size())) {
    return absl::OutOfRangeError(absl::StrCat("sequence has no ", serving::StateKindName(kind),
                                              " page ", slot.page, " (", total_tokens_,
                                              " tokens)"));
  }
  const int64_t row_bytes = layout_.Kind(kind).row_bytes;
  return reinterpret_cast<float*>(pages.pages[*k][slot.page].data() + slot.row * row_bytes);
}

absl::Status PagedState::CheckState(const engine::ModelState& state, int64_t position) const {
  if (state.layers.size() != layers_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("state has ", state.layers.size(), " layers, the model ", layers_.size()));
  }
  if (position < 0 || position > total_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrCat("state position ", position, " outside [0, ", total_tokens_, "]"));
  }
  return absl::OkStatus();
}

absl::Status PagedState::Store(const engine::ModelState& state, int64_t from_position,
                               const SequencePages& pages) const {
  PDSERVE_RETURN_IF_ERROR(CheckState(state, state.position));
  for (size_t l = 0; l < layers_.size(); ++l) {
    PDSERVE_RETURN_IF_ERROR(
        StoreLayer(static_cast<int64_t>(l), state.layers[l], state.position, from_position, pages));
  }
  return absl::OkStatus();
}

absl::Status PagedState::StoreLayer(int64_t layer, const engine::LayerState& ls, int64_t position,
                                    int64_t from_position, const SequencePages& pages) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size()) || position < 0 ||
      position > total_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " at position ", position,
                                                   " is outside the model or [0, ", total_tokens_,
                                                   "]"));
  }
  const int64_t p = position;
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  const size_t l = static_cast<size_t>(layer);
  const int64_t first = p - ls.window_kv.dim(0);
  for (int64_t pos = std::max(first, from_position); pos < p; ++pos) {
    PDSERVE_ASSIGN_OR_RETURN(float* row,
                             Row(pages, StateKind::kWindow, layout_.WindowSlot(layer, pos)));
    CopyFloats(row, ls.window_kv.ptr() + (pos - first) * hd, hd);
  }
  const LayerInfo& info = layers_[l];
  if (info.type == LayerType::kSlidingAttention) return absl::OkStatus();
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  const engine::CompressorState& comp = ls.compressor;
  for (int64_t e = from_position / rate; e < comp.entries.dim(0); ++e) {
    PDSERVE_ASSIGN_OR_RETURN(float* row,
                             Row(pages, StateKind::kCompressed,
                                 layout_.CompressedSlot(csa, info.nth, e, total_tokens_)));
    CopyFloats(row, comp.entries.ptr() + e * hd, hd);
  }
  const int64_t open_first = p - comp.buffer_kv.dim(0);
  if (!csa) {
    for (int64_t r = 0; r < comp.buffer_kv.dim(0); ++r) {
      PDSERVE_ASSIGN_OR_RETURN(
          float* row, Row(pages, StateKind::kHcaCompressor, {info.nth, (open_first + r) % rate}));
      CopyFloats(row, comp.buffer_kv.ptr() + r * hd, hd);
      CopyFloats(row + hd, comp.buffer_gate.ptr() + r * hd, hd);
    }
    return absl::OkStatus();
  }
  const engine::CompressorState& idx = ls.indexer;
  for (int64_t e = from_position / rate; e < idx.entries.dim(0); ++e) {
    PDSERVE_ASSIGN_OR_RETURN(float* row, Row(pages, StateKind::kIndexer,
                                             layout_.IndexerSlot(info.nth, e, total_tokens_)));
    CopyFloats(row, idx.entries.ptr() + e * ihd, ihd);
  }
  for (int64_t r = 0; r < comp.buffer_kv.dim(0); ++r) {
    const int64_t slot = (open_first + r) % rate;
    PDSERVE_ASSIGN_OR_RETURN(float* row, Row(pages, StateKind::kCsaCompressor, {info.nth, slot}));
    CopyFloats(row, comp.buffer_kv.ptr() + r * 2 * hd, 2 * hd);
    CopyFloats(row + 2 * hd, comp.buffer_gate.ptr() + r * 2 * hd, 2 * hd);
    PDSERVE_ASSIGN_OR_RETURN(row, Row(pages, StateKind::kCsaCompressor, {info.nth, rate + slot}));
    CopyFloats(row, idx.buffer_kv.ptr() + r * 2 * ihd, 2 * ihd);
    CopyFloats(row + 2 * ihd, idx.buffer_gate.ptr() + r * 2 * ihd, 2 * ihd);
  }
  for (int64_t r = 0; r < comp.overlap_kv.dim(0); ++r) {
    PDSERVE_ASSIGN_OR_RETURN(float* row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
    CopyFloats(row, comp.overlap_kv.ptr() + r * hd, hd);
    CopyFloats(row + hd, comp.overlap_gate.ptr() + r * hd, hd);
    CopyFloats(row + 2 * hd, idx.overlap_kv.ptr() + r * ihd, ihd);
    CopyFloats(row + 2 * hd + ihd, idx.overlap_gate.ptr() + r * ihd, ihd);
  }
  return absl::OkStatus();
}

absl::Status PagedState::Load(int64_t position, const SequencePages& pages,
                              engine::ModelState* state) const {
  PDSERVE_RETURN_IF_ERROR(CheckState(*state, position));
  if (state->position != 0) {
    return absl::InvalidArgumentError("PagedState::Load needs a fresh Model::NewState()");
  }
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  std::vector<float> scratch(static_cast<size_t>(4 * hd));
  for (size_t l = 0; l < layers_.size(); ++l) {
    engine::LayerState& ls = state->layers[l];
    const int64_t window_rows =
        std::min(position, std::max<int64_t>(config_.sliding_window - 1, 0));
    for (int64_t pos = position - window_rows; pos < position; ++pos) {
      PDSERVE_ASSIGN_OR_RETURN(float* row, Row(pages, StateKind::kWindow,
                                               layout_.WindowSlot(static_cast<int64_t>(l), pos)));
      engine::AppendRows(&ls.window_kv, row, 1);
    }
    const LayerInfo& info = layers_[l];
    if (info.type == LayerType::kSlidingAttention) continue;
    const bool csa = info.type == LayerType::kCompressedSparseAttention;
    const int64_t rate = config_.CompressRate(info.type);
    engine::CompressorState& comp = ls.compressor;
    for (int64_t e = 0; e < position / rate; ++e) {
      PDSERVE_ASSIGN_OR_RETURN(float* row,
                               Row(pages, StateKind::kCompressed,
                                   layout_.CompressedSlot(csa, info.nth, e, total_tokens_)));
      engine::AppendRows(&comp.entries, row, 1);
    }
    const int64_t open_first = position - position % rate;
    if (!csa) {
      for (int64_t pos = open_first; pos < position; ++pos) {
        PDSERVE_ASSIGN_OR_RETURN(float* row,
                                 Row(pages, StateKind::kHcaCompressor, {info.nth, pos % rate}));
        engine::AppendRows(&comp.buffer_kv, row, 1);
        engine::AppendRows(&comp.buffer_gate, row + hd, 1);
      }
      continue;
    }
    engine::CompressorState& idx = ls.indexer;
    for (int64_t e = 0; e < position / rate; ++e) {
      PDSERVE_ASSIGN_OR_RETURN(float* row, Row(pages, StateKind::kIndexer,
                                               layout_.IndexerSlot(info.nth, e, total_tokens_)));
      engine::AppendRows(&idx.entries, row, 1);
    }
    for (int64_t pos = open_first; pos < position; ++pos) {
      PDSERVE_ASSIGN_OR_RETURN(float* row,
                               Row(pages, StateKind::kCsaCompressor, {info.nth, pos % rate}));
      engine::AppendRows(&comp.buffer_kv, row, 1);
      engine::AppendRows(&comp.buffer_gate, row + 2 * hd, 1);
      PDSERVE_ASSIGN_OR_RETURN(
          row, Row(pages, StateKind::kCsaCompressor, {info.nth, rate + pos % rate}));
      engine::AppendRows(&idx.buffer_kv, row, 1);
      engine::AppendRows(&idx.buffer_gate, row + 2 * ihd, 1);
    }
    if (position < rate) continue;
    for (int64_t r = 0; r < rate; ++r) {
      PDSERVE_ASSIGN_OR_RETURN(float* row,
                               Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
      engine::AppendRows(&comp.overlap_kv, row, 1);
      engine::AppendRows(&comp.overlap_gate, row + hd, 1);
      engine::AppendRows(&idx.overlap_kv, row + 2 * hd, 1);
      engine::AppendRows(&idx.overlap_gate, row + 2 * hd + ihd, 1);
    }
  }
  state->position = position;
  return absl::OkStatus();
}

}  // namespace pdserve::runtime
