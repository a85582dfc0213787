#include "serving/state_layout.h"

#include <set>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::serving {
namespace {

using ::testing::ElementsAre;

// 2 sliding, 3 CSA and 1 HCA layers; window 8, CSA rate 4, HCA rate 16, 2 entries per page.
StateDims SmallDims() {
  StateDims dims;
  dims.sliding_layers = 2;
  dims.csa_layers = 3;
  dims.hca_layers = 1;
  dims.head_dim = 8;
  dims.index_head_dim = 4;
  dims.sliding_window = 8;
  dims.compress_rate_csa = 4;
  dims.compress_rate_hca = 16;
  dims.entries_per_page = 2;
  return dims;
}

StateLayout SmallLayout() { return std::move(StateLayout::Create(SmallDims())).value(); }

TEST(StateLayoutTest, DemandCountsPagesPerKind) {
  // 40 tokens: 10 CSA entries (5 pages per CSA layer), 2 HCA entries (1 page).
  // window 6 layers x 1; compressed 3 x 5 + 1; indexer 3 x 5; one compressor page per layer.
  EXPECT_THAT(SmallLayout().Demand(40), ElementsAre(6, 16, 15, 3, 1));
}

TEST(StateLayoutTest, KindsHaveTheRowsOfEachState) {
  const StateLayout layout = SmallLayout();
  const PageKind window = layout.Kind(StateKind::kWindow);
  EXPECT_EQ(window.name, "window");
  EXPECT_EQ(window.rows_per_page, 8);
  EXPECT_EQ(window.row_bytes, 32);
  EXPECT_EQ(layout.Kind(StateKind::kIndexer).row_bytes, 16);
  const PageKind csa = layout.Kind(StateKind::kCsaCompressor);
  EXPECT_EQ(csa.rows_per_page, 12);  // 4 open-window, 4 indexer open-window, 4 overlap rows
  EXPECT_EQ(csa.row_bytes, 128);     // [kv 2 x 8 | gate 2 x 8] fp32
  const PageKind hca = layout.Kind(StateKind::kHcaCompressor);
  EXPECT_EQ(hca.rows_per_page, 16);
  EXPECT_EQ(hca.row_bytes, 64);
}

TEST(StateLayoutTest, WindowIsARingBufferOfOnePagePerLayer) {
  const StateLayout layout = SmallLayout();
  const StateSlot slot = layout.WindowSlot(5, 9);
  EXPECT_EQ(slot.page, 5);
  EXPECT_EQ(slot.row, 1);
}

TEST(StateLayoutTest, EveryEntryHasItsOwnSlotInsideTheDemand) {
  const StateLayout layout = SmallLayout();
  for (int64_t tokens : {1, 4, 7, 40, 63, 64, 65}) {
    const PageDemand demand = layout.Demand(tokens);
    std::set<std::pair<int64_t, int64_t>> compressed;
    std::set<std::pair<int64_t, int64_t>> indexer;
    for (int64_t nth = 0; nth < 3; ++nth) {
      for (int64_t entry = 0; entry < StateLayout::Entries(tokens, 4); ++entry) {
        const StateSlot c = layout.CompressedSlot(true, nth, entry, tokens);
        const StateSlot i = layout.IndexerSlot(nth, entry, tokens);
        ASSERT_LT(c.page, demand[1]) << tokens;
        ASSERT_LT(i.page, demand[2]) << tokens;
        EXPECT_TRUE(compressed.insert({c.page, c.row}).second) << tokens;
        EXPECT_TRUE(indexer.insert({i.page, i.row}).second) << tokens;
      }
    }
    for (int64_t entry = 0; entry < StateLayout::Entries(tokens, 16); ++entry) {
      const StateSlot c = layout.CompressedSlot(false, 0, entry, tokens);
      ASSERT_LT(c.page, demand[1]) << tokens;
      EXPECT_TRUE(compressed.insert({c.page, c.row}).second) << tokens;
    }
  }
}

TEST(StateLayoutTest, PoolHoldsAnySplitOfTheTokenCapacity) {
  const StateLayout layout = SmallLayout();
  for (const std::vector<int64_t>& split :
       std::vector<std::vector<int64_t>>{{40, 40, 40, 40}, {1, 1, 1, 157}, {63, 33, 63, 1}}) {
    auto pool = PagePool::Create(layout.PoolOptions(4, 160));
    ASSERT_TRUE(pool.ok()) << pool.status();
    for (size_t i = 0; i < split.size(); ++i) {
      EXPECT_TRUE((*pool)->Allocate(i, layout.Demand(split[i])).ok()) << split[i];
    }
  }
}

TEST(StateLayoutTest, KindsWithoutLayersAreLeftOut) {
  StateDims dims = SmallDims();
  dims.hca_layers = 0;
  auto layout = StateLayout::Create(dims);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_FALSE(layout->KindIndex(StateKind::kHcaCompressor).has_value());
  EXPECT_EQ(layout->KindIndex(StateKind::kCsaCompressor), 3);
  EXPECT_EQ(layout->Demand(40).size(), 4u);
  EXPECT_EQ(layout->PoolOptions(1, 40).kinds.size(), 4u);
}

TEST(StateLayoutTest, RejectsIndexerWiderThanHeads) {
  StateDims dims = SmallDims();
  dims.index_head_dim = 16;
  EXPECT_EQ(StateLayout::Create(dims).status().message(),
            "index_head_dim (16) must not exceed head_dim (8): indexer buffers share the CSA "
            "compressor page's rows");
}

}  // namespace
}  // namespace pdserve::serving
