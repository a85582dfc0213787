// The environment switches' parser (kernels/env_switch.h) and its route into the log
// (common/env_switch_log.h): accepted texts, the default for unset or empty, one warning per
// process and switch for a text it does not accept, numbers bounded. Each test reads switches of
// its own names, as the warnings are remembered for the whole process.
#include "kernels/env_switch.h"

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "common/env_switch_log.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/common/switch_warnings.h"

namespace pdserve::kernels {
namespace {

enum class Path { kAuto, kMma, kWgmma };
constexpr SwitchChoice<Path> kPaths[] = {{"mma", Path::kMma}, {"wgmma", Path::kWgmma}};

using CapturedWarnings = testing::CapturedSwitchWarnings;

TEST(EnvSwitchTest, UnsetOrEmptyGivesTheDefaultWithoutAWarning) {
  const CapturedWarnings warnings;
  unsetenv("PDSERVE_ENV_SWITCH_TEST_UNSET");
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_UNSET", kPaths, Path::kAuto, "auto"), Path::kAuto);
  setenv("PDSERVE_ENV_SWITCH_TEST_UNSET", "", 1);
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_UNSET", kPaths, Path::kAuto, "auto"), Path::kAuto);
  EXPECT_EQ(ReadSwitchNumber("PDSERVE_ENV_SWITCH_TEST_UNSET", 7, 0, 10), 7);
  EXPECT_TRUE(warnings.lines().empty());
  unsetenv("PDSERVE_ENV_SWITCH_TEST_UNSET");
}

TEST(EnvSwitchTest, AcceptedTextsGiveTheirValuesExactly) {
  const CapturedWarnings warnings;
  setenv("PDSERVE_ENV_SWITCH_TEST_ACCEPTED", "wgmma", 1);
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_ACCEPTED", kPaths, Path::kAuto, "auto"),
            Path::kWgmma);
  setenv("PDSERVE_ENV_SWITCH_TEST_ACCEPTED", "mma", 1);
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_ACCEPTED", kPaths, Path::kAuto, "auto"),
            Path::kMma);
  EXPECT_TRUE(warnings.lines().empty());
  // Case and surrounding space matter: not accepted, so the default.
  for (const char* other : {"MMA", " mma", "mma ", "wgmma,"}) {
    const SwitchReading<Path> reading = ParseSwitch("X", other, kPaths, Path::kAuto, "auto");
    EXPECT_EQ(reading.value, Path::kAuto) << other;
    EXPECT_FALSE(reading.warning.empty()) << other;
  }
  unsetenv("PDSERVE_ENV_SWITCH_TEST_ACCEPTED");
}

TEST(EnvSwitchTest, AnUnknownValueWarnsOnceAndFallsBack) {
  const CapturedWarnings warnings;
  setenv("PDSERVE_ENV_SWITCH_TEST_ONCE", "true", 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(ReadSwitchOverride("PDSERVE_ENV_SWITCH_TEST_ONCE", "the option").has_value());
  }
  ASSERT_EQ(warnings.lines().size(), 1u);
  EXPECT_EQ(warnings.lines()[0],
            "PDSERVE_ENV_SWITCH_TEST_ONCE='true' is not accepted (accepted: 0, 1); ignored, "
            "using the option");
  // Another value later: still the fallback, and no second warning for the same switch.
  setenv("PDSERVE_ENV_SWITCH_TEST_ONCE", "on", 1);
  EXPECT_FALSE(ReadSwitchOverride("PDSERVE_ENV_SWITCH_TEST_ONCE", "the option").has_value());
  setenv("PDSERVE_ENV_SWITCH_TEST_ONCE", "1", 1);
  EXPECT_EQ(ReadSwitchOverride("PDSERVE_ENV_SWITCH_TEST_ONCE", "the option"),
            std::optional<bool>(true));
  EXPECT_EQ(warnings.lines().size(), 1u);
  // A second switch warns for itself.
  setenv("PDSERVE_ENV_SWITCH_TEST_ONCE_OTHER", "yes", 1);
  EXPECT_TRUE(ReadSwitchFlag("PDSERVE_ENV_SWITCH_TEST_ONCE_OTHER", true, "the default (on)"));
  ASSERT_EQ(warnings.lines().size(), 2u);
  EXPECT_EQ(warnings.lines()[1],
            "PDSERVE_ENV_SWITCH_TEST_ONCE_OTHER='yes' is not accepted (accepted: 0, 1); "
            "ignored, using the default (on)");
  unsetenv("PDSERVE_ENV_SWITCH_TEST_ONCE");
  unsetenv("PDSERVE_ENV_SWITCH_TEST_ONCE_OTHER");
}

TEST(EnvSwitchTest, NumbersAreWholeAndBounded) {
  const auto parse = [](const char* text) { return ParseSwitchNumber("N", text, 5, -2, 100); };
  EXPECT_EQ(parse("0").value, 0);
  EXPECT_EQ(parse("-2").value, -2);
  EXPECT_EQ(parse("100").value, 100);
  EXPECT_EQ(parse(" +42\t").value, 42);
  for (const char* ok : {"0", "-2", "100", " +42\t"}) EXPECT_TRUE(parse(ok).warning.empty()) << ok;
  const SwitchReading<int64_t> high = parse("101");
  EXPECT_EQ(high.value, 100);
  EXPECT_EQ(high.warning, "N=101 is outside [-2, 100]; using 100");
  const SwitchReading<int64_t> low = parse("-9223372036854775808");
  EXPECT_EQ(low.value, -2);
  EXPECT_EQ(low.warning, "N=-9223372036854775808 is outside [-2, 100]; using -2");
  for (const char* bad : {"1e3", "5.0", "0x10", "12ms", "+-3", "+", "9223372036854775808"}) {
    const SwitchReading<int64_t> reading = parse(bad);
    EXPECT_EQ(reading.value, 5) << bad;
    EXPECT_EQ(reading.warning, std::string("N='") + bad +
                                   "' is not accepted (accepted: a whole number in [-2, 100]); "
                                   "ignored, using the default, 5");
  }
}

TEST(EnvSwitchTest, NumberListsHaveTheirFieldCount) {
  EXPECT_EQ(ParseWholeNumbers("1,4,264", 3, 11), (std::vector<int64_t>{1, 4, 264}));
  EXPECT_EQ(ParseWholeNumbers("64, 4", 2, 3), (std::vector<int64_t>{64, 4}));
  for (const char* bad : {"1,4", "1,2,3,4", "1,,3", "1,2,", ",1,2", "1,2,3x", "a,b,c"}) {
    EXPECT_FALSE(ParseWholeNumbers(bad, 3, 3).has_value()) << bad;
  }
}

TEST(EnvSwitchTest, WarningsGoToTheLogOnceWithLogSwitchWarnings) {
  std::ostringstream lines;
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(lines)));
  common::LogSwitchWarnings();
  setenv("PDSERVE_ENV_SWITCH_TEST_LOG", "fast", 1);
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_LOG", kPaths, Path::kAuto, "the default, auto"),
            Path::kAuto);
  EXPECT_EQ(ReadSwitch("PDSERVE_ENV_SWITCH_TEST_LOG", kPaths, Path::kAuto, "the default, auto"),
            Path::kAuto);
  spdlog::default_logger()->flush();
  SetSwitchWarningSink(&WriteSwitchWarningToStderr);
  spdlog::set_default_logger(previous);
  unsetenv("PDSERVE_ENV_SWITCH_TEST_LOG");
  const std::string text = lines.str();
  const std::string expected =
      "[warning] PDSERVE_ENV_SWITCH_TEST_LOG='fast' is not accepted (accepted: mma, wgmma); "
      "ignored, using the default, auto";
  const size_t at = text.find(expected);
  ASSERT_NE(at, std::string::npos) << text;
  EXPECT_EQ(text.find("PDSERVE_ENV_SWITCH_TEST_LOG", at + expected.size()), std::string::npos)
      << text;
}

}  // namespace
}  // namespace pdserve::kernels
