// Host-side bookkeeping of expert parallelism (docs/engine-gpu.md, "Several GPUs"): which routed
// experts each rank of a group holds, which rank a new request goes to, and how many rows every
// rank runs in one lock-step call. Pure functions over their arguments: no CUDA, thread-safe.
//
// The group's model: every rank holds the whole model except the routed experts, which are split
// into contiguous blocks (rank r holds experts [first, first + count)); attention, the indexer,
// the shared expert, the router and the embeddings are replicated and each rank runs them on its
// own requests (data parallel, as DeepSeek-V4's reference does: one shared KV head makes
// head-sharded attention pointless). A MoE layer is a collective: every rank takes part with the
// same number of rows, so a call's rows are agreed on the host before it starts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::engine {

// The routed experts one rank holds: global ids [first, first + count).
struct ExpertShard {
  int64_t first = 0;
  int64_t count = 0;
  bool Owns(int64_t expert) const { return expert >= first && expert < first + count; }
  // The rank's own index of a global expert id, or -1 when another rank holds it (the routed
  // experts kernel skips ids outside [0, count)).
  int32_t Local(int64_t expert) const {
    return Owns(expert) ? static_cast<int32_t>(expert - first) : -1;
  }
};

// Rank `rank` of `world` holds a contiguous block of the n_experts routed experts; the first
// n_experts % world ranks hold one more than the others, so the blocks differ by at most one and
// cover every expert exactly once in rank order. InvalidArgument for world < 1, a rank outside
// [0, world) or n_experts < world (every rank holds at least one expert).
absl::StatusOr<ExpertShard> ExpertShardOf(int64_t n_experts, int64_t world, int64_t rank);

// The rank holding global expert `expert` under ExpertShardOf's split; -1 for an id outside
// [0, n_experts) or arguments ExpertShardOf refuses.
int64_t ExpertOwner(int64_t n_experts, int64_t world, int64_t expert);

// Rank for a new request: the one with the most free state slots, the lowest index among equals
// (so requests spread evenly and a one-rank group always picks 0). -1 when every rank is full.
int64_t PickRank(std::span<const int64_t> free_slots_per_rank);

// Rows of one lock-step decode call: the smallest of `buckets` (ascending, positive) that holds
// the largest rank's batch; every rank pads its batch (possibly empty) to it. 0 when every batch
// is empty (no call). InvalidArgument for a negative batch or no bucket large enough.
absl::StatusOr<int64_t> GroupDecodeRows(std::span<const int64_t> batch_per_rank,
                                        std::span<const int64_t> buckets);

// Lock-step prefill: rank r runs chunks_per_rank[r] (the lengths of its Forward calls, in order)
// one per round. Round i has rows = the longest i-th chunk over the ranks; a rank without an
// i-th chunk takes part with padding rows only. Returns the rows of each round (as many rounds as
// the longest list). Lengths are taken as given (positive).
std::vector<int64_t> PrefillRoundRows(const std::vector<std::vector<int64_t>>& chunks_per_rank);

}  // namespace pdserve::engine
