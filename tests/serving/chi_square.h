// Pearson's chi-square goodness-of-fit test for sampler distributions (test helper).
#pragma once

#include <cstdint>
#include <vector>

namespace pdserve::serving::testing {

// P(X >= x) for X chi-square distributed with `dof` degrees of freedom: the regularized upper
// incomplete gamma function Q(dof / 2, x / 2), by its power series below a + 1 and Lentz's
// continued fraction above (Press et al., Numerical Recipes, 3rd ed., section 6.2).
double ChiSquareSurvival(double x, int dof);

struct ChiSquareResult {
  double statistic = 0.0;
  int dof = 0;
  double p_value = 0.0;
};

// Compares `counts` with `expected` probabilities (same length, summing to 1). Categories with
// expected probability 0 are left out of the statistic; the caller asserts their counts are 0.
ChiSquareResult ChiSquareTest(const std::vector<int64_t>& counts,
                              const std::vector<double>& expected);

}  // namespace pdserve::serving::testing
