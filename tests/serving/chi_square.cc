#include "tests/serving/chi_square.h"

#include <cmath>

namespace pdserve::serving::testing {
namespace {

constexpr int kMaxIterations = 1000;
constexpr double kEpsilon = 1e-15;
constexpr double kTiny = 1e-300;

// Regularized lower incomplete gamma P(a, x) by its power series; converges fast for x < a + 1.
double LowerSeries(double a, double x) {
  double term = 1.0 / a;
  double sum = term;
  for (int n = 1; n < kMaxIterations; ++n) {
    term *= x / (a + n);
    sum += term;
    if (std::fabs(term) < std::fabs(sum) * kEpsilon) break;
  }
  return sum * std::exp(-x + a * std::log(x) - std::lgamma(a));
}

// Regularized upper incomplete gamma Q(a, x) by its continued fraction; for x >= a + 1.
double UpperFraction(double a, double x) {
  double b = x + 1.0 - a;
  double c = 1.0 / kTiny;
  double d = 1.0 / b;
  double h = d;
  for (int i = 1; i < kMaxIterations; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::fabs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < kEpsilon) break;
  }
  return std::exp(-x + a * std::log(x) - std::lgamma(a)) * h;
}

}  // namespace

double ChiSquareSurvival(double x, int dof) {
  if (x <= 0.0) return 1.0;
  const double a = dof / 2.0;
  const double half_x = x / 2.0;
  return half_x < a + 1.0 ? 1.0 - LowerSeries(a, half_x) : UpperFraction(a, half_x);
}

ChiSquareResult ChiSquareTest(const std::vector<int64_t>& counts,
                              const std::vector<double>& expected) {
  int64_t total = 0;
  for (int64_t count : counts) total += count;
  ChiSquareResult result;
  int categories = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) continue;
    const double mean = expected[i] * static_cast<double>(total);
    const double diff = static_cast<double>(counts[i]) - mean;
    result.statistic += diff * diff / mean;
    ++categories;
  }
  result.dof = categories - 1;
  result.p_value = ChiSquareSurvival(result.statistic, result.dof);
  return result;
}

}  // namespace pdserve::serving::testing
