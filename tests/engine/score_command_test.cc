// `pdserve score` end to end: the binary writes transformers' logits for a fixture sequence, and
// rejects a bad --decode-from with a non-zero exit status.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "tests/engine/logit_compare.h"

namespace pdserve::engine {
namespace {

namespace fs = std::filesystem;

const fs::path kFixture = fs::path(PDSERVE_ENGINE_FIXTURES_DIR) / "mixed_yarn_f32";

struct FixtureCase {
  std::string tokens;  // "3,17,42"
  int64_t positions = 0;
  int64_t vocab = 0;
  std::vector<float> logits;
};

FixtureCase ReadFirstCase() {
  std::ifstream in(kFixture / "cases.json");
  const auto c = nlohmann::json::parse(in).at("cases").at(0);
  FixtureCase out;
  for (int64_t id : c.at("tokens").get<std::vector<int64_t>>()) {
    out.tokens += (out.tokens.empty() ? "" : ",") + std::to_string(id);
  }
  out.positions = c.at("shape").at(0).get<int64_t>();
  out.vocab = c.at("shape").at(1).get<int64_t>();
  out.logits.resize(static_cast<size_t>(out.positions * out.vocab));
  std::ifstream f(kFixture / c.at("logits").get<std::string>(), std::ios::binary);
  f.read(reinterpret_cast<char*>(out.logits.data()),
         static_cast<std::streamsize>(out.logits.size() * sizeof(float)));
  return out;
}

int RunScore(const std::string& args) {
  return std::system((std::string(PDSERVE_BINARY) + " score " + args + " 2>/dev/null").c_str());
}

TEST(ScoreCommandTest, WritesTransformersLogits) {
  const FixtureCase c = ReadFirstCase();
  const fs::path out = fs::temp_directory_path() / "pdserve_score_test.f32";
  ASSERT_EQ(RunScore("--model " + (kFixture / "model").string() + " --tokens " + c.tokens +
                     " --decode-from 5 --out " + out.string()),
            0);
  ASSERT_EQ(fs::file_size(out), c.logits.size() * sizeof(float));
  std::vector<float> got(c.logits.size());
  std::ifstream f(out, std::ios::binary);
  f.read(reinterpret_cast<char*>(got.data()),
         static_cast<std::streamsize>(got.size() * sizeof(float)));
  const auto d = testing::CompareLogits(got.data(), c.logits.data(), c.positions, c.vocab);
  EXPECT_LE(d.worst_relative, 1e-4);
  EXPECT_EQ(d.argmax_mismatches, 0);
  fs::remove(out);
}

TEST(ScoreCommandTest, RejectsDecodeFromPastTheEnd) {
  const fs::path out = fs::temp_directory_path() / "pdserve_score_reject.f32";
  EXPECT_NE(RunScore("--model " + (kFixture / "model").string() +
                     " --tokens 3,4 --decode-from 3 --out " + out.string()),
            0);
  EXPECT_FALSE(fs::exists(out));
}

// Longer than the model's context (max_position_embeddings 64): refused, as serving refuses it
// (400 context_length_exceeded); 64 tokens are scored.
TEST(ScoreCommandTest, RejectsSequencesLongerThanTheContext) {
  const fs::path out = fs::temp_directory_path() / "pdserve_score_context.f32";
  auto tokens = [](int n) {
    std::string list = "5";
    for (int i = 1; i < n; ++i) list += ",5";
    return list;
  };
  const std::string model = "--model " + (kFixture / "model").string();
  EXPECT_NE(RunScore(model + " --tokens " + tokens(65) + " --out " + out.string()), 0);
  EXPECT_EQ(fs::file_size(out), 0u);  // opened first, nothing written
  ASSERT_EQ(RunScore(model + " --tokens " + tokens(64) + " --out " + out.string()), 0);
  EXPECT_GT(fs::file_size(out), 0u);
  fs::remove(out);
}

}  // namespace
}  // namespace pdserve::engine
