// PlanTransfer: which pages of a DeepSeek-V4 PageTable travel after prefill, and their
// descriptors. Expected values are worked out by hand in the comments from docs/serving.md.
#include "kvtransfer/transfer_plan.h"

#include <gtest/gtest.h>

#include <set>
#include <utility>

namespace pdserve::kv {
namespace {

using serving::StateKind;

class TransferPlanTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // One layer of each type; window 8, CSA rate 4, HCA rate 16, 2 entries per page.
    auto layout = serving::StateLayout::Create({.sliding_layers = 1,
                                                .csa_layers = 1,
                                                .hca_layers = 1,
                                                .head_dim = 8,
                                                .index_head_dim = 4,
                                                .sliding_window = 8,
                                                .compress_rate_csa = 4,
                                                .compress_rate_hca = 16,
                                                .entries_per_page = 2});
    ASSERT_TRUE(layout.ok()) << layout.status();
    layout_ = std::make_unique<serving::StateLayout>(*layout);
    auto pool = serving::PagePool::Create(layout_->PoolOptions(2, kTotal + 16));
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    auto table = pool_->Allocate(1, layout_->Demand(kTotal));
    ASSERT_TRUE(table.ok()) << table.status();
    table_ = *table;
  }

  int32_t Kind(StateKind kind) const { return *layout_->KindIndex(kind); }

  static constexpr int64_t kTotal = 64;
  const std::vector<LayerAttention> layers_ = {LayerAttention::kSliding, LayerAttention::kCsa,
                                               LayerAttention::kHca};
  std::unique_ptr<serving::StateLayout> layout_;
  std::unique_ptr<serving::PagePool> pool_;
  serving::PageTable table_;
};

TEST_F(TransferPlanTest, SendsEachLayersFinalPagesInLayerOrder) {
  // Prompt 21: window rows of tokens [13, 21); CSA entries floor(21 / 4) = 5 on pages 0..2 (two
  // entries each), compressor open window [20, 21); HCA entries floor(21 / 16) = 1 on HCA page 0,
  // which is compressed page 8 (8 CSA pages of ceil(16 / 2) come first), open window [16, 21).
  auto plan = PlanTransfer(*layout_, layers_, table_, 21, kTotal);
  ASSERT_TRUE(plan.ok()) << plan.status();
  struct Want {
    StateKind kind;
    int32_t page;
    uint32_t layer, begin, end;
  };
  const std::vector<Want> want = {
      {StateKind::kWindow, 0, 0, 13, 21},        {StateKind::kWindow, 1, 1, 13, 21},
      {StateKind::kCompressed, 0, 1, 0, 8},      {StateKind::kIndexer, 0, 1, 0, 8},
      {StateKind::kCompressed, 1, 1, 8, 16},     {StateKind::kIndexer, 1, 1, 8, 16},
      {StateKind::kCompressed, 2, 1, 16, 20},    {StateKind::kIndexer, 2, 1, 16, 20},
      {StateKind::kCsaCompressor, 0, 1, 20, 21}, {StateKind::kWindow, 2, 2, 13, 21},
      {StateKind::kCompressed, 8, 2, 0, 16},     {StateKind::kHcaCompressor, 0, 2, 16, 21}};
  ASSERT_EQ(plan->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const PlannedPage& got = (*plan)[i];
    EXPECT_EQ(got.handle, table_.pages[Kind(want[i].kind)][want[i].page]) << "slot " << i;
    EXPECT_EQ(got.descriptor.layer, want[i].layer) << "slot " << i;
    EXPECT_EQ(got.descriptor.page_index, static_cast<uint32_t>(want[i].page)) << "slot " << i;
    EXPECT_EQ(got.descriptor.token_begin, want[i].begin) << "slot " << i;
    EXPECT_EQ(got.descriptor.token_end, want[i].end) << "slot " << i;
    EXPECT_EQ(got.descriptor.bytes, static_cast<uint64_t>(layout_->Kind(want[i].kind).page_bytes()))
        << "slot " << i;
  }
}

TEST_F(TransferPlanTest, OneTokenPromptSendsWindowsAndCompressorsOnly) {
  auto plan = PlanTransfer(*layout_, layers_, table_, 1, kTotal);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Three window pages and two compressor pages; no entry is complete yet.
  EXPECT_EQ(plan->size(), 5u);
  std::set<std::pair<int32_t, int32_t>> distinct;
  for (const PlannedPage& page : *plan) distinct.insert({page.handle.kind, page.handle.page});
  EXPECT_EQ(distinct.size(), plan->size());
}

TEST_F(TransferPlanTest, RejectsLayerTypesThatDisagreeWithTheLayout) {
  const std::vector<LayerAttention> wrong = {LayerAttention::kCsa, LayerAttention::kCsa,
                                             LayerAttention::kHca};
  EXPECT_EQ(PlanTransfer(*layout_, wrong, table_, 21, kTotal).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TransferPlanTest, RejectsAPromptLongerThanTheReservation) {
  EXPECT_EQ(PlanTransfer(*layout_, layers_, table_, kTotal + 1, kTotal).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanTransfer(*layout_, layers_, table_, 21, kTotal * 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TransferPlanTest, TableEpochIsTheAllocationsFirstEpoch) {
  uint64_t smallest = ~uint64_t{0};
  for (const auto& kind : table_.pages) {
    for (const auto& handle : kind) smallest = std::min(smallest, handle.epoch);
  }
  EXPECT_EQ(TableEpoch(table_), smallest);
  auto other = pool_->Allocate(2, layout_->Demand(16));
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_GT(TableEpoch(*other), TableEpoch(table_));
}

}  // namespace
}  // namespace pdserve::kv
