#include "kernels/cpu/sink_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(SinkAttentionTest, WeightsKeysBySoftmaxWithSink) {
  // One query, two heads, dim 2, two keys. Head 0: logits (0, log 2) plus sink 0 -> weights
  // 1/4, 2/4; head 1: sink negligible, equal weights.
  const std::vector<float> keys = {1.0f, 0.0f, 0.0f, 1.0f};
  const std::vector<float> q = {0.0f, std::log(2.0f), 0.0f, 0.0f};
  const std::vector<float> sinks = {0.0f, -1000.0f};
  const std::vector<uint8_t> visible = {1, 1};
  std::vector<float> out(4);
  SinkAttention(q.data(), 1, 2, 2, keys.data(), 2, visible.data(), sinks.data(), 1.0f, out.data());
  EXPECT_NEAR(out[0], 0.25f, 1e-6);
  EXPECT_NEAR(out[1], 0.5f, 1e-6);
  EXPECT_NEAR(out[2], 0.5f, 1e-6);
  EXPECT_NEAR(out[3], 0.5f, 1e-6);
}

TEST(SinkAttentionTest, InvisibleKeysGetNoWeightPerQuery) {
  // Two queries over the same two keys; query 0 sees only key 0, query 1 only key 1.
  const std::vector<float> keys = {3.0f, 5.0f};  // dim 1
  const std::vector<float> q = {0.0f, 0.0f};
  const float sink = -1000.0f;
  const std::vector<uint8_t> visible = {1, 0, 0, 1};
  std::vector<float> out(2);
  SinkAttention(q.data(), 2, 1, 1, keys.data(), 2, visible.data(), &sink, 1.0f, out.data());
  EXPECT_NEAR(out[0], 3.0f, 1e-5);
  EXPECT_NEAR(out[1], 5.0f, 1e-5);
}

TEST(SinkAttentionTest, NoKeysGivesZero) {
  const std::vector<float> q = {1.0f, 2.0f};
  const float sink = 0.0f;
  std::vector<float> out = {9.0f, 9.0f};
  SinkAttention(q.data(), 1, 1, 2, nullptr, 0, nullptr, &sink, 1.0f, out.data());
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.0f}));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
