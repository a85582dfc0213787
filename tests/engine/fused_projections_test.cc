// The host side of the GPU engine's fused projections (engine/fused_projections.h): the groups,
// the row layout, and the stacking of weight rows and FP8 block scales.
#include "engine/fused_projections.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "engine/config.h"

namespace pdserve::engine {
namespace {

const std::string kV4Configs = PDSERVE_ENGINE_FIXTURES_DIR "/../v4_configs";

TEST(FusedLayoutTest, PartsStartOnWholeScaleRowsAndTheLastIsNotPadded) {
  auto layout = PlanFusedLayout({1024, 64, 128, 200, 16}, 256);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->row_offset, (std::vector<int64_t>{0, 1024, 1152, 1280, 1536}));
  EXPECT_EQ(layout->rows, 1552);
  EXPECT_EQ(layout->cols, 256);
  EXPECT_EQ(layout->padding_rows(), 64 + 56);  // after the 64-row and the 200-row parts
  EXPECT_EQ(layout->scale_rows(), 13);         // ceil(1552 / 128)
}

TEST(FusedLayoutTest, RefusesEmptyAndDegenerateParts) {
  EXPECT_FALSE(PlanFusedLayout({}, 128).ok());
  EXPECT_FALSE(PlanFusedLayout({128, 0}, 128).ok());
  EXPECT_FALSE(PlanFusedLayout({128}, 0).ok());
}

TEST(FusedLayoutTest, StackRowsPlacesEachPartAtItsOffsetAndZeroesThePadding) {
  auto layout = PlanFusedLayout({2, 130, 1}, 3);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->row_offset, (std::vector<int64_t>{0, 128, 384}));
  std::vector<float> a(2 * 3), b(130 * 3), c(1 * 3);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 1.0f + static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = 100.0f + static_cast<float>(i);
  for (size_t i = 0; i < c.size(); ++i) c[i] = -1.0f - static_cast<float>(i);
  const std::vector<float> s = StackRows<float>(*layout, {a.data(), b.data(), c.data()});
  ASSERT_EQ(s.size(), static_cast<size_t>(385 * 3));
  EXPECT_EQ(s[0], 1.0f);
  EXPECT_EQ(s[5], 6.0f);                      // a's last element (row 1, col 2)
  EXPECT_EQ(s[2 * 3], 0.0f);                  // row 2: padding
  EXPECT_EQ(s[127 * 3 + 2], 0.0f);            // row 127: padding
  EXPECT_EQ(s[128 * 3], 100.0f);              // b's first row
  EXPECT_EQ(s[(128 + 129) * 3 + 2], 489.0f);  // b's last element: 100 + 130 * 3 - 1
  EXPECT_EQ(s[(258) * 3], 0.0f);              // after b, before c
  EXPECT_EQ(s[384 * 3], -1.0f);               // c
  EXPECT_EQ(s[384 * 3 + 2], -3.0f);
}

TEST(FusedLayoutTest, StackRowsOfFp8BytesKeepsTheBytes) {
  auto layout = PlanFusedLayout({1, 1}, 2);
  ASSERT_TRUE(layout.ok());
  const std::vector<uint8_t> a = {0x38, 0xB8}, b = {0x7E, 0x01};
  const std::vector<uint8_t> s = StackRows<uint8_t>(*layout, {a.data(), b.data()});
  ASSERT_EQ(s.size(), static_cast<size_t>(129 * 2));
  EXPECT_EQ(s[0], 0x38);
  EXPECT_EQ(s[1], 0xB8);
  EXPECT_EQ(s[2], 0x00);  // padding: e4m3 +0
  EXPECT_EQ(s[128 * 2], 0x7E);
  EXPECT_EQ(s[128 * 2 + 1], 0x01);
}

TEST(FusedLayoutTest, BlockScalesStackOnWholeScaleRows) {
  // Parts of 256, 64 and 300 rows over 384 columns (3 column blocks): scale rows 2, 1 and 3, at
  // scale rows 0, 2 and 3 of the stacked [6, 3].
  auto layout = PlanFusedLayout({256, 64, 300}, 384);
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->row_offset, (std::vector<int64_t>{0, 256, 384}));
  ASSERT_EQ(layout->scale_rows(), 6);
  const std::vector<float> a = {1, 2, 3, 4, 5, 6}, b = {7, 8, 9};
  const std::vector<float> c = {10, 11, 12, 13, 14, 15, 16, 17, 18};
  const std::vector<float> s = StackBlockScales(*layout, {a.data(), b.data(), c.data()});
  EXPECT_EQ(s, (std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}));
  // A padded part: 64 rows then 128: the first part's one scale row covers its padding.
  auto padded = PlanFusedLayout({64, 128}, 128);
  ASSERT_TRUE(padded.ok());
  const std::vector<float> p = {0.5f}, q = {0.25f};
  EXPECT_EQ(StackBlockScales(*padded, {p.data(), q.data()}), (std::vector<float>{0.5f, 0.25f}));
}

TEST(FusedGroupsTest, V4FlashGroupsAreTheProjectionsOfOneInputWithoutPadding) {
  auto c = ModelConfig::Load(kV4Configs + "/flash");
  ASSERT_TRUE(c.ok()) << c.status();
  int64_t csa = -1, hca = -1, sliding = -1;
  for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
    const LayerType t = c->layer_types[static_cast<size_t>(l)];
    if (t == LayerType::kCompressedSparseAttention && csa < 0) csa = l;
    if (t == LayerType::kHeavilyCompressedAttention && hca < 0) hca = l;
    if (t == LayerType::kSlidingAttention && sliding < 0) sliding = l;
  }
  ASSERT_GE(csa, 0);
  ASSERT_GE(hca, 0);
  const FusedGroupSpec g = AttentionInputGroup(*c, csa);
  ASSERT_EQ(g.names.size(), 7u);
  EXPECT_EQ(g.names[0], "model.layers." + std::to_string(csa) + ".self_attn.q_a_proj.weight");
  EXPECT_EQ(g.names[6], "model.layers." + std::to_string(csa) +
                            ".self_attn.compressor.indexer.scorer.weights_proj.weight");
  // q_a 1024, kv 512, compressor kv / gate 2 x 512, indexer compressor 2 x 128 each, weights 64.
  EXPECT_EQ(g.rows, (std::vector<int64_t>{1024, 512, 1024, 1024, 256, 256, 64}));
  auto layout = PlanFusedLayout(g.rows, g.cols);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->rows, 4160);
  EXPECT_EQ(layout->cols, 4096);
  EXPECT_EQ(layout->row_offset.back(), 4096);
  EXPECT_EQ(AttentionInputGroup(*c, hca).rows, (std::vector<int64_t>{1024, 512, 512, 512}));
  if (sliding >= 0) {
    EXPECT_EQ(AttentionInputGroup(*c, sliding).rows.size(), 2u);
  }
  const FusedGroupSpec f = FfnInputGroup(*c, 0);
  EXPECT_EQ(f.rows, (std::vector<int64_t>{2048, 2048}));
  EXPECT_EQ(f.names[1], "model.layers.0.mlp.shared_experts.up_proj.weight");
  EXPECT_EQ(FusedOutputWidth(*c), 4160);
  EXPECT_EQ(FusedPaddingRows(*c), 0);  // the HBM the fusion adds on V4-Flash: none
}

TEST(FusedGroupsTest, V4ProHasNoPaddingEither) {
  auto c = ModelConfig::Load(kV4Configs + "/pro");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(FusedPaddingRows(*c), 0);
  EXPECT_GT(FusedOutputWidth(*c), c->q_lora_rank);
}

TEST(FusedGroupsTest, TheBundledModelPadsItsSmallParts) {
  auto c = ModelConfig::Load(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(c.ok()) << c.status();
  // kjv-v4-tiny: q_lora 128, head_dim 64, index_head_dim 32, 16 indexer heads; layer 1 is CSA.
  ASSERT_EQ(c->layer_types[1], LayerType::kCompressedSparseAttention);
  const FusedGroupSpec g = AttentionInputGroup(*c, 1);
  EXPECT_EQ(g.rows, (std::vector<int64_t>{128, 64, 128, 128, 64, 64, 16}));
  auto layout = PlanFusedLayout(g.rows, g.cols);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->row_offset, (std::vector<int64_t>{0, 128, 256, 384, 512, 640, 768}));
  EXPECT_EQ(layout->rows, 784);
  EXPECT_EQ(layout->padding_rows(), 64 + 64 + 64);
  EXPECT_EQ(FusedOutputWidth(*c), 784);
}

}  // namespace
}  // namespace pdserve::engine
