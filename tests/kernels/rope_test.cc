#include "kernels/cpu/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(RopeTest, RotatesTrailingPairsOnly) {
  // One row, one head of 4 channels: [nope0, nope1 | a, b], rope_dim 2, angle 90 degrees.
  std::vector<float> x = {5, 6, 1, 2};
  const float c = 0.0f, s = 1.0f;
  ApplyInterleavedRope(x.data(), 1, 4, 1, 4, 2, &c, &s, /*inverse=*/false);
  EXPECT_EQ(x, (std::vector<float>{5, 6, -2, 1}));
}

TEST(RopeTest, InverseUndoesForward) {
  std::vector<float> x = {0.3f, -1.2f, 0.7f, 2.0f, 1.5f, -0.4f, 0.9f, 0.1f};  // 2 heads x 4
  const std::vector<float> original = x;
  const std::vector<float> cos = {std::cos(0.7f), std::cos(2.1f)};
  const std::vector<float> sin = {std::sin(0.7f), std::sin(2.1f)};
  ApplyInterleavedRope(x.data(), 1, 8, 2, 4, 4, cos.data(), sin.data(), false);
  EXPECT_NE(x, original);
  ApplyInterleavedRope(x.data(), 1, 8, 2, 4, 4, cos.data(), sin.data(), true);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], original[i], 1e-6);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
