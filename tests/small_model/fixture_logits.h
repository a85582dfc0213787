// The logits fixtures of a bundled model's training run (logits.json's prompts with their
// transformers logits files, indexer_ties.json's first tie-dependent positions) and the engine's
// scoring of a prompt, shared by tests/small_model/logits_test.cc (models/kjv-v4-tiny) and
// tests/wide_model/logits_test.cc (models/kjv-v4-wide). The directories are
// small_model_fixtures.h's (the PDSERVE_SMALL_MODEL_* definitions of the including target).
// Test-only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/model.h"
#include "engine/score.h"
#include "tests/small_model/small_model_fixtures.h"

namespace pdserve::small_model_testing {

struct FixturePrompt {
  std::string name;
  std::vector<int32_t> ids;
  int64_t logits_from;         // first position the fixture holds (logits.json's logits_from, or 0)
  std::vector<float> logits;   // transformers, [ids.size() - logits_from, vocab] float32
  int64_t first_tie_position;  // indexer_ties.json; ids.size() when no logit depends on a tie
};

// Every prompt of kFixturesDir/logits.json, in its order; failures are reported through gtest.
inline std::vector<FixturePrompt> ReadFixturePrompts() {
  const nlohmann::json record = ReadJson(kFixturesDir / "logits.json");
  const nlohmann::json ties = ReadJson(kFixturesDir / "indexer_ties.json");
  std::vector<FixturePrompt> prompts;
  for (const nlohmann::json& p : record.at("prompts")) {
    FixturePrompt out{p.at("name").get<std::string>(), p.at("ids").get<std::vector<int32_t>>(),
                      p.value("logits_from", int64_t{0}),
                      ReadFloats(kFixturesDir / p.at("file").get<std::string>()), 0};
    for (const nlohmann::json& t : ties.at("prompts")) {
      if (t.at("name") == out.name) out.first_tie_position = t.at("first_tie_dependent_position");
    }
    prompts.push_back(std::move(out));
  }
  return prompts;
}

// engine::ScoreInChunks, with a failure reported through gtest (then an empty [0, vocab] tensor).
inline engine::Tensor Score(const engine::Model& model, const std::vector<int32_t>& ids,
                            const std::vector<int64_t>& chunks) {
  auto logits = engine::ScoreInChunks(model, ids, chunks);
  EXPECT_TRUE(logits.ok()) << logits.status();
  return logits.ok() ? *std::move(logits) : engine::Tensor({0, model.config().vocab_size});
}

// A test suite that loads the model of kModelDir and reads the fixture prompts once.
class FixtureLogitsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = engine::Model::Load(kModelDir.string());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = new engine::Model(*std::move(model));
    prompts_ = new std::vector<FixturePrompt>(ReadFixturePrompts());
  }
  static void TearDownTestSuite() {
    delete model_;
    delete prompts_;
    model_ = nullptr;
    prompts_ = nullptr;
  }

  static engine::Tensor Run(const engine::Model& model, const std::vector<int32_t>& ids,
                            const std::vector<int64_t>& chunks) {
    return Score(model, ids, chunks);
  }

  inline static engine::Model* model_ = nullptr;
  inline static std::vector<FixturePrompt>* prompts_ = nullptr;
};

}  // namespace pdserve::small_model_testing
