// Issue 7, proof 1: the CPU engine reproduces transformers' logits on the shipped model
// (models/kjv-v4-tiny) for the 8 fixture prompts of tests/fixtures/small_model/logits.json: per
// position max|diff| / max|ref| <= 1e-4 and identical argmax, one-shot and prefill-then-decode.
//
// Indexer ties. heldout_80 has exact top-k ties in the first CSA layer's indexer (scores of 0.0
// at the top-8 cut-off, positions 42 and 49; indexer_ties.json). The engine keeps the lower entry
// ids (docs/engine.md); torch.topk leaves the order unspecified, so transformers' logits from the
// first tie-dependent position on follow its own pick (docs/engine-reference.md). The strict
// comparison therefore stops there; later positions are held to kTieBound, justified below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/model.h"
#include "engine/score.h"
#include "tests/engine/logit_compare.h"
#include "tests/engine/perturbed_model.h"
#include "tests/small_model/small_model_fixtures.h"

namespace pdserve::engine {
namespace {

using nlohmann::json;
using small_model_testing::kFixturesDir;
using small_model_testing::kModelDir;

constexpr double kTolerance = 1e-4;
// Past the first tie the engine's pick differs from transformers' at position 49 (tied entries
// {0, 3, 7} for 2 slots: the engine keeps {0, 3}). Measured there: max|diff| 3.05e-2 on logits up
// to 9.7, i.e. 3.1e-3 per position; the effect then fades through the sliding window and HCA
// (5.8e-4 at position 50, below 1e-4 from position 59) and the argmax never changes. The float64
// NumPy reference, which also keeps the lowest entry ids, reports the same absolute difference
// (indexer_ties.json: 1.7e-3, there divided by the prompt's largest logit, 17.9), and the engine's
// held-out perplexity equals that reference's to 5 digits (perplexity_test.cc), so the figure is
// the tie choice, not an engine error. The bound leaves about 3x margin over it; identical argmax
// is still required.
constexpr double kTieBound = 1e-2;

struct Prompt {
  std::string name;
  std::vector<int32_t> ids;
  std::vector<float> logits;   // transformers, [ids.size(), vocab]
  int64_t first_tie_position;  // logits before it do not depend on a tie's order
};

std::vector<Prompt> ReadPrompts() {
  const json record = small_model_testing::ReadJson(kFixturesDir / "logits.json");
  const json ties = small_model_testing::ReadJson(kFixturesDir / "indexer_ties.json");
  std::vector<Prompt> prompts;
  for (const json& p : record.at("prompts")) {
    Prompt out{p.at("name").get<std::string>(), p.at("ids").get<std::vector<int32_t>>(),
               small_model_testing::ReadFloats(kFixturesDir / p.at("file").get<std::string>()), 0};
    for (const json& t : ties.at("prompts")) {
      if (t.at("name") == out.name) out.first_tie_position = t.at("first_tie_dependent_position");
    }
    prompts.push_back(std::move(out));
  }
  return prompts;
}

class SmallModelLogitsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto model = Model::Load(kModelDir.string());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = new Model(*std::move(model));
    prompts_ = new std::vector<Prompt>(ReadPrompts());
  }
  static void TearDownTestSuite() {
    delete model_;
    delete prompts_;
  }

  static Tensor Run(const Model& model, const std::vector<int32_t>& ids,
                    const std::vector<int64_t>& chunks) {
    auto logits = ScoreInChunks(model, ids, chunks);
    EXPECT_TRUE(logits.ok()) << logits.status();
    return logits.ok() ? *std::move(logits) : Tensor({0, model.config().vocab_size});
  }

  // Positions [begin, end) of `got` against the prompt's reference.
  static testing::LogitDiff Compare(const Prompt& p, const Tensor& got, int64_t begin,
                                    int64_t end) {
    const int64_t vocab = got.dim(1);
    return testing::CompareLogits(got.ptr() + begin * vocab, p.logits.data() + begin * vocab,
                                  end - begin, vocab);
  }

  // The strict comparison up to the first tie-dependent position and kTieBound after it; returns
  // the {before, after} errors for the report.
  static std::pair<double, double> ExpectMatches(const Prompt& p, const Tensor& got,
                                                 const std::string& what) {
    const auto n = static_cast<int64_t>(p.ids.size());
    EXPECT_EQ(got.dim(0), n) << p.name;
    if (got.dim(0) != n) return {1.0, 1.0};
    const testing::LogitDiff before = Compare(p, got, 0, p.first_tie_position);
    EXPECT_LE(before.worst_relative, kTolerance) << p.name << " " << what;
    EXPECT_EQ(before.argmax_mismatches, 0) << p.name << " " << what;
    double after = 0.0;
    if (p.first_tie_position < n) {
      const testing::LogitDiff tied = Compare(p, got, p.first_tie_position, n);
      after = tied.worst_relative;
      EXPECT_LE(after, kTieBound) << p.name << " " << what << " after the first tie";
      EXPECT_EQ(tied.argmax_mismatches, 0) << p.name << " " << what << " after the first tie";
    }
    std::printf("[ logits ] %-22s %-26s max rel err %.2e before tie, %.2e after\n", p.name.c_str(),
                what.c_str(), before.worst_relative, after);
    return {before.worst_relative, after};
  }

  static Model* model_;
  static std::vector<Prompt>* prompts_;
};

Model* SmallModelLogitsTest::model_ = nullptr;
std::vector<Prompt>* SmallModelLogitsTest::prompts_ = nullptr;

TEST_F(SmallModelLogitsTest, FixtureCoversEightPromptsAndOneHasIndexerTies) {
  ASSERT_EQ(prompts_->size(), 8u);
  const auto tied = std::count_if(prompts_->begin(), prompts_->end(), [](const Prompt& p) {
    return p.first_tie_position < static_cast<int64_t>(p.ids.size());
  });
  EXPECT_EQ(tied, 1);
}

TEST_F(SmallModelLogitsTest, OneShotMatchesTransformers) {
  json report = json::array();
  for (const Prompt& p : *prompts_) {
    const auto [before, after] =
        ExpectMatches(p, Run(*model_, p.ids, {static_cast<int64_t>(p.ids.size())}), "one-shot");
    report.push_back({{"name", p.name},
                      {"tokens", p.ids.size()},
                      {"first_tie_dependent_position", p.first_tie_position},
                      {"max_rel_diff_before_tie", before},
                      {"max_rel_diff_after_tie", after}});
  }
  small_model_testing::WriteReport("logits_report.json", report);
}

// Prefill of 1, half and all but one of the prompt's tokens, then one token per Forward call.
TEST_F(SmallModelLogitsTest, PrefillThenDecodeMatchesTransformers) {
  for (const Prompt& p : *prompts_) {
    const auto n = static_cast<int64_t>(p.ids.size());
    for (int64_t prefill : {int64_t{1}, n / 2, n - 1}) {
      if (prefill < 1) continue;
      ExpectMatches(p, Run(*model_, p.ids, {prefill, 1}),
                    "prefill " + std::to_string(prefill) + " then decode");
    }
  }
}

// Where transformers' own cached decode can pick another tied entry than its one-shot forward,
// the engine picks the same one in every split: its decode equals its one-shot forward at every
// position of the tied prompt, ties included.
TEST_F(SmallModelLogitsTest, TiedPromptDecodesLikeItsOneShotForward) {
  const auto tied = std::find_if(prompts_->begin(), prompts_->end(), [](const Prompt& p) {
    return p.first_tie_position < static_cast<int64_t>(p.ids.size());
  });
  ASSERT_NE(tied, prompts_->end());
  const auto n = static_cast<int64_t>(tied->ids.size());
  const Tensor one_shot = Run(*model_, tied->ids, {n});
  const Tensor decode = Run(*model_, tied->ids, {1});
  const auto d = testing::CompareLogits(decode.ptr(), one_shot.ptr(), n, one_shot.dim(1));
  EXPECT_LE(d.worst_relative, kTolerance) << "worst position " << d.worst_position;
  EXPECT_EQ(d.argmax_mismatches, 0);
}

// The comparison can fail: the shipped weights with one attention sink of the last layer moved by
// 1.0 miss transformers' logits on a tie-free prompt (measured 4.5e-3, 45x the tolerance).
TEST_F(SmallModelLogitsTest, PerturbedWeightFails) {
  auto model =
      testing::LoadPerturbedModel(kModelDir.string(), "model.layers.5.self_attn.sinks", 1.0f);
  ASSERT_TRUE(model.ok()) << model.status();
  const Prompt& p = prompts_->at(3);  // chat_system_two_turns: 52 tokens, no tie
  ASSERT_EQ(p.first_tie_position, static_cast<int64_t>(p.ids.size()));
  const auto n = static_cast<int64_t>(p.ids.size());
  const auto d = Compare(p, Run(*model, p.ids, {n}), 0, n);
  std::printf("[ logits ] perturbed sink: max rel err %.2e\n", d.worst_relative);
  EXPECT_GT(d.worst_relative, kTolerance);
}

}  // namespace
}  // namespace pdserve::engine
