#include "tests/serving/chi_square.h"

#include <cmath>

#include "gtest/gtest.h"

namespace pdserve::serving::testing {
namespace {

// Closed forms: for 2 degrees of freedom Q = exp(-x / 2); for 1, Q = erfc(sqrt(x / 2)); for 4,
// Q = exp(-x / 2) (1 + x / 2).
TEST(ChiSquareSurvivalTest, MatchesClosedFormsOnBothBranches) {
  for (double x : {0.1, 1.0, 3.0, 10.0, 30.0, 80.0}) {
    EXPECT_NEAR(ChiSquareSurvival(x, 2), std::exp(-x / 2), 1e-12 * std::exp(-x / 2) + 1e-15) << x;
    EXPECT_NEAR(ChiSquareSurvival(x, 1), std::erfc(std::sqrt(x / 2)), 1e-10) << x;
    EXPECT_NEAR(ChiSquareSurvival(x, 4), std::exp(-x / 2) * (1 + x / 2), 1e-10) << x;
  }
}

TEST(ChiSquareTestTest, PerfectFitHasStatisticZero) {
  const ChiSquareResult result = ChiSquareTest({250, 250, 500}, {0.25, 0.25, 0.5});
  EXPECT_EQ(result.statistic, 0.0);
  EXPECT_EQ(result.dof, 2);
  EXPECT_EQ(result.p_value, 1.0);
}

TEST(ChiSquareTestTest, SkipsZeroProbabilityCategories) {
  // (60 - 50)^2 / 50 + (40 - 50)^2 / 50 = 4 over 1 degree of freedom.
  const ChiSquareResult result = ChiSquareTest({60, 0, 40}, {0.5, 0.0, 0.5});
  EXPECT_DOUBLE_EQ(result.statistic, 4.0);
  EXPECT_EQ(result.dof, 1);
  EXPECT_NEAR(result.p_value, std::erfc(std::sqrt(2.0)), 1e-10);
}

}  // namespace
}  // namespace pdserve::serving::testing
