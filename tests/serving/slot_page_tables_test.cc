// SlotPageTables: the CUDA engine's paged-state bookkeeping, on the host (no GPU needed).
#include "serving/slot_page_tables.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>
#include <vector>

namespace pdserve::serving {
namespace {

using Targets = std::vector<std::pair<int64_t, int64_t>>;

// Two kinds as a V4 model has them: rate 4 (CSA entries + indexer keys) and rate 128 (HCA),
// 4 entries per page so small positions cross pages.
SlotPageTablesOptions Options(int64_t slots, int64_t pages4, int64_t pages128, bool fixed) {
  SlotPageTablesOptions o;
  o.slots = slots;
  o.page_entries = 4;
  o.kinds = {{"rate4", 4, 16, pages4}, {"rate128", 128, 4, pages128}};
  o.fixed = fixed;
  return o;
}

TEST(SlotPageTablesTest, PagesFollowPositionNotCapacity) {
  auto t = *SlotPageTables::Create(Options(2, 8, 2, false));
  EXPECT_EQ(t->stride(0), 4);
  EXPECT_EQ(t->device_pages(0), 9);
  EXPECT_EQ(t->PagesAt(0, 3), 0);   // no entry yet
  EXPECT_EQ(t->PagesAt(0, 4), 1);   // entry 0
  EXPECT_EQ(t->PagesAt(0, 16), 1);  // entries 0..3: one page of 4
  EXPECT_EQ(t->PagesAt(0, 19), 1);  // still 4 entries
  EXPECT_EQ(t->PagesAt(0, 20), 2);  // entry 4 opens the second page
  EXPECT_EQ(t->PagesAt(0, 1000), 4);  // capped at entry_capacity 16
  EXPECT_EQ(t->PagesAt(1, 127), 0);
  EXPECT_EQ(t->PagesAt(1, 128), 1);
  ASSERT_TRUE(t->Grow(Targets{{0, 20}}).ok());
  EXPECT_EQ(t->held(0, 0), 2);
  EXPECT_EQ(t->held(1, 0), 0);
  EXPECT_EQ(t->pages_free(0), 6);
  // Device ids are pool pages + 1 (0 is the null page); the rest of the row stays null.
  std::span<const int32_t> row = t->Row(0, 0);
  EXPECT_EQ(row[0], 1);
  EXPECT_EQ(row[1], 2);
  EXPECT_EQ(row[2], 0);
  EXPECT_EQ(row[3], 0);
  EXPECT_EQ(t->Row(0, 2)[0], 0);  // the scratch row never holds pages
}

TEST(SlotPageTablesTest, GrowIsAllOrNothingAndReleaseReuses) {
  auto t = *SlotPageTables::Create(Options(3, 4, 2, false));
  ASSERT_TRUE(t->Grow(Targets{{0, 8}}).ok());  // 2 entries: 1 page
  EXPECT_TRUE(t->CanGrow(Targets{{1, 12}, {2, 8}}));
  EXPECT_FALSE(t->CanGrow(Targets{{1, 20}, {2, 20}}));  // 2 + 2 pages, 3 free
  const absl::Status short_pool = t->Grow(Targets{{1, 20}, {2, 20}});
  EXPECT_EQ(short_pool.code(), absl::StatusCode::kResourceExhausted) << short_pool;
  EXPECT_EQ(t->held(0, 1), 0);
  EXPECT_EQ(t->held(0, 2), 0);
  EXPECT_EQ(t->pages_free(0), 3);
  EXPECT_EQ(t->Grow(Targets{{1, 4}, {1, 8}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->Grow(Targets{{3, 4}}).code(), absl::StatusCode::kInvalidArgument);
  // Growing an already large enough slot takes nothing.
  ASSERT_TRUE(t->Grow(Targets{{0, 5}}).ok());
  EXPECT_EQ(t->held(0, 0), 1);
  ASSERT_TRUE(t->Grow(Targets{{1, 48}}).ok());  // 3 pages: the pool is empty
  EXPECT_EQ(t->pages_free(0), 0);
  EXPECT_EQ(t->Grow(Targets{{2, 4}}).code(), absl::StatusCode::kResourceExhausted);
  const RequestId before = t->owner(1);
  ASSERT_TRUE(t->Release(1).ok());
  EXPECT_NE(t->owner(1), before);
  EXPECT_EQ(t->pages_free(0), 3);
  for (int32_t id : t->Row(0, 1)) EXPECT_EQ(id, 0);
  ASSERT_TRUE(t->Grow(Targets{{2, 48}}).ok());
  // Slot 2 now holds the pages slot 1 had; no page is named twice.
  std::set<int32_t> named;
  for (int64_t s = 0; s < 3; ++s) {
    for (int64_t i = 0; i < t->held(0, s); ++i) {
      EXPECT_TRUE(named.insert(t->Row(0, s)[static_cast<size_t>(i)]).second);
    }
    EXPECT_TRUE(t->Verify(s).ok()) << t->Verify(s);
  }
}

TEST(SlotPageTablesTest, DirtyRowsAreReportedOnce) {
  auto t = *SlotPageTables::Create(Options(3, 8, 2, false));
  EXPECT_EQ(t->TakeDirty(), (std::vector<int64_t>{0, 1, 2, 3}));  // all rows at start
  EXPECT_TRUE(t->TakeDirty().empty());
  ASSERT_TRUE(t->Grow(Targets{{2, 4}, {0, 3}}).ok());  // slot 0 needs no page yet
  EXPECT_EQ(t->TakeDirty(), (std::vector<int64_t>{2}));
  ASSERT_TRUE(t->Release(1).ok());
  EXPECT_EQ(t->TakeDirty(), (std::vector<int64_t>{1}));
}

TEST(SlotPageTablesTest, FixedModeIsTheSlotLayout) {
  auto t = *SlotPageTables::Create(Options(2, 0, 0, true));
  EXPECT_EQ(t->device_pages(0), 2 * 4 + 1);
  EXPECT_EQ(t->Row(0, 1)[2], 1 + 1 * 4 + 2);
  ASSERT_TRUE(t->Grow(Targets{{0, 64}, {1, 64}}).ok());
  EXPECT_EQ(t->held(0, 1), 4);
  EXPECT_EQ(t->pages_free(0), 0);
  EXPECT_TRUE(t->Verify(1).ok());
  ASSERT_TRUE(t->Release(1).ok());
  EXPECT_EQ(t->Row(0, 1)[0], 1 + 4);  // the layout never moves
  EXPECT_EQ(t->InjectForeignPageForTest(0, 1).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SlotPageTablesTest, ForeignPageFailsOnlyTheVictim) {
  auto t = *SlotPageTables::Create(Options(3, 16, 2, false));
  ASSERT_TRUE(t->Grow(Targets{{0, 16}, {1, 16}, {2, 16}}).ok());
  for (int64_t s = 0; s < 3; ++s) ASSERT_TRUE(t->Verify(s).ok());
  ASSERT_TRUE(t->InjectForeignPageForTest(1, 2).ok());
  EXPECT_EQ(t->Row(0, 1)[0], t->Row(0, 2)[0]);
  const absl::Status victim = t->Verify(1);
  EXPECT_EQ(victim.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(victim.message().find("slot 1"), std::string::npos) << victim;
  EXPECT_NE(victim.message().find("owned by request"), std::string::npos) << victim;
  EXPECT_TRUE(t->Verify(0).ok());
  EXPECT_TRUE(t->Verify(2).ok());
  // Releasing the victim frees its own pages only; the donor keeps its page.
  ASSERT_TRUE(t->Release(1).ok());
  EXPECT_TRUE(t->Verify(2).ok());
  EXPECT_TRUE(t->Verify(1).ok());
  EXPECT_EQ(t->pages_free(0), 16 - 2);
}

TEST(SlotPageTablesTest, NoCommonKindMeansNoFault) {
  auto t = *SlotPageTables::Create(Options(2, 8, 2, false));
  ASSERT_TRUE(t->Grow(Targets{{0, 16}}).ok());
  EXPECT_EQ(t->InjectForeignPageForTest(1, 0).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SlotPageTablesTest, RejectsBadOptions) {
  SlotPageTablesOptions o = Options(2, 8, 2, false);
  o.kinds[0].entry_capacity = 6;  // not a multiple of 4
  EXPECT_EQ(SlotPageTables::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(2, 0, 2, false);
  EXPECT_EQ(SlotPageTables::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(0, 8, 2, false);
  EXPECT_EQ(SlotPageTables::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::serving
