#include "serving/generation_config.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::serving {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(GenerationConfigTest, ParsesSamplingKeysAndEosList) {
  auto config = GenerationConfig::Parse(
      R"({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "eos_token_id": [1, 7],
          "bos_token_id": 0, "do_sample": true})",
      "test");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->temperature, 0.7);
  EXPECT_EQ(config->top_p, 0.9);
  EXPECT_EQ(config->top_k, 20);
  EXPECT_THAT(config->eos_token_ids, ElementsAre(1, 7));
}

TEST(GenerationConfigTest, AcceptsScalarEosAndLeavesAbsentKeysEmpty) {
  auto config = GenerationConfig::Parse(R"({"eos_token_id": 2})", "test");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FALSE(config->temperature.has_value());
  EXPECT_FALSE(config->top_p.has_value());
  EXPECT_FALSE(config->top_k.has_value());
  EXPECT_THAT(config->eos_token_ids, ElementsAre(2));
}

TEST(GenerationConfigTest, DoSampleFalseMeansGreedy) {
  auto config = GenerationConfig::Parse(R"({"temperature": 0.8, "do_sample": false})", "test");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->temperature, 0.0);
}

TEST(GenerationConfigTest, WrongTypeNamesFileAndKey) {
  auto config = GenerationConfig::Parse(R"({"top_p": "high"})", "gen.json");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(config.status().message(), "gen.json: key 'top_p' must be a number");
}

TEST(GenerationConfigTest, MalformedJsonIsInvalidArgument) {
  auto config = GenerationConfig::Parse("{\"top_p\": ", "gen.json");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("malformed JSON"));
}

TEST(GenerationConfigTest, NegativeEosIdIsInvalidArgument) {
  auto config = GenerationConfig::Parse(R"({"eos_token_id": [1, -3]})", "gen.json");
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(config.status().message(), HasSubstr("-3"));
}

TEST(GenerationConfigTest, LoadReadsFileAndMissingFileIsEmpty) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("pdserve_genconfig_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  auto missing = GenerationConfig::Load(dir.string());
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_FALSE(missing->temperature.has_value());
  EXPECT_TRUE(missing->eos_token_ids.empty());

  std::ofstream(dir / "generation_config.json") << R"({"temperature": 0.5})";
  auto loaded = GenerationConfig::Load(dir.string());
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->temperature, 0.5);
}

}  // namespace
}  // namespace pdserve::serving
