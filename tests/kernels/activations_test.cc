#include "kernels/cpu/activations.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(ActivationsTest, SqrtSoftplusValues) {
  EXPECT_NEAR(SqrtSoftplus(0.0f), std::sqrt(std::log(2.0f)), 1e-6);
  EXPECT_NEAR(SqrtSoftplus(30.0f), std::sqrt(30.0f), 1e-5);  // linear branch above 20
}

TEST(ActivationsTest, SwiGluClampsGateAboveAndUpBothWays) {
  const std::vector<float> gate = {5.0f, -1.0f};
  const std::vector<float> up = {-9.0f, 9.0f};
  std::vector<float> out(2);
  ClampedSwiGlu(gate.data(), up.data(), 2, 2.0f, out.data());
  EXPECT_NEAR(out[0], Silu(2.0f) * -2.0f, 1e-6);
  EXPECT_NEAR(out[1], Silu(-1.0f) * 2.0f, 1e-6);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
