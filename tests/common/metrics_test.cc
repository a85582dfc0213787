#include "common/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/version.h"

namespace pdserve::metrics {
namespace {

TEST(MetricsTest, CounterWithLabelsSerializes) {
  Registry r;
  auto fam = r.AddCounter("pdserve_requests_total", "Requests by status.", {"endpoint", "status"});
  ASSERT_TRUE(fam.ok()) << fam.status();
  (*fam)->WithLabels({"/v1/completions", "200"}).Increment();
  (*fam)->WithLabels({"/v1/completions", "200"}).Increment(2);
  (*fam)->WithLabels({"/v1/chat/completions", "400"}).Increment();
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_requests_total Requests by status.\n"
            "# TYPE pdserve_requests_total counter\n"
            "pdserve_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1\n"
            "pdserve_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 3\n");
}

TEST(MetricsTest, CounterIgnoresNegativeDelta) {
  Registry r;
  auto& c = (*r.AddCounter("pdserve_x_total", "x"))->Get();
  c.Increment(5);
  c.Increment(-3);
  EXPECT_EQ(c.Value(), 5);
}

TEST(MetricsTest, GaugeGoesUpAndDown) {
  Registry r;
  auto& g = (*r.AddGauge("pdserve_inflight", "In flight."))->Get();
  g.Add(3);
  g.Add(-1);
  EXPECT_EQ(g.Value(), 2);
  g.Set(-7.5);
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_inflight In flight.\n# TYPE pdserve_inflight gauge\n"
            "pdserve_inflight -7.5\n");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInf) {
  Registry r;
  auto& h = (*r.AddHistogram("pdserve_ttft_seconds", "TTFT.", {}, {0.1, 1, 2.5}))->Get();
  h.Observe(0.05);
  h.Observe(0.1);  // on the bound: le is inclusive
  h.Observe(2.0);
  h.Observe(100);
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_ttft_seconds TTFT.\n# TYPE pdserve_ttft_seconds histogram\n"
            "pdserve_ttft_seconds_count 4\n"
            "pdserve_ttft_seconds_sum 102.15\n"
            "pdserve_ttft_seconds_bucket{le=\"0.1\"} 2\n"
            "pdserve_ttft_seconds_bucket{le=\"1\"} 2\n"
            "pdserve_ttft_seconds_bucket{le=\"2.5\"} 3\n"
            "pdserve_ttft_seconds_bucket{le=\"+Inf\"} 4\n");
  EXPECT_EQ(h.Count(), 4u);
  EXPECT_EQ(h.BucketCount(0), 2u);
  EXPECT_EQ(h.BucketCount(1), 0u);
  EXPECT_EQ(h.BucketCount(3), 1u);  // +Inf
  EXPECT_DOUBLE_EQ(h.Sum(), 102.15);
}

TEST(MetricsTest, HistogramIgnoresNaN) {
  Registry r;
  auto& h = (*r.AddHistogram("pdserve_h_seconds", "h", {}, {1}))->Get();
  h.Observe(std::nan(""));
  h.Observe(0.5);
  EXPECT_EQ(h.Count(), 1u);
  EXPECT_EQ(h.Sum(), 0.5);
}

TEST(MetricsTest, LabelsAppearInNameOrderAndSeriesInLabelOrder) {
  Registry r;
  auto* fam = *r.AddGauge("pdserve_g", "g", {"zone", "app"});
  fam->WithLabels({"b", "x"}).Set(2);
  fam->WithLabels({"a", "y"}).Set(1);
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_g g\n# TYPE pdserve_g gauge\n"
            "pdserve_g{app=\"x\",zone=\"b\"} 2\n"
            "pdserve_g{app=\"y\",zone=\"a\"} 1\n");
}

TEST(MetricsTest, ExportAtZeroCreatesEveryCombination) {
  Registry r;
  auto* counter = *r.AddCounter("pdserve_d_total", "d", {"kind", "action"});
  counter->ExportAtZero({{"repeat", "empty"}, {"flag", "stop"}});
  counter->ExportAtZero({{"none"}, {}});  // an empty list: no combination
  auto* hist = *r.AddHistogram("pdserve_e_seconds", "e", {"endpoint"}, {1});
  hist->ExportAtZero({{"completions"}});
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_d_total d\n# TYPE pdserve_d_total counter\n"
            "pdserve_d_total{action=\"flag\",kind=\"empty\"} 0\n"
            "pdserve_d_total{action=\"flag\",kind=\"repeat\"} 0\n"
            "pdserve_d_total{action=\"stop\",kind=\"empty\"} 0\n"
            "pdserve_d_total{action=\"stop\",kind=\"repeat\"} 0\n"
            "# HELP pdserve_e_seconds e\n# TYPE pdserve_e_seconds histogram\n"
            "pdserve_e_seconds_count{endpoint=\"completions\"} 0\n"
            "pdserve_e_seconds_sum{endpoint=\"completions\"} 0\n"
            "pdserve_e_seconds_bucket{endpoint=\"completions\",le=\"1\"} 0\n"
            "pdserve_e_seconds_bucket{endpoint=\"completions\",le=\"+Inf\"} 0\n");
  // The exported series are the ones WithLabels returns.
  counter->WithLabels({"empty", "stop"}).Increment();
  EXPECT_NE(r.Serialize().find("pdserve_d_total{action=\"stop\",kind=\"empty\"} 1\n"),
            std::string::npos);
}

TEST(MetricsTest, FamilyWithoutSeriesIsLeftOut) {
  Registry r;
  ASSERT_TRUE(r.AddCounter("pdserve_unused_total", "u", {"k"}).ok());
  EXPECT_EQ(r.Serialize(), "");
}

TEST(MetricsTest, LabelValuesAreEscaped) {
  Registry r;
  (*r.AddGauge("pdserve_g", "line1\nline2 \\ end", {"k"}))->WithLabels({"a\"b\\c\nd"}).Set(1);
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_g line1\\nline2 \\\\ end\n# TYPE pdserve_g gauge\n"
            "pdserve_g{k=\"a\\\"b\\\\c\\nd\"} 1\n");
}

TEST(MetricsTest, RejectsBadNamesAndDuplicates) {
  Registry r;
  EXPECT_FALSE(r.AddCounter("1bad", "x").ok());
  EXPECT_FALSE(r.AddCounter("bad-name", "x").ok());
  EXPECT_FALSE(r.AddCounter("ok_total", "x", {"__reserved"}).ok());
  EXPECT_FALSE(r.AddHistogram("h", "x", {"le"}, {1}).ok());
  EXPECT_FALSE(r.AddHistogram("h2", "x", {}, {1, 1}).ok());
  ASSERT_TRUE(r.AddGauge("dup", "x").ok());
  auto again = r.AddCounter("dup", "x");
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().message(), "metric 'dup' registered twice");
}

TEST(MetricsTest, ConcurrentIncrementsAreExact) {
  Registry r;
  auto* fam = *r.AddCounter("pdserve_c_total", "c", {"t"});
  auto* hist = *r.AddHistogram("pdserve_h_seconds", "h", {}, LatencyBucketsSeconds());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        fam->WithLabels({t % 2 ? "odd" : "even"}).Increment();
        hist->Get().Observe(0.003);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(fam->WithLabels({"odd"}).Value(), 40000);
  EXPECT_EQ(fam->WithLabels({"even"}).Value(), 40000);
  EXPECT_EQ(hist->Get().Count(), 80000u);
  EXPECT_EQ(hist->Get().BucketCount(2), 80000u);  // 0.0025 < 0.003 <= 0.005
}

TEST(MetricsTest, OutputPassesPromtool) {
  const std::string promtool = PDSERVE_PROMTOOL;
  if (promtool.empty() || promtool.find("NOTFOUND") != std::string::npos) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  Registry r;
  (*r.AddCounter("pdserve_requests_total", "Requests.", {"status"}))
      ->WithLabels({"200"})
      .Increment();
  (*r.AddGauge("pdserve_pool_pages_free", "Free pages.", {"kind"}))->WithLabels({"window"}).Set(3);
  auto* h =
      *r.AddHistogram("pdserve_e2e_seconds", "End to end.", {"endpoint"}, LatencyBucketsSeconds());
  h->WithLabels({"/v1/completions"}).Observe(2.0);
  h->ExportAtZero({{"/v1/chat/completions"}});
  (*r.AddCounter("pdserve_failures_total", "Failures.", {"reason"}))->ExportAtZero({{"a", "b"}});
  const std::string path = ::testing::TempDir() + "/metrics.prom";
  std::ofstream(path) << r.Serialize();
  const std::string cmd = promtool + " check metrics < " + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[256];
  while (fgets(buf, sizeof(buf), p)) output += buf;
  EXPECT_EQ(pclose(p), 0) << output;
  EXPECT_EQ(output, "") << output;
}

TEST(MetricsTest, BuildInfoCarriesTheRoleAndTheOneVersion) {
  Registry r;
  ASSERT_TRUE(AddBuildInfo(r, "serve").ok());
  EXPECT_EQ(r.Serialize(),
            "# HELP pdserve_build_info Identifies the process.\n"
            "# TYPE pdserve_build_info gauge\n"
            "pdserve_build_info{role=\"serve\",version=\"" +
                std::string(kVersion) + "\"} 1\n");
  EXPECT_STREQ(kVersion, "0.1.0");
  EXPECT_EQ(AddBuildInfo(r, "router").code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::metrics
