// Device bytes of the CUDA engine's paged decode state (engine/gpu/gpu_model.h,
// GpuModelOptions::paged_state / state_tokens; engine/gpu/gpu_model_pages.cc sizes the pools the
// same way, and tests/engine_gpu/gpu_paged_state_test.cc checks the two agree), and how many
// concurrent requests of a given length fit in a byte budget with and without paging.
//
// Per slot (and the scratch slot), fixed: the bf16 sliding-window ring [W, head_dim] of every
// layer and the fp32 compressor rings (kv and gate, [2m, width]) of every compressor. Paged, per
// compression rate r: pages of kPagedEntries entries holding that many bf16 entries of every
// layer of rate r (CSA entries [head_dim] and indexer keys [index_head_dim], HCA entries), a
// request at p tokens holding ceil((p / r) / 64) of them; a pool of
// min(slots * capacity / 64, ceil(state_tokens / r / 64) + slots) pages plus the null page.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace pdserve::engine {

inline constexpr int64_t kPagedEntries = 64;

struct PagedStateBytes {
  int64_t per_slot = 0;  // window ring + compressor rings of one slot
  // (rate, bytes of one page over every layer of that rate), ascending rate.
  std::vector<std::pair<int64_t, int64_t>> page_bytes;
  // One request at `tokens` tokens: per_slot plus its pages.
  int64_t Request(int64_t tokens) const;
};
PagedStateBytes GpuPagedStateBytes(const ModelConfig& config);

// Pages of rate `rate`'s pool of a GpuModel with these options (the null page not counted).
int64_t PagedPoolPages(int64_t rate, int64_t slots, int64_t max_context, int64_t state_tokens);
// Device bytes of a GpuModel's state pools: (slots + 1) fixed blocks and every rate's pool with
// its null page. paged false: the slot layout (every slot's pages at max_context).
int64_t GpuStatePoolBytes(const ModelConfig& config, int64_t slots, int64_t max_context,
                          int64_t state_tokens, bool paged);

// The admission ledger of a GpuModel's paged pools
// (colocated::ServiceOptions::device_state_tokens): (rate, allocatable pages) per compression rate,
// ascending, as PagedPoolPages counts them. Empty for a model of sliding layers only.
std::vector<std::pair<int64_t, int64_t>> PagedPoolKinds(const ModelConfig& config, int64_t slots,
                                                        int64_t max_context, int64_t state_tokens);
// Pages of rate `rate` a request holds once its state reaches `tokens` tokens on a GpuModel of
// max_context `max_context`: ceil(min(tokens / rate, capacity) / 64), what SlotPageTables::PagesAt
// grows a slot to. A scheduler that reserves this for prompt + max_tokens at admission, against
// PagedPoolKinds' pages, never lets a running request find its pool short.
int64_t PagedRequestPages(int64_t rate, int64_t max_context, int64_t tokens);

// How many requests of `tokens` tokens (prompt + max_tokens) admission lets run at once on a
// GpuModel of `slots` slots with these pools: min(slots, over every rate, the pool's pages /
// PagedRequestPages). 0 when `tokens` exceeds max_context.
int64_t AdmittedRequests(const ModelConfig& config, int64_t slots, int64_t max_context,
                         int64_t state_tokens, int64_t tokens);

// The most concurrent requests of `tokens` tokens each whose state fits in `budget` bytes on a
// GpuModel of max_context `max_context`: slot layout (every slot sized for max_context), or paged
// with state_tokens = requests * tokens. 0 when not even one fits.
int64_t ConcurrentRequestsThatFit(const ModelConfig& config, int64_t tokens, int64_t max_context,
                                  int64_t budget, bool paged);

}  // namespace pdserve::engine
