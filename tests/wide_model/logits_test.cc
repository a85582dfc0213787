// The CPU engine reproduces transformers' logits on models/kjv-v4-wide, the bundled model with
// DeepSeek-V4-Flash's attention shapes (64 heads x head_dim 512, indexer 64 x 128 top-512, window
// 128, CSA rate 4, HCA rate 128), for the 9 prompts of tests/fixtures/wide_model/logits.json: per
// position max|diff| / max|ref| <= 1e-4 (the tolerance of tests/small_model/logits_test.cc) and
// identical argmax, one-shot and prefill-then-decode.
//
// The ninth prompt, heldout_long, is 2400 held-out tokens: past 2048 tokens a CSA layer has more
// than 512 compressed entries, so the indexer's top-512 selection decides what attention sees. Its
// fixture keeps only the last 64 positions (logits_from; the whole [2400, 4096] float32 file would
// be 39 MB). The CPU engine prefills about 15 tokens/s at these shapes on a loaded 2-core machine,
// so that prompt has its own test (LongPrompt*, ctest label `slow`, about 2.5 minutes there); the
// others take seconds. The model's context is 4096; a 4096-token fixture prompt would double that
// time, so the top-k path is checked at 2400 tokens.
#include <gtest/gtest.h>

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

using small_model_testing::kModelDir;

constexpr double kTolerance = 1e-4;

using Prompt = small_model_testing::FixturePrompt;

class WideModelLogitsTest : public small_model_testing::FixtureLogitsTest {
 protected:
  // Positions logits_from.. of `got` against the fixture; returns the worst relative error.
  static double Compare(const Prompt& p, const Tensor& got, const std::string& what,
                        bool expect_match = true) {
    const auto n = static_cast<int64_t>(p.ids.size());
    EXPECT_EQ(got.dim(0), n) << p.name;
    if (got.dim(0) != n) return 1.0;
    const int64_t vocab = got.dim(1);
    const int64_t rows = n - p.logits_from;
    EXPECT_EQ(static_cast<int64_t>(p.logits.size()), rows * vocab) << p.name;
    if (static_cast<int64_t>(p.logits.size()) != rows * vocab) return 1.0;
    const testing::LogitDiff d =
        testing::CompareLogits(got.ptr() + p.logits_from * vocab, p.logits.data(), rows, vocab);
    std::printf("[ logits ] %-22s %-26s max rel err %.2e\n", p.name.c_str(), what.c_str(),
                d.worst_relative);
    if (expect_match) {
      EXPECT_LE(d.worst_relative, kTolerance)
          << p.name << " " << what << ", worst row " << p.logits_from + d.worst_position;
      EXPECT_EQ(d.argmax_mismatches, 0) << p.name << " " << what;
    }
    return d.worst_relative;
  }

  static const Prompt& Long() { return prompts_->back(); }
};

TEST_F(WideModelLogitsTest, ModelHasFlashAttentionShapes) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.num_attention_heads % 64, 0);
  EXPECT_EQ(c.head_dim, 512);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 512);
  EXPECT_EQ(c.sliding_window, 128);
  EXPECT_GE(c.max_position_embeddings, 4096);
}

// The long prompt reaches past 512 compressed CSA entries (rate 4), and no fixture logit depends
// on an indexer tie at the top-k cut-off (numpy_reference.py's indexer_ties.json).
TEST_F(WideModelLogitsTest, FixtureReachesTheTopKPathWithoutIndexerTies) {
  ASSERT_EQ(prompts_->size(), 9u);
  EXPECT_EQ(Long().name, "heldout_long");
  EXPECT_GT(Long().logits_from, 4 * model_->config().index_topk);
  for (const Prompt& p : *prompts_) {
    EXPECT_EQ(p.first_tie_position, static_cast<int64_t>(p.ids.size())) << p.name;
  }
}

// The 8 short prompts (all but heldout_long), one-shot.
TEST_F(WideModelLogitsTest, OneShotMatchesTransformers) {
  for (size_t i = 0; i + 1 < prompts_->size(); ++i) {
    const Prompt& p = prompts_->at(i);
    Compare(p, Run(*model_, p.ids, {static_cast<int64_t>(p.ids.size())}), "one-shot");
  }
}

// The 8 short prompts: prefill of 1 and of all but one token, then one token per Forward call.
TEST_F(WideModelLogitsTest, PrefillThenDecodeMatchesTransformers) {
  for (size_t i = 0; i + 1 < prompts_->size(); ++i) {
    const Prompt& p = prompts_->at(i);
    const auto n = static_cast<int64_t>(p.ids.size());
    for (int64_t prefill : {int64_t{1}, n - 1}) {
      if (prefill < 1) continue;
      Compare(p, Run(*model_, p.ids, {prefill, 1}),
              "prefill " + std::to_string(prefill) + " then decode");
    }
  }
}

// heldout_long: one prefill call through the first half of the fixture rows (the indexer selects
// 512 of 584-592 visible entries there), then one decode step per token for the other 32.
TEST_F(WideModelLogitsTest, LongPromptTopKMatchesTransformers) {
  const Prompt& p = Long();
  const int64_t prefill = p.logits_from + 32;
  Compare(p, Run(*model_, p.ids, {prefill, 1}),
          "prefill " + std::to_string(prefill) + " then decode");
}

// The comparison can fail: one attention sink of the last layer moved by 1.0.
TEST_F(WideModelLogitsTest, PerturbedWeightFails) {
  auto model =
      testing::LoadPerturbedModel(kModelDir.string(), "model.layers.3.self_attn.sinks", 1.0f);
  ASSERT_TRUE(model.ok()) << model.status();
  const Prompt& p = prompts_->at(3);  // chat_system_two_turns: 52 tokens
  const double worst =
      Compare(p, Run(*model, p.ids, {static_cast<int64_t>(p.ids.size())}), "perturbed sink",
              /*expect_match=*/false);
  EXPECT_GT(worst, kTolerance);
}

}  // namespace
}  // namespace pdserve::engine
