#include "kernels/cpu/softmax.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace pdserve::kernels::cpu {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(SoftmaxTest, MaskedEntriesGetZero) {
  std::vector<float> x = {0.0f, -kInf, std::log(3.0f)};
  Softmax(x.data(), 3);
  EXPECT_FLOAT_EQ(x[0], 0.25f);
  EXPECT_EQ(x[1], 0.0f);
  EXPECT_FLOAT_EQ(x[2], 0.75f);
}

TEST(SoftmaxTest, SinkTakesItsShareAndIsDropped) {
  std::vector<float> x = {0.0f, 0.0f};
  SoftmaxWithSink(x.data(), 2, std::log(2.0f));  // weights 1, 1, 2
  EXPECT_FLOAT_EQ(x[0], 0.25f);
  EXPECT_FLOAT_EQ(x[1], 0.25f);
}

TEST(SoftmaxTest, SinkAloneWhenNoKeys) {
  std::vector<float> x = {-kInf};
  SoftmaxWithSink(x.data(), 1, 100.0f);
  EXPECT_EQ(x[0], 0.0f);
}

}  // namespace
}  // namespace pdserve::kernels::cpu
