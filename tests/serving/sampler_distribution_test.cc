// Chi-square tests of the sampler's distribution against probabilities worked out by hand.
//
// The logits are ln(q) for q = (0.4, 0.3, 0.15, 0.1, 0.05), so each filter's expected
// distribution is a short calculation on q, written next to each test.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "serving/sampler.h"
#include "tests/serving/chi_square.h"

namespace pdserve::serving {
namespace {

using testing::ChiSquareTest;

constexpr int kDraws = 100000;
// A correct sampler fails a test at this level once in 10^4 runs; the draws are fixed by the seed,
// so a passing test passes every time.
constexpr double kSignificance = 1e-4;

std::vector<float> LogQ() {
  return {std::log(0.4f), std::log(0.3f), std::log(0.15f), std::log(0.1f), std::log(0.05f)};
}

// Token counts over kDraws positions of one (seed, choice) stream.
std::vector<int64_t> Draw(const SamplingParams& params, uint64_t seed = 2024) {
  const std::vector<float> logits = LogQ();
  const TokenHistory history(std::span<const int32_t>{});
  std::vector<int64_t> counts(logits.size(), 0);
  for (uint32_t position = 0; position < kDraws; ++position) {
    auto sampled = SampleToken(logits, params, {}, history, {seed, 0, position});
    EXPECT_TRUE(sampled.ok()) << sampled.status();
    if (sampled.ok()) ++counts[sampled->token];
  }
  return counts;
}

void ExpectFits(const std::vector<int64_t>& counts, const std::vector<double>& expected) {
  for (size_t t = 0; t < expected.size(); ++t) {
    if (expected[t] == 0.0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " is filtered out";
    }
  }
  const auto result = ChiSquareTest(counts, expected);
  EXPECT_GT(result.p_value, kSignificance)
      << "chi-square " << result.statistic << " over " << result.dof << " degrees of freedom";
}

TEST(SamplerDistributionTest, TemperatureScalesLogits) {
  SamplingParams params;
  params.temperature = 0.5;
  // softmax(ln q / 0.5) is proportional to q^2 = (0.16, 0.09, 0.0225, 0.01, 0.0025), sum 0.285.
  ExpectFits(Draw(params),
             {0.16 / 0.285, 0.09 / 0.285, 0.0225 / 0.285, 0.01 / 0.285, 0.0025 / 0.285});
}

TEST(SamplerDistributionTest, UnitTemperatureReproducesSoftmax) {
  SamplingParams params;
  params.temperature = 1.0;
  ExpectFits(Draw(params), {0.4, 0.3, 0.15, 0.1, 0.05});
}

TEST(SamplerDistributionTest, TopKKeepsTheKMostLikely) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 3;
  // (0.4, 0.3, 0.15) renormalized by 0.85.
  ExpectFits(Draw(params), {0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0.0, 0.0});
}

TEST(SamplerDistributionTest, TopPKeepsTheSmallestPrefixReachingP) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_p = 0.65;
  // Running sums 0.4, 0.7: the second token reaches 0.65, so (0.4, 0.3) renormalized by 0.7.
  ExpectFits(Draw(params), {0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0});
}

TEST(SamplerDistributionTest, MinPKeepsTokensAboveAFractionOfTheMostLikely) {
  SamplingParams params;
  params.temperature = 1.0;
  params.min_p = 0.2;
  // Threshold 0.2 * 0.4 = 0.08 keeps (0.4, 0.3, 0.15, 0.1), renormalized by 0.95.
  ExpectFits(Draw(params), {0.4 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0.0});
}

TEST(SamplerDistributionTest, TopPAppliesToTheTopKSetRenormalized) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 3;
  params.top_p = 0.8;
  // Top-3 probabilities (0.4, 0.3, 0.15) / 0.85 = (0.47, 0.35, 0.18): running sums 0.47, 0.82
  // reach 0.8 at the second token, where over the full vocabulary (0.4, 0.7, 0.85) it would be
  // the third.
  ExpectFits(Draw(params), {0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0, 0.0});
}

TEST(SamplerDistributionTest, ChiSquareRejectsTheWrongDistribution) {
  SamplingParams params;
  params.temperature = 0.5;
  // The draws follow q^2 / 0.285; the unscaled softmax q must be rejected by the same test.
  const auto result = ChiSquareTest(Draw(params), {0.4, 0.3, 0.15, 0.1, 0.05});
  EXPECT_LT(result.p_value, kSignificance) << "chi-square " << result.statistic;
}

TEST(SamplerDistributionTest, ChiSquareRejectsAnOffByOneFilter) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 3;
  // The draws follow top-3; a top-4 expectation (an off-by-one in k) must be rejected.
  const auto result =
      ChiSquareTest(Draw(params), {0.4 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.1 / 0.95, 0.0});
  EXPECT_LT(result.p_value, kSignificance) << "chi-square " << result.statistic;
}

}  // namespace
}  // namespace pdserve::serving
