// Which of a request's state pages travel from prefill to decode, in which order (the ticket's
// slot order), with what descriptors: the bridge from serving's PageTable to a ticket.
//
// After prefill of `prompt_tokens` tokens, layer l's final state is (docs/serving.md, "DeepSeek-V4
// decode state in pages"): its window page; for a CSA layer the compressed and indexer pages
// holding the floor(prompt / m) entries made so far, and its compressor page (open windows and
// overlap); for an HCA layer the compressed pages of floor(prompt / m') entries and its compressor
// page. Pages are planned layer by layer (layer 0 first), so a prefill worker can post layer l as
// soon as it is final. Pages for tokens not yet generated are not sent: the decode worker writes
// them. Both workers build the plan from the same (layout, layer types, prompt, total) and their
// own PageTable, so slot i names the same state on both sides.
// Thread-safety: pure function.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvtransfer/ticket.h"
#include "serving/page_pool.h"
#include "serving/state_layout.h"

namespace pdserve::kv {

// Attention type of each decoder layer, in model order (from the model config's layer types).
enum class LayerAttention { kSliding, kCsa, kHca };

struct PlannedPage {
  serving::PageHandle handle;  // In the planning worker's own pool.
  PageDescriptor descriptor;   // layer, page index within its kind, token range, page bytes.
};

// Errors: InvalidArgument when `layers` disagrees with the layout's layer counts, the table does
// not hold the pages Demand(total_tokens) gives, or prompt_tokens is not in [1, total_tokens].
absl::StatusOr<std::vector<PlannedPage>> PlanTransfer(const serving::StateLayout& layout,
                                                      std::span<const LayerAttention> layers,
                                                      const serving::PageTable& table,
                                                      int64_t prompt_tokens, int64_t total_tokens);

// The ticket epoch of a table: its smallest page epoch. Epochs are unique per pool and one
// allocation takes consecutive ones, so this names the allocation.
uint64_t TableEpoch(const serving::PageTable& table);

}  // namespace pdserve::kv
