#include "kernels/cpu/dot.h"

#include <gtest/gtest.h>

#include <vector>

namespace pdserve::kernels::cpu {
namespace {

TEST(DotTest, MatchesSumOfProductsAcrossLaneTail) {
  for (int64_t n : {0, 1, 15, 16, 17, 40}) {
    std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
    double expected = 0;
    for (int64_t i = 0; i < n; ++i) {
      a[i] = 0.5f * static_cast<float>(i) - 3.0f;
      b[i] = static_cast<float>(i % 7) - 2.0f;
      expected += static_cast<double>(a[i]) * b[i];
    }
    EXPECT_FLOAT_EQ(Dot(a.data(), b.data(), n), static_cast<float>(expected)) << n;
  }
}

}  // namespace
}  // namespace pdserve::kernels::cpu
