#include "runtime/paged_state.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::runtime {
namespace {

using engine::LayerType;
using serving::StateKind;
using serving::StateSlot;

// Appends one row of t's width, read from `row` at element offset `at`. An fp32 row is appended
// straight from the page; a bf16 row is widened through `scratch`.
void AppendRow(engine::Tensor* t, const PagedState::RowRef& row, int64_t at,
               std::vector<float>* scratch) {
  const int64_t width = t->dim(1);
  if (row.type == serving::ElementType::kFloat32) {
    engine::AppendRows(t, reinterpret_cast<const float*>(row.data) + at, 1);
    return;
  }
  scratch->resize(static_cast<size_t>(width));
  row.Get(at, width, scratch->data());
  engine::AppendRows(t, scratch->data(), 1);
}

// Runs task(0 .. n - 1) on `pool`, or in order on this thread without one.
void RunTasks(TaskPool* pool, int64_t n, const std::function<void(int64_t)>& task) {
  if (pool == nullptr) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  pool->Run(n, task);
}

}  // namespace

void PagedState::RowRef::Put(int64_t at, const float* from, int64_t n) const {
  serving::StoreElements(from, n, type, data + at * serving::ElementBytes(type));
}

void PagedState::RowRef::PutBf16(int64_t at, const uint16_t* from, int64_t n) const {
  if (type == serving::ElementType::kBfloat16) {
    std::memcpy(data + at * 2, from, static_cast<size_t>(n) * sizeof(uint16_t));
    return;
  }
  float* to = reinterpret_cast<float*>(data) + at;
  for (int64_t i = 0; i < n; ++i) to[i] = serving::Bf16ToFloat(from[i]);
}

void PagedState::RowRef::Get(int64_t at, int64_t n, float* to) const {
  serving::LoadElements(data + at * serving::ElementBytes(type), type, n, to);
}

void PagedState::RowRef::GetBf16(int64_t at, int64_t n, uint16_t* to) const {
  if (type == serving::ElementType::kBfloat16) {
    std::memcpy(to, data + at * 2, static_cast<size_t>(n) * sizeof(uint16_t));
    return;
  }
  const float* from = reinterpret_cast<const float*>(data) + at;
  for (int64_t i = 0; i < n; ++i) to[i] = serving::FloatToBf16(from[i]);
}

absl::StatusOr<serving::StateLayout> LayoutForModel(const engine::ModelConfig& config,
                                                    int64_t entries_per_page,
                                                    serving::ElementType element) {
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
  dims.element = element;
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

absl::StatusOr<PagedState::RowRef> PagedState::Row(const SequencePages& pages, StateKind kind,
                                                   StateSlot slot) const {
  const std::optional<int32_t> k = layout_.KindIndex(kind);
  if (!k || static_cast<size_t>(*k) >= pages.pages.size() ||
      slot.page >= static_cast<int64_t>(pages.pages[*k].size())) {
    return absl::OutOfRangeError(absl::StrCat("sequence has no ", serving::StateKindName(kind),
                                              " page ", slot.page, " (", total_tokens_,
                                              " tokens)"));
  }
  const int64_t row_bytes = layout_.Kind(kind).row_bytes;
  return RowRef{pages.pages[*k][slot.page].data() + slot.row * row_bytes, layout_.Element(kind)};
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

absl::Status PagedState::CheckLayerPosition(int64_t layer, int64_t position) const {
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size()) || position < 0 ||
      position > total_tokens_) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " at position ", position,
                                                   " is outside the model or [0, ", total_tokens_,
                                                   "]"));
  }
  return absl::OkStatus();
}

absl::Status PagedState::StoreLayer(int64_t layer, const engine::LayerState& ls, int64_t position,
                                    int64_t from_position, const SequencePages& pages) const {
  PDSERVE_RETURN_IF_ERROR(CheckLayerPosition(layer, position));
  const int64_t p = position;
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  const size_t l = static_cast<size_t>(layer);
  const int64_t first = p - ls.window_kv.dim(0);
  for (int64_t pos = std::max(first, from_position); pos < p; ++pos) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kWindow, layout_.WindowSlot(layer, pos)));
    row.Put(0, ls.window_kv.ptr() + (pos - first) * hd, hd);
  }
  const LayerInfo& info = layers_[l];
  if (info.type == LayerType::kSlidingAttention) return absl::OkStatus();
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  const engine::CompressorState& comp = ls.compressor;
  for (int64_t e = from_position / rate; e < comp.entries.dim(0); ++e) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCompressed,
                                 layout_.CompressedSlot(csa, info.nth, e, total_tokens_)));
    row.Put(0, comp.entries.ptr() + e * hd, hd);
  }
  const int64_t open_first = p - comp.buffer_kv.dim(0);
  if (!csa) {
    for (int64_t r = 0; r < comp.buffer_kv.dim(0); ++r) {
      PDSERVE_ASSIGN_OR_RETURN(
          RowRef row, Row(pages, StateKind::kHcaCompressor, {info.nth, (open_first + r) % rate}));
      row.Put(0, comp.buffer_kv.ptr() + r * hd, hd);
      row.Put(hd, comp.buffer_gate.ptr() + r * hd, hd);
    }
    return absl::OkStatus();
  }
  const engine::CompressorState& idx = ls.indexer;
  for (int64_t e = from_position / rate; e < idx.entries.dim(0); ++e) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row, Row(pages, StateKind::kIndexer,
                                             layout_.IndexerSlot(info.nth, e, total_tokens_)));
    row.Put(0, idx.entries.ptr() + e * ihd, ihd);
  }
  for (int64_t r = 0; r < comp.buffer_kv.dim(0); ++r) {
    const int64_t slot = (open_first + r) % rate;
    PDSERVE_ASSIGN_OR_RETURN(RowRef row, Row(pages, StateKind::kCsaCompressor, {info.nth, slot}));
    row.Put(0, comp.buffer_kv.ptr() + r * 2 * hd, 2 * hd);
    row.Put(2 * hd, comp.buffer_gate.ptr() + r * 2 * hd, 2 * hd);
    PDSERVE_ASSIGN_OR_RETURN(row, Row(pages, StateKind::kCsaCompressor, {info.nth, rate + slot}));
    row.Put(0, idx.buffer_kv.ptr() + r * 2 * ihd, 2 * ihd);
    row.Put(2 * ihd, idx.buffer_gate.ptr() + r * 2 * ihd, 2 * ihd);
  }
  for (int64_t r = 0; r < comp.overlap_kv.dim(0); ++r) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
    row.Put(0, comp.overlap_kv.ptr() + r * hd, hd);
    row.Put(hd, comp.overlap_gate.ptr() + r * hd, hd);
    row.Put(2 * hd, idx.overlap_kv.ptr() + r * ihd, ihd);
    row.Put(2 * hd + ihd, idx.overlap_gate.ptr() + r * ihd, ihd);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<PagedState::SlotRun>> PagedState::PlanSlotRuns(
    int64_t layer, const engine::RingLayerGeometry& g, int64_t position) const {
  PDSERVE_RETURN_IF_ERROR(CheckLayerPosition(layer, position));
  const int64_t p = position;
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  std::vector<SlotRun> runs;
  // Window: the ring's row q % W holds position q, the page's row q % sliding_window; the last
  // min(p, W - 1) positions are kept. A run ends where either wraps.
  const int64_t page_window = config_.sliding_window;
  for (int64_t q = p - std::min(p, std::max<int64_t>(g.window - 1, 0)); q < p;) {
    const int64_t rows = std::min({p - q, g.window - q % g.window, page_window - q % page_window});
    runs.push_back({StateKind::kWindow, layout_.WindowSlot(layer, q), RowRun::kWindow,
                    q % g.window * hd, rows * hd});
    q += rows;
  }
  const LayerInfo& info = layers_[static_cast<size_t>(layer)];
  if (info.type == LayerType::kSlidingAttention) return runs;
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  // Entries: entry e is row e % E of the layer's page e / E, row e of the block.
  const int64_t per_page = layout_.dims().entries_per_page;
  auto entries = [&](RowRun::Block block, int64_t width) {
    for (int64_t e = 0; e < p / rate;) {
      const int64_t rows = std::min(p / rate - e, per_page - e % per_page);
      runs.push_back(block == RowRun::kEntries
                         ? SlotRun{StateKind::kCompressed,
                                   layout_.CompressedSlot(csa, info.nth, e, total_tokens_), block,
                                   e * width, rows * width}
                         : SlotRun{StateKind::kIndexer,
                                   layout_.IndexerSlot(info.nth, e, total_tokens_), block,
                                   e * width, rows * width});
      e += rows;
    }
  };
  entries(RowRun::kEntries, hd);
  if (csa) entries(RowRun::kIndexerEntries, ihd);
  return runs;
}

absl::StatusOr<std::vector<PagedState::RowRun>> PagedState::PlanRowRuns(
    int64_t layer, const engine::RingLayerGeometry& g, int64_t position,
    const SequencePages& pages) const {
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<SlotRun> slot_runs, PlanSlotRuns(layer, g, position));
  std::vector<RowRun> runs;
  runs.reserve(slot_runs.size());
  for (const SlotRun& run : slot_runs) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row, Row(pages, run.kind, run.slot));
    runs.push_back({row, run.block, run.offset, run.elements});
  }
  return runs;
}

absl::StatusOr<std::vector<PagedState::PageRun>> PagedState::PlanPageRuns(
    int64_t layer, const engine::RingLayerGeometry& g, int64_t position) const {
  if (layout_.dims().element != serving::ElementType::kBfloat16) {
    return absl::FailedPreconditionError(
        absl::StrCat("PlanPageRuns: byte runs need bf16 pages, the layout holds ",
                     serving::ElementTypeName(layout_.dims().element)));
  }
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<SlotRun> slot_runs, PlanSlotRuns(layer, g, position));
  constexpr int64_t kBf16 = 2;
  std::vector<PageRun> runs;
  runs.reserve(slot_runs.size());
  for (const SlotRun& run : slot_runs) {
    runs.push_back({run.kind, run.slot.page, run.slot.row * layout_.Kind(run.kind).row_bytes,
                    static_cast<PageRun::Block>(run.block), run.offset * kBf16,
                    run.elements * kBf16});
  }
  PlanRingRuns(layer, g, position, &runs);
  return runs;
}

void PagedState::PlanRingRuns(int64_t layer, const engine::RingLayerGeometry& g, int64_t p,
                              std::vector<PageRun>* runs) const {
  const LayerInfo& info = layers_[static_cast<size_t>(layer)];
  if (info.type == LayerType::kSlidingAttention) return;
  constexpr int64_t kF32 = 4;
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  const StateKind kind = csa ? StateKind::kCsaCompressor : StateKind::kHcaCompressor;
  const int64_t row_bytes = layout_.Kind(kind).row_bytes;
  // StoreRingRows' rows: the ring row of position q is q % 2m (`width` floats); the open window
  // is positions p - p % m .. p - 1, the overlap (CSA, p >= m) columns [0, dim) of the window
  // before it. `row` is the page row, `at` / `floats` the piece's columns.
  auto piece = [&](int64_t row, int64_t at, PageRun::Block block,
                   const engine::RingCompressorGeometry& c, int64_t q, int64_t floats) {
    runs->push_back({kind, info.nth, row * row_bytes + at * kF32, block,
                     q % (2 * c.rate) * c.width() * kF32, floats * kF32});
  };
  const engine::RingCompressorGeometry& cg = g.compressor;
  const int64_t open_first = p / rate * rate;
  if (!csa) {
    for (int64_t q = open_first; q < p; ++q) {
      piece(q % rate, 0, PageRun::kCompressorRingKv, cg, q, hd);
      piece(q % rate, hd, PageRun::kCompressorRingGate, cg, q, hd);
    }
    return;
  }
  const engine::RingCompressorGeometry& ig = g.indexer;
  for (int64_t q = open_first; q < p; ++q) {
    piece(q % rate, 0, PageRun::kCompressorRingKv, cg, q, 2 * hd);
    piece(q % rate, 2 * hd, PageRun::kCompressorRingGate, cg, q, 2 * hd);
    piece(rate + q % rate, 0, PageRun::kIndexerRingKv, ig, q, 2 * ihd);
    piece(rate + q % rate, 2 * ihd, PageRun::kIndexerRingGate, ig, q, 2 * ihd);
  }
  if (!cg.overlapping || p < rate) return;
  for (int64_t r = 0; r < rate; ++r) {
    const int64_t q = open_first - rate + r;
    piece(2 * rate + r, 0, PageRun::kCompressorRingKv, cg, q, hd);
    piece(2 * rate + r, hd, PageRun::kCompressorRingGate, cg, q, hd);
    piece(2 * rate + r, 2 * hd, PageRun::kIndexerRingKv, ig, q, ihd);
    piece(2 * rate + r, 2 * hd + ihd, PageRun::kIndexerRingGate, ig, q, ihd);
  }
}

std::vector<PagedState::PageId> PagedState::LayerPages(int64_t layer) const {
  std::vector<PageId> out;
  if (layer < 0 || layer >= static_cast<int64_t>(layers_.size())) return out;
  out.push_back({StateKind::kWindow, layout_.WindowSlot(layer, 0).page});
  const LayerInfo& info = layers_[static_cast<size_t>(layer)];
  if (info.type == LayerType::kSlidingAttention) return out;
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  const int64_t entries = serving::StateLayout::Entries(total_tokens_, rate);
  const int64_t per_page = layout_.dims().entries_per_page;
  const int64_t entry_pages = (entries + per_page - 1) / per_page;
  const int64_t first = layout_.CompressedSlot(csa, info.nth, 0, total_tokens_).page;
  for (int64_t i = 0; i < entry_pages; ++i) out.push_back({StateKind::kCompressed, first + i});
  if (csa) {
    const int64_t first_key = layout_.IndexerSlot(info.nth, 0, total_tokens_).page;
    for (int64_t i = 0; i < entry_pages; ++i) out.push_back({StateKind::kIndexer, first_key + i});
  }
  out.push_back({csa ? StateKind::kCsaCompressor : StateKind::kHcaCompressor, info.nth});
  return out;
}

absl::Status PagedState::StoreLayerRing(int64_t layer, const engine::RingLayerGeometry& g,
                                        const engine::RingLayerBlocks& blocks, int64_t position,
                                        const SequencePages& pages, TaskPool* pool) const {
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<RowRun> runs, PlanRowRuns(layer, g, position, pages));
  const std::array<const uint16_t*, 3> from = {blocks.window, blocks.compressor.entries,
                                               blocks.indexer.entries};
  // The runs write disjoint rows; the compressor rows (a few, fp32) are one more task.
  absl::Status rings;
  RunTasks(pool, static_cast<int64_t>(runs.size()) + 1, [&](int64_t i) {
    if (i == static_cast<int64_t>(runs.size())) {
      rings = StoreRingRows(layer, g, blocks, position, pages);
      return;
    }
    const RowRun& run = runs[static_cast<size_t>(i)];
    run.row.PutBf16(0, from[run.block] + run.offset, run.elements);
  });
  return rings;
}

absl::Status PagedState::StoreRingRows(int64_t layer, const engine::RingLayerGeometry& g,
                                       const engine::RingLayerBlocks& blocks, int64_t p,
                                       const SequencePages& pages) const {
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  const LayerInfo& info = layers_[static_cast<size_t>(layer)];
  if (info.type == LayerType::kSlidingAttention) return absl::OkStatus();
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  const engine::RingCompressorGeometry& cg = g.compressor;
  // Ring row of position q: q % 2m, `width` floats; the open window is positions
  // p - p % m .. p - 1, the overlap (CSA, p >= m) columns [0, dim) of the window before it.
  const int64_t open_first = p / rate * rate;
  auto ring = [](const float* block, const engine::RingCompressorGeometry& c, int64_t q) {
    return block + q % (2 * c.rate) * c.width();
  };
  if (!csa) {
    for (int64_t q = open_first; q < p; ++q) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                               Row(pages, StateKind::kHcaCompressor, {info.nth, q % rate}));
      row.Put(0, ring(blocks.compressor.ring_kv, cg, q), hd);
      row.Put(hd, ring(blocks.compressor.ring_gate, cg, q), hd);
    }
    return absl::OkStatus();
  }
  const engine::RingCompressorGeometry& ig = g.indexer;
  for (int64_t q = open_first; q < p; ++q) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, q % rate}));
    row.Put(0, ring(blocks.compressor.ring_kv, cg, q), 2 * hd);
    row.Put(2 * hd, ring(blocks.compressor.ring_gate, cg, q), 2 * hd);
    PDSERVE_ASSIGN_OR_RETURN(row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, rate + q % rate}));
    row.Put(0, ring(blocks.indexer.ring_kv, ig, q), 2 * ihd);
    row.Put(2 * ihd, ring(blocks.indexer.ring_gate, ig, q), 2 * ihd);
  }
  if (!cg.overlapping || p < rate) return absl::OkStatus();
  for (int64_t r = 0; r < rate; ++r) {
    const int64_t q = open_first - rate + r;
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
    row.Put(0, ring(blocks.compressor.ring_kv, cg, q), hd);
    row.Put(hd, ring(blocks.compressor.ring_gate, cg, q), hd);
    row.Put(2 * hd, ring(blocks.indexer.ring_kv, ig, q), ihd);
    row.Put(2 * hd + ihd, ring(blocks.indexer.ring_gate, ig, q), ihd);
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
  std::vector<float> scratch;
  for (size_t l = 0; l < layers_.size(); ++l) {
    engine::LayerState& ls = state->layers[l];
    const int64_t window_rows =
        std::min(position, std::max<int64_t>(config_.sliding_window - 1, 0));
    for (int64_t pos = position - window_rows; pos < position; ++pos) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row, Row(pages, StateKind::kWindow,
                                               layout_.WindowSlot(static_cast<int64_t>(l), pos)));
      AppendRow(&ls.window_kv, row, 0, &scratch);
    }
    const LayerInfo& info = layers_[l];
    if (info.type == LayerType::kSlidingAttention) continue;
    const bool csa = info.type == LayerType::kCompressedSparseAttention;
    const int64_t rate = config_.CompressRate(info.type);
    engine::CompressorState& comp = ls.compressor;
    for (int64_t e = 0; e < position / rate; ++e) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                               Row(pages, StateKind::kCompressed,
                                   layout_.CompressedSlot(csa, info.nth, e, total_tokens_)));
      AppendRow(&comp.entries, row, 0, &scratch);
    }
    const int64_t open_first = position - position % rate;
    if (!csa) {
      for (int64_t pos = open_first; pos < position; ++pos) {
        PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                                 Row(pages, StateKind::kHcaCompressor, {info.nth, pos % rate}));
        AppendRow(&comp.buffer_kv, row, 0, &scratch);
        AppendRow(&comp.buffer_gate, row, hd, &scratch);
      }
      continue;
    }
    engine::CompressorState& idx = ls.indexer;
    for (int64_t e = 0; e < position / rate; ++e) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row, Row(pages, StateKind::kIndexer,
                                               layout_.IndexerSlot(info.nth, e, total_tokens_)));
      AppendRow(&idx.entries, row, 0, &scratch);
    }
    for (int64_t pos = open_first; pos < position; ++pos) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                               Row(pages, StateKind::kCsaCompressor, {info.nth, pos % rate}));
      AppendRow(&comp.buffer_kv, row, 0, &scratch);
      AppendRow(&comp.buffer_gate, row, 2 * hd, &scratch);
      PDSERVE_ASSIGN_OR_RETURN(
          row, Row(pages, StateKind::kCsaCompressor, {info.nth, rate + pos % rate}));
      AppendRow(&idx.buffer_kv, row, 0, &scratch);
      AppendRow(&idx.buffer_gate, row, 2 * ihd, &scratch);
    }
    if (position < rate) continue;
    for (int64_t r = 0; r < rate; ++r) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                               Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
      AppendRow(&comp.overlap_kv, row, 0, &scratch);
      AppendRow(&comp.overlap_gate, row, hd, &scratch);
      AppendRow(&idx.overlap_kv, row, 2 * hd, &scratch);
      AppendRow(&idx.overlap_gate, row, 2 * hd + ihd, &scratch);
    }
  }
  state->position = position;
  return absl::OkStatus();
}

absl::Status PagedState::LoadLayerRing(int64_t layer, const engine::RingLayerGeometry& g,
                                       int64_t position, const SequencePages& pages,
                                       const engine::MutableRingLayerBlocks& blocks,
                                       TaskPool* pool) const {
  PDSERVE_ASSIGN_OR_RETURN(const std::vector<RowRun> runs, PlanRowRuns(layer, g, position, pages));
  const std::array<uint16_t*, 3> to = {blocks.window, blocks.compressor.entries,
                                       blocks.indexer.entries};
  absl::Status rings;
  RunTasks(pool, static_cast<int64_t>(runs.size()) + 1, [&](int64_t i) {
    if (i == static_cast<int64_t>(runs.size())) {
      rings = LoadRingRows(layer, g, position, pages, blocks);
      return;
    }
    const RowRun& run = runs[static_cast<size_t>(i)];
    run.row.GetBf16(0, run.elements, to[run.block] + run.offset);
  });
  return rings;
}

absl::Status PagedState::LoadRingRows(int64_t layer, const engine::RingLayerGeometry& g, int64_t p,
                                      const SequencePages& pages,
                                      const engine::MutableRingLayerBlocks& blocks) const {
  const int64_t hd = config_.head_dim;
  const int64_t ihd = config_.index_head_dim;
  const LayerInfo& info = layers_[static_cast<size_t>(layer)];
  if (info.type == LayerType::kSlidingAttention) return absl::OkStatus();
  const bool csa = info.type == LayerType::kCompressedSparseAttention;
  const int64_t rate = config_.CompressRate(info.type);
  // The ring row of position q is q % 2m (StoreLayerRing's mapping, read back).
  const int64_t open_first = p / rate * rate;
  auto ring = [](float* block, const engine::RingCompressorGeometry& c, int64_t q) {
    return block + q % (2 * c.rate) * c.width();
  };
  const engine::RingCompressorGeometry& cg = g.compressor;
  if (!csa) {
    for (int64_t q = open_first; q < p; ++q) {
      PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                               Row(pages, StateKind::kHcaCompressor, {info.nth, q % rate}));
      row.Get(0, hd, ring(blocks.compressor.ring_kv, cg, q));
      row.Get(hd, hd, ring(blocks.compressor.ring_gate, cg, q));
    }
    return absl::OkStatus();
  }
  const engine::RingCompressorGeometry& ig = g.indexer;
  for (int64_t q = open_first; q < p; ++q) {
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, q % rate}));
    row.Get(0, 2 * hd, ring(blocks.compressor.ring_kv, cg, q));
    row.Get(2 * hd, 2 * hd, ring(blocks.compressor.ring_gate, cg, q));
    PDSERVE_ASSIGN_OR_RETURN(row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, rate + q % rate}));
    row.Get(0, 2 * ihd, ring(blocks.indexer.ring_kv, ig, q));
    row.Get(2 * ihd, 2 * ihd, ring(blocks.indexer.ring_gate, ig, q));
  }
  if (!cg.overlapping || p < rate) return absl::OkStatus();
  for (int64_t r = 0; r < rate; ++r) {
    const int64_t q = open_first - rate + r;
    PDSERVE_ASSIGN_OR_RETURN(RowRef row,
                             Row(pages, StateKind::kCsaCompressor, {info.nth, 2 * rate + r}));
    row.Get(0, hd, ring(blocks.compressor.ring_kv, cg, q));
    row.Get(hd, hd, ring(blocks.compressor.ring_gate, cg, q));
    row.Get(2 * hd, ihd, ring(blocks.indexer.ring_kv, ig, q));
    row.Get(2 * hd + ihd, ihd, ring(blocks.indexer.ring_gate, ig, q));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::runtime
