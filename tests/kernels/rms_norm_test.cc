#include "kernels/cpu/rms_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(RmsNormTest, WeightedScalesByInverseRms) {
  const std::vector<float> x = {3, 4};  // mean square 12.5
  const std::vector<float> w = {2, 0.5f};
  std::vector<float> y(2);
  RmsNorm(x.data(), w.data(), 1, 2, 0.0f, y.data());
  EXPECT_NEAR(y[0], 2 * 3 / std::sqrt(12.5f), 1e-6);
  EXPECT_NEAR(y[1], 0.5f * 4 / std::sqrt(12.5f), 1e-6);
}

TEST(RmsNormTest, UnweightedInPlacePerRowWithEps) {
  std::vector<float> x = {1, 1, 2, 2};
  RmsNorm(x.data(), nullptr, 2, 2, 1.0f, x.data());
  EXPECT_NEAR(x[0], 1 / std::sqrt(2.0f), 1e-6);
  EXPECT_NEAR(x[2], 2 / std::sqrt(5.0f), 1e-6);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
