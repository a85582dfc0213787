#include "loadgen/stats.h"

#include <gtest/gtest.h>

namespace pdserve::loadgen {
namespace {

RequestSample Completed(double ttft_s, double e2e_s, int64_t output_tokens) {
  RequestSample s;
  s.ttft_s = ttft_s;
  s.e2e_s = e2e_s;
  s.output_tokens = output_tokens;
  return s;
}

TEST(PercentileTest, InterpolatesBetweenClosestRanksLikeNumpy) {
  // numpy.percentile([1, 2, 3, 4], q) for q = 0, 50, 90, 99, 100.
  const std::vector<double> v = {4, 1, 3, 2};
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1.0);
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 2.5);
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 3.7);
  EXPECT_DOUBLE_EQ(Percentile(v, 99), 3.97);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 4.0);
}

TEST(PercentileTest, SingleValueAndEmpty) {
  EXPECT_DOUBLE_EQ(Percentile({7.5}, 99), 7.5);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0.0);
}

TEST(StatsTest, TpotExcludesTheFirstToken) {
  EXPECT_DOUBLE_EQ(*Completed(0.1, 0.5, 5).TpotS(), 0.1);
  EXPECT_FALSE(Completed(0.1, 0.1, 1).TpotS().has_value());
}

TEST(StatsTest, GoodputCountsRequestsMeetingBothSloHalves) {
  // Binary-exact times, so "exactly on the limit" is exact.
  std::vector<RequestSample> samples = {
      Completed(0.125, 0.125 + 8 * 0.03125, 9),  // TTFT 125 ms, TPOT 31.25 ms: good
      Completed(0.375, 0.375 + 8 * 0.03125, 9),  // TTFT over the SLO
      Completed(0.125, 0.125 + 8 * 0.125, 9),    // TPOT over the SLO
      Completed(0.125, 0.125, 1),                // one token: no TPOT, TTFT ok: good
      Completed(0.25, 0.25 + 4 * 0.0625, 5),     // exactly on both limits: good
  };
  RequestSample failed;
  failed.error_kind = "http_503";
  samples.push_back(failed);
  const RunSummary r = Summarize(samples, 2.0, Slo{250, 62.5});
  EXPECT_EQ(r.good_requests, 3);
  EXPECT_DOUBLE_EQ(r.goodput, 1.5);
  EXPECT_EQ(r.completed, 5);
  EXPECT_EQ(r.failed, 1);
  EXPECT_EQ(r.errors.at("http_503"), 1);
}

TEST(StatsTest, ThroughputAndLatencySummaries) {
  std::vector<RequestSample> samples = {Completed(0.1, 1.1, 11), Completed(0.3, 2.3, 21)};
  samples[0].input_tokens = 7;
  samples[1].input_tokens = 3;
  samples[0].itl_s = {0.1, 0.1};
  samples[1].itl_s = {0.2};
  const RunSummary r = Summarize(samples, 4.0, std::nullopt);
  EXPECT_DOUBLE_EQ(r.request_throughput, 0.5);
  EXPECT_DOUBLE_EQ(r.output_token_throughput, 8.0);
  EXPECT_DOUBLE_EQ(r.total_token_throughput, 10.5);
  EXPECT_DOUBLE_EQ(r.ttft.mean_ms, 200.0);
  EXPECT_DOUBLE_EQ(r.ttft.p50_ms, 200.0);
  EXPECT_NEAR(r.tpot.mean_ms, 100.0, 1e-9);  // both requests: 100 ms per token
  EXPECT_EQ(r.itl.count, 3);
  EXPECT_NEAR(r.itl.max_ms, 200.0, 1e-9);
  EXPECT_NEAR(r.e2e.p99_ms, 1100 + 0.99 * 1200, 1e-9);
  EXPECT_FALSE(ToJson(r).contains("goodput"));
}

}  // namespace
}  // namespace pdserve::loadgen
