// How one sequence's DeepSeek-V4 decode state maps onto pool pages (docs/serving.md has the
// picture). The decode state per layer is the one transformers 5.17 keeps in
// models/deepseek_v4/modeling_deepseek_v4.py (DeepseekV4HCACache / DeepseekV4CSACache):
//   - every layer: the sliding window of K=V rows (shared-KV MQA), head_dim wide;
//   - CSA layers: compressed entries (one per compress_rate_csa tokens, head_dim wide), indexer
//     keys (one per compress_rate_csa tokens, index_head_dim wide), and the compressor's and the
//     indexer's open-window buffers (kv and gate of tokens not yet compressed) plus their overlap
//     slices (the previous window's Ca half, paper section 2.3.1);
//   - HCA layers: compressed entries (one per compress_rate_hca tokens) and the open-window buffer.
// Each kind of row lives in its own page kind; every page belongs to one layer, so the prefill
// worker can ship a layer's pages as soon as that layer is final. Pages of a kind are ordered
// layer-major in the sequence's PageTable: all pages of the first layer of that kind, then the
// next layer's. Immutable after Create; safe to share across threads.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "serving/element_type.h"
#include "serving/page_pool.h"

namespace pdserve::serving {

// Model dimensions the layout needs; the caller copies them from engine::ModelConfig.
struct StateDims {
  int64_t sliding_layers = 0;  // layers of each attention type
  int64_t csa_layers = 0;
  int64_t hca_layers = 0;
  int64_t head_dim = 0;
  int64_t index_head_dim = 0;
  int64_t sliding_window = 0;
  int64_t compress_rate_csa = 0;
  int64_t compress_rate_hca = 0;
  // Element type of the window rows, compressed entries and indexer keys: the producing engine's
  // storage (fp32 on the CPU backend, bf16 on the CUDA backend). The compressor pages always hold
  // fp32: both engines keep the compressors' open-window buffers in fp32.
  ElementType element = ElementType::kFloat32;
  int64_t entries_per_page = 64;  // compressed entries / indexer keys per page
};

enum class StateKind : int32_t {
  kWindow,         // row: one token's K=V vector; one page per layer holds the whole window
  kCompressed,     // row: one compressed entry (CSA and HCA layers)
  kIndexer,        // row: one indexer key (CSA layers)
  kCsaCompressor,  // one page per CSA layer: open windows and overlap slices
  kHcaCompressor,  // one page per HCA layer: the open window
};
inline constexpr int kNumStateKinds = 5;
const char* StateKindName(StateKind kind);  // "window", "compressed", ...
// The `kind` label of the pool-page metrics (docs/metrics.md) for the kind named `name`
// (StateKindName): "window" -> "sliding", "compressed" and "indexer" as they are, either
// compressor kind -> "compressor", "device_state_rate<r>" (the CUDA engine's page pools,
// colocated::ServiceOptions::device_state_tokens) -> "device".
std::string PoolKindLabel(const std::string& name);

// Pages used and free in `pool`, summed per PoolKindLabel (the pool-page metrics' series).
// Thread-safety: as PagePool's counters.
struct PoolPages {
  int64_t used = 0;
  int64_t free = 0;
};
std::map<std::string, PoolPages> PoolPagesByLabel(const PagePool& pool);

// A row of one sequence's state: page index within PageTable::pages[kind], row within the page.
struct StateSlot {
  int64_t page = 0;
  int64_t row = 0;
};

class StateLayout {
 public:
  // Errors: InvalidArgument when no layer is given, a dimension or rate is not positive, or a
  // window / compressor row would not be a multiple of 4 bytes.
  static absl::StatusOr<StateLayout> Create(const StateDims& dims);

  const StateDims& dims() const { return dims_; }
  // The page kind of `kind` in PoolOptions' order; absent when the model has no layer using it.
  std::optional<int32_t> KindIndex(StateKind kind) const { return kind_index_[Index(kind)]; }
  PageKind Kind(StateKind kind) const;
  // The element type of `kind`'s rows (dims().element, or fp32 for the compressor kinds).
  ElementType Element(StateKind kind) const;

  // Pool kinds for up to `max_sequences` sequences holding `token_capacity` tokens in total
  // (per-layer fixed pages for every sequence, entry pages for the tokens plus one partial page
  // per sequence and layer). Both arguments >= 1.
  PagePoolOptions PoolOptions(int64_t max_sequences, int64_t token_capacity) const;
  // Pages one sequence of `total_tokens` (prompt + max_tokens) tokens needs, in PoolOptions'
  // kind order: the scheduler's PageDemandFn.
  PageDemand Demand(int64_t total_tokens) const;

  // Window row of the token at `position` in layer `layer` (0-based over all layers): a ring
  // buffer of sliding_window rows, row position % sliding_window.
  StateSlot WindowSlot(int64_t layer, int64_t position) const;
  // Compressed entry `entry` (covering tokens [entry * rate, (entry + 1) * rate)) of the
  // `nth`-th CSA layer (`csa` true) or HCA layer, in a sequence of `total_tokens` tokens.
  StateSlot CompressedSlot(bool csa, int64_t nth, int64_t entry, int64_t total_tokens) const;
  // Indexer key `entry` of the `nth`-th CSA layer.
  StateSlot IndexerSlot(int64_t nth, int64_t entry, int64_t total_tokens) const;

  // Entries (compressed or indexer) of one layer with compression `rate` over `total_tokens`.
  static int64_t Entries(int64_t total_tokens, int64_t rate) { return total_tokens / rate; }

 private:
  static int Index(StateKind kind) { return static_cast<int>(kind); }
  explicit StateLayout(const StateDims& dims);
  int64_t EntryPages(int64_t total_tokens, int64_t rate) const;

  StateDims dims_;
  std::array<std::optional<int32_t>, kNumStateKinds> kind_index_;
};

}  // namespace pdserve::serving
