#include "engine/expert_parallel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pdserve::engine {

absl::StatusOr<ExpertShard> ExpertShardOf(int64_t n_experts, int64_t world, int64_t rank) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("expert parallelism: rank ", rank, " of a group of ", world));
  }
  if (n_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("expert parallelism: ", n_experts,
                                                   " routed experts cannot be split over ", world,
                                                   " ranks (each rank holds at least one)"));
  }
  const int64_t base = n_experts / world;
  const int64_t extra = n_experts % world;
  ExpertShard shard;
  shard.count = base + (rank < extra ? 1 : 0);
  shard.first = rank * base + std::min(rank, extra);
  return shard;
}

int64_t ExpertOwner(int64_t n_experts, int64_t world, int64_t expert) {
  if (world < 1 || n_experts < world || expert < 0 || expert >= n_experts) return -1;
  const int64_t base = n_experts / world;
  const int64_t extra = n_experts % world;
  // The first `extra` ranks hold base + 1 experts each.
  const int64_t big = extra * (base + 1);
  return expert < big ? expert / (base + 1) : extra + (expert - big) / base;
}

int64_t PickRank(std::span<const int64_t> free_slots_per_rank) {
  int64_t best = -1;
  for (size_t r = 0; r < free_slots_per_rank.size(); ++r) {
    if (free_slots_per_rank[r] <= 0) continue;
    if (best < 0 || free_slots_per_rank[r] > free_slots_per_rank[static_cast<size_t>(best)]) {
      best = static_cast<int64_t>(r);
    }
  }
  return best;
}

absl::StatusOr<int64_t> GroupDecodeRows(std::span<const int64_t> batch_per_rank,
                                        std::span<const int64_t> buckets) {
  int64_t largest = 0;
  for (int64_t b : batch_per_rank) {
    if (b < 0) return absl::InvalidArgumentError(absl::StrCat("negative decode batch ", b));
    largest = std::max(largest, b);
  }
  if (largest == 0) return 0;
  for (int64_t bucket : buckets) {
    if (bucket >= largest) return bucket;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("decode batch ", largest, " above the largest bucket"));
}

std::vector<int64_t> PrefillRoundRows(const std::vector<std::vector<int64_t>>& chunks_per_rank) {
  std::vector<int64_t> rows;
  for (const std::vector<int64_t>& chunks : chunks_per_rank) {
    if (chunks.size() > rows.size()) rows.resize(chunks.size(), 0);
    for (size_t i = 0; i < chunks.size(); ++i) rows[i] = std::max(rows[i], chunks[i]);
  }
  return rows;
}

}  // namespace pdserve::engine
