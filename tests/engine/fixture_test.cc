// The engine against transformers 5.17 (tests/fixtures/engine, written by
// tools/gen_engine_fixtures.py): for every fixture config and case, the one-shot forward,
// token-by-token decode, prefill-then-decode at each listed prompt length and several chunked
// prefills all reproduce transformers' one-shot logits (per position max|diff| / max|ref| <= 1e-4,
// identical argmax). A copy of a checkpoint with one tensor perturbed fails the same comparison.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/score.h"
#include "nlohmann/json.hpp"
#include "tests/engine/logit_compare.h"
#include "tests/engine/perturbed_model.h"

namespace pdserve::engine {
namespace {

namespace fs = std::filesystem;

constexpr double kTolerance = 1e-4;
const fs::path kFixtures = PDSERVE_ENGINE_FIXTURES_DIR;

struct Case {
  std::string name;
  std::vector<int32_t> tokens;
  std::vector<int64_t> prompt_lengths;
  std::vector<float> logits;  // [tokens, vocab], transformers' one-shot forward
};

std::vector<Case> ReadCases(const fs::path& dir) {
  std::ifstream in(dir / "cases.json");
  const auto json = nlohmann::json::parse(in);
  std::vector<Case> cases;
  for (const auto& c : json.at("cases")) {
    Case out;
    out.name = c.at("name").get<std::string>();
    out.tokens = c.at("tokens").get<std::vector<int32_t>>();
    out.prompt_lengths = c.at("prompt_lengths").get<std::vector<int64_t>>();
    const auto shape = c.at("shape").get<std::vector<int64_t>>();
    out.logits.resize(static_cast<size_t>(shape.at(0) * shape.at(1)));
    std::ifstream f(dir / c.at("logits").get<std::string>(), std::ios::binary);
    f.read(reinterpret_cast<char*>(out.logits.data()),
           static_cast<std::streamsize>(out.logits.size() * sizeof(float)));
    EXPECT_TRUE(f.good()) << dir << " " << out.name;
    cases.push_back(std::move(out));
  }
  return cases;
}

Tensor RunChunks(const Model& model, const std::vector<int32_t>& tokens,
                 const std::vector<int64_t>& sizes) {
  auto logits = ScoreInChunks(model, tokens, sizes);
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *std::move(logits) : Tensor({0, model.config().vocab_size});
}

testing::LogitDiff Compare(const Model& model, const Case& c, const Tensor& got) {
  EXPECT_EQ(got.dim(0), static_cast<int64_t>(c.tokens.size()));
  return testing::CompareLogits(got.ptr(), c.logits.data(), got.dim(0), model.config().vocab_size);
}

void ExpectMatches(const Model& model, const Case& c, const Tensor& got, const std::string& what) {
  const auto d = Compare(model, c, got);
  EXPECT_LE(d.worst_relative, kTolerance)
      << c.name << " " << what << ": worst position " << d.worst_position;
  EXPECT_EQ(d.argmax_mismatches, 0) << c.name << " " << what;
}

std::vector<fs::path> ModelDirs() {
  std::vector<fs::path> dirs;
  for (const auto& entry : fs::directory_iterator(kFixtures)) {
    if (!entry.is_directory()) continue;
    dirs.push_back(entry.path() / "model");
    if (fs::exists(entry.path() / "model_hf_names"))
      dirs.push_back(entry.path() / "model_hf_names");
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

class FixtureTest : public ::testing::TestWithParam<fs::path> {
 protected:
  void SetUp() override {
    auto model = Model::Load(GetParam().string());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Model>(*std::move(model));
    cases_ = ReadCases(GetParam().parent_path());
    ASSERT_FALSE(cases_.empty());
  }

  // Runs every case in chunks of `sizes` ({0}: the whole case at once), prints the worst error
  // (the figures docs/engine.md quotes) and expects a match.
  void CheckAllCases(const std::vector<int64_t>& sizes, const std::string& what) {
    for (const Case& c : cases_) {
      const Tensor got = RunChunks(*model_, c.tokens,
                                   sizes == std::vector<int64_t>{0}
                                       ? std::vector<int64_t>{static_cast<int64_t>(c.tokens.size())}
                                       : sizes);
      const auto d = Compare(*model_, c, got);
      std::printf("[ fixture ] %s %s %s max rel err %.3g\n",
                  GetParam().parent_path().filename().c_str(), c.name.c_str(), what.c_str(),
                  d.worst_relative);
      ExpectMatches(*model_, c, got, what);
    }
  }

  std::unique_ptr<Model> model_;
  std::vector<Case> cases_;
};

TEST_P(FixtureTest, OneShotMatchesTransformers) { CheckAllCases({0}, "one-shot"); }

TEST_P(FixtureTest, TokenByTokenDecodeMatchesTransformers) { CheckAllCases({1}, "decode"); }

TEST_P(FixtureTest, PrefillThenDecodeMatchesTransformers) {
  for (const Case& c : cases_) {
    for (int64_t prompt : c.prompt_lengths) {
      ExpectMatches(*model_, c, RunChunks(*model_, c.tokens, {prompt, 1}),
                    "prefill " + std::to_string(prompt) + " then decode");
    }
  }
}

TEST_P(FixtureTest, ChunkedPrefillMatchesTransformers) {
  for (const Case& c : cases_) {
    for (int64_t chunk : {2, 3, 5, 8}) {
      ExpectMatches(*model_, c, RunChunks(*model_, c.tokens, {chunk}),
                    "chunks of " + std::to_string(chunk));
    }
    ExpectMatches(*model_, c, RunChunks(*model_, c.tokens, {7, 1, 4, 9}), "chunks 7,1,4,9...");
  }
}

std::string ParamName(const ::testing::TestParamInfo<fs::path>& info) {
  std::string name =
      info.param.parent_path().filename().string() + "_" + info.param.filename().string();
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureTest, ::testing::ValuesIn(ModelDirs()), ParamName);

// The comparison can fail: the same weights with one tensor nudged (a single sink of the last
// layer) no longer match transformers' logits.
TEST(FixtureComparisonTest, PerturbedCheckpointFails) {
  const fs::path dir = kFixtures / "mixed_yarn_f32" / "model";
  auto model = testing::LoadPerturbedModel(dir.string(), "model.layers.3.self_attn.sinks", 1.0f);
  ASSERT_TRUE(model.ok()) << model.status();
  const Case c = ReadCases(dir.parent_path()).at(0);
  const auto d = Compare(*model, c, RunChunks(*model, c.tokens, {1}));
  EXPECT_GT(d.worst_relative, kTolerance);
}

}  // namespace
}  // namespace pdserve::engine
