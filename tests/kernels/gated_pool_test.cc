#include "kernels/cpu/gated_pool.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(GatedPoolTest, PerChannelSoftmaxWeights) {
  const std::vector<float> kv0 = {1.0f, 10.0f}, kv1 = {3.0f, 20.0f};
  const std::vector<float> g0 = {0.0f, std::log(3.0f)}, g1 = {0.0f, 0.0f};
  const float* kv[] = {kv0.data(), kv1.data()};
  const float* gate[] = {g0.data(), g1.data()};
  std::vector<float> out(2);
  GatedPool(kv, gate, 2, 2, out.data());
  EXPECT_FLOAT_EQ(out[0], 2.0f);  // equal weights
  EXPECT_FLOAT_EQ(out[1], 0.75f * 10 + 0.25f * 20);
}

TEST(GatedPoolTest, MinusInfGateDropsRow) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> kv0 = {100.0f}, kv1 = {4.0f};
  const std::vector<float> g0 = {-inf}, g1 = {-3.0f};
  const float* kv[] = {kv0.data(), kv1.data()};
  const float* gate[] = {g0.data(), g1.data()};
  float out = 0;
  GatedPool(kv, gate, 2, 1, &out);
  EXPECT_FLOAT_EQ(out, 4.0f);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
