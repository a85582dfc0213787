// Issue 7, proof 1: the CPU engine reproduces transformers' logits on the shipped model
// (models/kjv-v4-tiny) for the 8 fixture prompts of tests/fixtures/small_model/logits.json: per
// position max|diff| / max|ref| <= 1e-4 and identical argmax, one-shot and prefill-then-decode.
//
// Indexer ties. Where the lightning indexer's scores tie at the top-k cut-off, the engine keeps the
// lower entry ids (docs/engine.md) and torch.topk leaves the order unspecified
// (docs/engine-reference.md), so logits past a tie are not comparable exactly. The shipped
// model's 16 trained indexer heads leave no tie in any fixture prompt (indexer_ties.json, written
// by numpy_reference.py): the test requires that, so the strict comparison covers every position.
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
#include "tests/small_model/fixture_logits.h"
#include "tests/small_model/small_model_fixtures.h"

namespace pdserve::engine {
namespace {

using nlohmann::json;
using small_model_testing::kModelDir;

constexpr double kTolerance = 1e-4;
using Prompt = small_model_testing::FixturePrompt;  // logits_from is 0: every position

class SmallModelLogitsTest : public small_model_testing::FixtureLogitsTest {
 protected:
  // Positions [begin, end) of `got` against the prompt's reference.
  static testing::LogitDiff Compare(const Prompt& p, const Tensor& got, int64_t begin,
                                    int64_t end) {
    const int64_t vocab = got.dim(1);
    return testing::CompareLogits(got.ptr() + begin * vocab, p.logits.data() + begin * vocab,
                                  end - begin, vocab);
  }

  // The strict comparison at every position; returns the worst relative error for the report.
  static double ExpectMatches(const Prompt& p, const Tensor& got, const std::string& what) {
    const auto n = static_cast<int64_t>(p.ids.size());
    EXPECT_EQ(got.dim(0), n) << p.name;
    if (got.dim(0) != n) return 1.0;
    const testing::LogitDiff d = Compare(p, got, 0, n);
    EXPECT_LE(d.worst_relative, kTolerance)
        << p.name << " " << what << ", worst position " << d.worst_position;
    EXPECT_EQ(d.argmax_mismatches, 0) << p.name << " " << what;
    std::printf("[ logits ] %-22s %-26s max rel err %.2e\n", p.name.c_str(), what.c_str(),
                d.worst_relative);
    return d.worst_relative;
  }
};

TEST_F(SmallModelLogitsTest, FixtureCoversEightPromptsWithoutIndexerTies) {
  ASSERT_EQ(prompts_->size(), 8u);
  for (const Prompt& p : *prompts_) {
    EXPECT_EQ(p.first_tie_position, static_cast<int64_t>(p.ids.size())) << p.name;
  }
}

TEST_F(SmallModelLogitsTest, OneShotMatchesTransformers) {
  json report = json::array();
  for (const Prompt& p : *prompts_) {
    const double worst =
        ExpectMatches(p, Run(*model_, p.ids, {static_cast<int64_t>(p.ids.size())}), "one-shot");
    report.push_back({{"name", p.name},
                      {"tokens", p.ids.size()},
                      {"first_tie_dependent_position", p.first_tie_position},
                      {"max_rel_diff", worst}});
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

// The engine's token-by-token decode equals its own one-shot forward at every position of the
// longest prompt (80 tokens: window, both compressors and the indexer's selection all act).
TEST_F(SmallModelLogitsTest, LongestPromptDecodesLikeItsOneShotForward) {
  const auto longest = std::max_element(
      prompts_->begin(), prompts_->end(),
      [](const Prompt& a, const Prompt& b) { return a.ids.size() < b.ids.size(); });
  const auto n = static_cast<int64_t>(longest->ids.size());
  ASSERT_GE(n, 80);
  const Tensor one_shot = Run(*model_, longest->ids, {n});
  const Tensor decode = Run(*model_, longest->ids, {1});
  const auto d = testing::CompareLogits(decode.ptr(), one_shot.ptr(), n, one_shot.dim(1));
  EXPECT_LE(d.worst_relative, kTolerance) << "worst position " << d.worst_position;
  EXPECT_EQ(d.argmax_mismatches, 0);
}

// The comparison can fail: the shipped weights with one attention sink of the last layer moved by
// 1.0 miss transformers' logits (measured on the previous model: 4.5e-3, 45x the tolerance).
TEST_F(SmallModelLogitsTest, PerturbedWeightFails) {
  auto model =
      testing::LoadPerturbedModel(kModelDir.string(), "model.layers.5.self_attn.sinks", 1.0f);
  ASSERT_TRUE(model.ok()) << model.status();
  const Prompt& p = prompts_->at(3);  // chat_system_two_turns: 52 tokens
  const auto n = static_cast<int64_t>(p.ids.size());
  const auto d = Compare(p, Run(*model, p.ids, {n}), 0, n);
  std::printf("[ logits ] perturbed sink: max rel err %.2e\n", d.worst_relative);
  EXPECT_GT(d.worst_relative, kTolerance);
}

}  // namespace
}  // namespace pdserve::engine
