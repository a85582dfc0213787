#include "kernels/cpu/sink_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(SinkAttentionTest, WeightsKeysBySoftmaxWithSink) {
  // Two heads, dim 2, two keys. Head 0: logits (0, log 2) plus sink 0 -> weights 1/4, 2/4.
  const std::vector<float> k0 = {1.0f, 0.0f}, k1 = {0.0f, 1.0f};
  const float* keys[] = {k0.data(), k1.data()};
  const std::vector<float> q = {0.0f, std::log(2.0f), 0.0f, 0.0f};
  const std::vector<float> sinks = {0.0f, -1000.0f};
  std::vector<float> out(4), scratch(2);
  SinkAttention(q.data(), 2, 2, keys, 2, sinks.data(), 1.0f, out.data(), scratch.data());
  EXPECT_NEAR(out[0], 0.25f, 1e-6);
  EXPECT_NEAR(out[1], 0.5f, 1e-6);
  EXPECT_NEAR(out[2], 0.5f, 1e-6);  // head 1: sink negligible, equal weights
  EXPECT_NEAR(out[3], 0.5f, 1e-6);
}

TEST(SinkAttentionTest, NoKeysGivesZero) {
  const std::vector<float> q = {1.0f, 2.0f};
  const float sink = 0.0f;
  std::vector<float> out = {9.0f, 9.0f};
  SinkAttention(q.data(), 1, 2, nullptr, 0, &sink, 1.0f, out.data(), nullptr);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 0.0f}));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
