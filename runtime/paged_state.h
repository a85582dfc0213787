// The engine's per-request decode state (engine::ModelState) stored in state-pool pages laid out by
// serving::StateLayout: the storage that the colocated runner, the prefill worker and the decode
// worker share, and the byte format the prefill worker ships (docs/serving.md, "Page format").
//
// Between engine steps a sequence's state lives only in its pages. A step loads the state into a
// plain engine::ModelState (Load), runs Model::Forward on it, and writes back what the step changed
// (Store). Both are exact float32 copies, so a state rebuilt from pages continues a sequence bit
// for bit as the in-memory state would. Tools that need no pool keep using ModelState directly.
//
// Page contents (W = sliding_window, D = head_dim, I = index_head_dim,
// m / m' = CSA / HCA compression rate, p = tokens consumed):
//   window page of layer l (every layer): row (pos % W) holds the K=V row of token pos, for the
//     last min(p, W - 1) positions;
//   compressed page: row e % E of the layer's page e / E holds entry e, e < p / rate;
//   indexer page: likewise, the CSA layer's indexer keys;
//   csa_compressor page (3m rows of 4D floats): row r < m: open window row of token with
//     pos % m == r, [kv 2D | gate 2D]; row m + r: the indexer's open window row [kv 2I | gate 2I];
//     row 2m + r (once p >= m): overlap row r [kv D | gate D | indexer kv I | indexer gate I];
//   hca_compressor page (m' rows of 2D floats): row pos % m' holds [kv D | gate D].
// Unused row tails are left as they were (poison in debug builds). Element types: the layout's
// (serving::StateLayout::Element): window, compressed and indexer rows in dims().element (fp32 for
// the CPU engine, bf16 for the CUDA engine: Store rounds to nearest even, Load widens exactly),
// compressor rows always fp32. A bf16 layout's Store/Load round trip is exact for values that are
// already bf16 (what the CUDA engine's state holds).
//
// Thread-safety: a PagedState is immutable and may be shared; Load / Store on one sequence's pages
// must not run concurrently with another access to the same pages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/task_pool.h"
#include "engine/config.h"
#include "engine/ring_state.h"
#include "engine/state.h"
#include "serving/page_pool.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

// StateDims for `config` with `element` rows (fp32: the CPU backend's storage; bf16: the CUDA
// backend's, StorageElement). InvalidArgument from StateLayout::Create for an unusable config.
absl::StatusOr<serving::StateLayout> LayoutForModel(
    const engine::ModelConfig& config, int64_t entries_per_page = 64,
    serving::ElementType element = serving::ElementType::kFloat32);

// The element type an engine stores its state in, and so the pages it writes and reads:
// fp32 for the CPU engine, bf16 for the CUDA engine (`cuda` true).
inline serving::ElementType StorageElement(bool cuda) {
  return cuda ? serving::ElementType::kBfloat16 : serving::ElementType::kFloat32;
}

// One sequence's pages as writable byte spans: pages[kind][i] is PageTable::pages[kind][i]'s bytes.
struct SequencePages {
  std::vector<std::vector<std::span<std::byte>>> pages;
};

// Resolves every handle of `table` through PagePool::Data (checking owner and epoch once).
absl::StatusOr<SequencePages> MapPages(serving::PagePool& pool, const serving::PageTable& table);

class PagedState {
 public:
  // One row of a page: its bytes and element type (what Store / Load go through).
  struct RowRef {
    std::byte* data = nullptr;
    serving::ElementType type = serving::ElementType::kFloat32;
    // Writes n floats at element offset `at` (rounded to bf16 for a bf16 row).
    void Put(int64_t at, const float* from, int64_t n) const;
    // Reads n elements from element offset `at` as floats into `to`.
    void Get(int64_t at, int64_t n, float* to) const;
    // Writes n bf16 values (bit patterns) at element offset `at` (widened for an fp32 row).
    void PutBf16(int64_t at, const uint16_t* from, int64_t n) const;
    // Reads n elements from element offset `at` as bf16 bit patterns into `to` (copied from a
    // bf16 row, rounded to nearest even from an fp32 row).
    void GetBf16(int64_t at, int64_t n, uint16_t* to) const;
  };

  // `config` and `layout` (from LayoutForModel(config)) must outlive this object. `total_tokens` is
  // the sequence's prompt + max_tokens, which fixes how many entry pages each layer has.
  PagedState(const engine::ModelConfig& config, const serving::StateLayout& layout,
             int64_t total_tokens);

  // Writes the parts of `state` that changed since `from_position` (state->position at the previous
  // Store, 0 for a new sequence): window rows and entries of positions >= from_position, and the
  // whole open-window / overlap rows. InvalidArgument when `state` does not match the model or
  // holds more tokens than total_tokens; OutOfRange when `pages` lacks a page the layout names.
  absl::Status Store(const engine::ModelState& state, int64_t from_position,
                     const SequencePages& pages) const;

  // Store for one decoder layer: `layer_state` is layer `layer`'s state after `position` tokens
  // (Model::Forward's LayerHook hands both over before state->position advances). Lets the
  // prefill worker ship a layer's pages while later layers compute. Errors as Store.
  absl::Status StoreLayer(int64_t layer, const engine::LayerState& layer_state, int64_t position,
                          int64_t from_position, const SequencePages& pages) const;

  // StoreLayer of a fresh sequence (from position 0) straight from layer `layer`'s blocks as the
  // CUDA engine stores them (engine/ring_state.h: bf16 window ring and entries, fp32 compressor
  // rings; a pinned copy made by engine::gpu::StateStaging): the same page bytes as
  // StoreLayer(layer, LayerStateFromRingBlocks(geometry, blocks, position), position, 0, pages),
  // without the fp32 state in between (bf16 rows of a bf16 layout are copied as they are).
  // REQUIRES: `geometry` is this model's layer `layer` (engine::RingGeometryFor) and the blocks
  // hold its sizes, entries rows 0 .. position / m - 1 at least. Errors as StoreLayer, checked
  // for the window and entry pages before any row is written.
  // Rows go in runs (the rows of one page that are contiguous in the block too: up to
  // entries_per_page entries, the window in one or two), copied as one span each; with `pool`
  // the runs are spread over its threads (the pages written are the same bytes with any number
  // of threads: each byte has one writer). The pool's Run is called once.
  absl::Status StoreLayerRing(int64_t layer, const engine::RingLayerGeometry& geometry,
                              const engine::RingLayerBlocks& blocks, int64_t position,
                              const SequencePages& pages, TaskPool* pool = nullptr) const;

  // Rebuilds the state after `position` tokens into `state`, which must be a fresh
  // Model::NewState() (its tensors give the column counts). Errors as Store.
  absl::Status Load(int64_t position, const SequencePages& pages, engine::ModelState* state) const;

  // The inverse of StoreLayerRing: layer `layer`'s state after `position` tokens from the pages
  // into `blocks` (the CUDA engine's layer layout for `geometry`, this model's layer: bf16 window
  // ring and entries, fp32 compressor rings; normally a pinned buffer that
  // engine::gpu::GpuModel::ImportLayers hands out), with no CPU-layout state in between. Writes
  // exactly the rows the next forward reads: window rows of the last min(p, W - 1) positions
  // (bf16 rows copied as they are, fp32 rows rounded to nearest even: a CPU prefill's pages), the
  // rings' open-window rows and, for an overlapping compressor at p >= m, columns [0, dim) of
  // the previous window's rows, and entry rows 0 .. p / m - 1; every other value is left as it
  // was. On those rows it equals engine::LayerRingImage of Load's layer (window and entries
  // rounded to bf16). REQUIRES: the blocks hold `geometry`'s sizes. Errors as StoreLayerRing.
  // Runs and `pool` as StoreLayerRing's.
  absl::Status LoadLayerRing(int64_t layer, const engine::RingLayerGeometry& geometry,
                             int64_t position, const SequencePages& pages,
                             const engine::MutableRingLayerBlocks& blocks,
                             TaskPool* pool = nullptr) const;

  // One run of bytes that StoreLayerRing / LoadLayerRing move between a page and a layer's ring
  // blocks, for a caller that copies them itself (device to device: runtime/cuda/
  // device_state_pages.h): `bytes` bytes at byte `page_offset` of page `page` of kind `kind`
  // (the index within PageTable::pages[layout.KindIndex(kind)]) are the bytes at byte
  // `block_offset` of block `block` of the layer (engine/ring_state.h: the window and the entry
  // blocks bf16, the rings fp32).
  struct PageRun {
    enum Block : int32_t {
      kWindow,
      kEntries,
      kIndexerEntries,
      kCompressorRingKv,
      kCompressorRingGate,
      kIndexerRingKv,
      kIndexerRingGate,
    };
    serving::StateKind kind = serving::StateKind::kWindow;
    int64_t page = 0;
    int64_t page_offset = 0;
    Block block = kWindow;
    int64_t block_offset = 0;
    int64_t bytes = 0;
  };
  // The runs of layer `layer` after `position` tokens: exactly the bytes StoreLayerRing writes
  // into the pages and LoadLayerRing reads from them, in the same places (window runs, entry
  // runs, indexer-key runs, then the compressor rings' rows, one run per row piece), without
  // touching memory. Entry runs split where a page ends, window runs where the ring or the page
  // wraps; no two runs write the same page bytes or the same block bytes. Byte copies need the
  // page rows in the blocks' types: FailedPrecondition for a layout whose element is not bf16
  // (an fp32 layout converts, which only the host path does). InvalidArgument as
  // CheckLayerPosition; pages are not checked (a caller resolving a run checks its page
  // exists). REQUIRES: `geometry` is this model's layer `layer` (engine::RingGeometryFor).
  absl::StatusOr<std::vector<PageRun>> PlanPageRuns(int64_t layer,
                                                    const engine::RingLayerGeometry& geometry,
                                                    int64_t position) const;

  // A page of the sequence: PageTable::pages[layout.KindIndex(kind)][page].
  struct PageId {
    serving::StateKind kind = serving::StateKind::kWindow;
    int64_t page = 0;
    bool operator==(const PageId&) const = default;
  };
  // Every page that belongs to layer `layer` (each page holds one layer's rows), in kind order
  // (serving::StateKind) then page order: its window page, its compressed-entry and indexer-key
  // pages for total_tokens, its compressor page. Empty for a layer outside the model.
  std::vector<PageId> LayerPages(int64_t layer) const;

  const serving::StateLayout& layout() const { return layout_; }
  int64_t total_tokens() const { return total_tokens_; }

 private:
  struct LayerInfo {
    engine::LayerType type;
    int64_t nth = 0;  // index among the layers of its type (CSA or HCA)
  };
  absl::StatusOr<RowRef> Row(const SequencePages& pages, serving::StateKind kind,
                             serving::StateSlot slot) const;
  // `elements` values of one page starting at `row`, contiguous in block `block` of a layer's
  // ring blocks from element `offset` on.
  struct RowRun {
    enum Block { kWindow = 0, kEntries = 1, kIndexerEntries = 2 };
    RowRef row;
    Block block = kWindow;
    int64_t offset = 0;
    int64_t elements = 0;
  };
  // The window, entry and indexer-key rows of layer `layer` after `position` tokens as runs
  // (StoreLayerRing's rows but the compressor rings'). Errors: CheckLayerPosition's, Row's.
  absl::StatusOr<std::vector<RowRun>> PlanRowRuns(int64_t layer,
                                                  const engine::RingLayerGeometry& geometry,
                                                  int64_t position,
                                                  const SequencePages& pages) const;
  // PlanRowRuns' runs by page and row, before any page is resolved (shared with PlanPageRuns).
  struct SlotRun {
    serving::StateKind kind = serving::StateKind::kWindow;
    serving::StateSlot slot;
    RowRun::Block block = RowRun::kWindow;
    int64_t offset = 0;  // elements
    int64_t elements = 0;
  };
  absl::StatusOr<std::vector<SlotRun>> PlanSlotRuns(int64_t layer,
                                                    const engine::RingLayerGeometry& geometry,
                                                    int64_t position) const;
  // The compressor rings' rows of PlanPageRuns (StoreRingRows' rows as byte runs).
  void PlanRingRuns(int64_t layer, const engine::RingLayerGeometry& geometry, int64_t position,
                    std::vector<PageRun>* runs) const;
  // The compressor rings' rows of StoreLayerRing / LoadLayerRing (fp32, a few per layer).
  absl::Status StoreRingRows(int64_t layer, const engine::RingLayerGeometry& geometry,
                             const engine::RingLayerBlocks& blocks, int64_t position,
                             const SequencePages& pages) const;
  absl::Status LoadRingRows(int64_t layer, const engine::RingLayerGeometry& geometry,
                            int64_t position, const SequencePages& pages,
                            const engine::MutableRingLayerBlocks& blocks) const;
  absl::Status CheckState(const engine::ModelState& state, int64_t position) const;
  // InvalidArgument unless `layer` is one of the model's and position is in [0, total_tokens].
  absl::Status CheckLayerPosition(int64_t layer, int64_t position) const;

  const engine::ModelConfig& config_;
  const serving::StateLayout& layout_;
  int64_t total_tokens_;
  std::vector<LayerInfo> layers_;
};

}  // namespace pdserve::runtime
