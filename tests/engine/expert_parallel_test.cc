// Host bookkeeping of expert parallelism (engine/expert_parallel.h): the expert split, its
// inverse, where new requests go and the rows of lock-step calls. No GPU needed.
#include "engine/expert_parallel.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace pdserve::engine {
namespace {

TEST(ExpertShardTest, SplitsIntoContiguousBlocksThatDifferByAtMostOne) {
  // 8 experts over 3 ranks: 3 + 3 + 2.
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 3}, {3, 3}, {6, 2}};
  for (int64_t r = 0; r < 3; ++r) {
    auto shard = ExpertShardOf(8, 3, r);
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ(shard->first, expected[static_cast<size_t>(r)].first) << r;
    EXPECT_EQ(shard->count, expected[static_cast<size_t>(r)].second) << r;
  }
  auto even = ExpertShardOf(256, 2, 1);
  ASSERT_TRUE(even.ok());
  EXPECT_EQ(even->first, 128);
  EXPECT_EQ(even->count, 128);
  auto alone = ExpertShardOf(5, 1, 0);
  ASSERT_TRUE(alone.ok());
  EXPECT_EQ(alone->first, 0);
  EXPECT_EQ(alone->count, 5);
}

TEST(ExpertShardTest, EveryExpertHasExactlyOneOwnerAndLocalIds) {
  for (int64_t n : {1, 2, 5, 6, 8, 256, 384}) {
    for (int64_t world = 1; world <= 8 && world <= n; ++world) {
      std::vector<int> owners(static_cast<size_t>(n), 0);
      for (int64_t r = 0; r < world; ++r) {
        auto shard = ExpertShardOf(n, world, r);
        ASSERT_TRUE(shard.ok());
        for (int64_t e = 0; e < n; ++e) {
          if (!shard->Owns(e)) {
            EXPECT_EQ(shard->Local(e), -1);
            continue;
          }
          ++owners[static_cast<size_t>(e)];
          EXPECT_EQ(ExpertOwner(n, world, e), r) << n << " " << world << " " << e;
          EXPECT_EQ(shard->Local(e), e - shard->first);
        }
      }
      for (int64_t e = 0; e < n; ++e) EXPECT_EQ(owners[static_cast<size_t>(e)], 1);
    }
  }
}

TEST(ExpertShardTest, RefusesGroupsItCannotSplit) {
  EXPECT_EQ(ExpertShardOf(4, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertShardOf(4, 2, 2).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertShardOf(4, 2, -1).status().code(), absl::StatusCode::kInvalidArgument);
  // Fewer experts than ranks: some rank would hold none.
  EXPECT_EQ(ExpertShardOf(3, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertOwner(8, 2, 8), -1);
  EXPECT_EQ(ExpertOwner(8, 2, -1), -1);
  EXPECT_EQ(ExpertOwner(3, 4, 0), -1);
}

TEST(PickRankTest, MostFreeSlotsLowestIndexFirst) {
  EXPECT_EQ(PickRank(std::vector<int64_t>{4, 4}), 0);
  EXPECT_EQ(PickRank(std::vector<int64_t>{3, 4}), 1);
  EXPECT_EQ(PickRank(std::vector<int64_t>{0, 0, 1}), 2);
  EXPECT_EQ(PickRank(std::vector<int64_t>{0, 0}), -1);
  EXPECT_EQ(PickRank(std::vector<int64_t>{}), -1);
  // Filling a group one request at a time alternates ranks.
  std::vector<int64_t> free = {3, 3};
  std::vector<int64_t> picked;
  for (int i = 0; i < 6; ++i) {
    const int64_t r = PickRank(free);
    picked.push_back(r);
    --free[static_cast<size_t>(r)];
  }
  EXPECT_EQ(picked, std::vector<int64_t>({0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(PickRank(free), -1);
}

TEST(GroupDecodeRowsTest, SmallestBucketHoldingTheLargestBatch) {
  const std::vector<int64_t> buckets = {1, 2, 4, 8, 12};
  EXPECT_EQ(*GroupDecodeRows(std::vector<int64_t>{3, 0}, buckets), 4);
  EXPECT_EQ(*GroupDecodeRows(std::vector<int64_t>{1, 1}, buckets), 1);
  EXPECT_EQ(*GroupDecodeRows(std::vector<int64_t>{0, 9}, buckets), 12);
  EXPECT_EQ(*GroupDecodeRows(std::vector<int64_t>{0, 0}, buckets), 0);
  EXPECT_EQ(GroupDecodeRows(std::vector<int64_t>{13, 0}, buckets).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GroupDecodeRows(std::vector<int64_t>{-1}, buckets).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PrefillRoundRowsTest, LongestChunkOfEachRound) {
  EXPECT_EQ(PrefillRoundRows({{64, 64, 10}, {7}, {}}), std::vector<int64_t>({64, 64, 10}));
  EXPECT_EQ(PrefillRoundRows({{5}, {64, 3}}), std::vector<int64_t>({64, 3}));
  EXPECT_TRUE(PrefillRoundRows({{}, {}}).empty());
  EXPECT_EQ(PrefillRoundRows({{1, 2, 3}}), std::vector<int64_t>({1, 2, 3}));
}

}  // namespace
}  // namespace pdserve::engine
