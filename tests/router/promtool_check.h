// `promtool check metrics` on a /metrics text, for the tests that keep the router's exposition
// valid for Prometheus (router_tests is built with PDSERVE_PROMTOOL, empty or *-NOTFOUND when
// the Debian package prometheus is not installed).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>

namespace pdserve::router::testing {

// Whether promtool is there to run.
inline bool HavePromtool() {
  const std::string promtool = PDSERVE_PROMTOOL;
  return !promtool.empty() && promtool.find("NOTFOUND") == std::string::npos;
}

// Expects promtool to accept `metrics` (its lint findings fail the check too).
inline void ExpectPromtoolAccepts(const std::string& metrics, const std::string& file_name) {
  const std::string path = ::testing::TempDir() + "/" + file_name;
  std::ofstream(path) << metrics;
  FILE* p =
      popen((std::string(PDSERVE_PROMTOOL) + " check metrics < " + path + " 2>&1").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string output;
  char buf[256];
  while (fgets(buf, sizeof(buf), p)) output += buf;
  EXPECT_EQ(pclose(p), 0) << output;
}

}  // namespace pdserve::router::testing
