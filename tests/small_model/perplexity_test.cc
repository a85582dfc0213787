// Issue 7, proof 2: the CPU engine's perplexity on the committed held-out slice
// (tests/fixtures/small_model/heldout_slice_ids.bin) is within 1% of the training script's figure,
// computed with the protocol logits.json records: consecutive chunks of `context` tokens (the last
// one shorter), each one forward from an empty state predicting its tokens 1..n-1; loss = total
// negative log-likelihood / predicted tokens (nats); perplexity = exp(loss).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "engine/model.h"
#include "tests/small_model/small_model_fixtures.h"

namespace pdserve::engine {
namespace {

using nlohmann::json;
using small_model_testing::kFixturesDir;
using small_model_testing::kModelDir;

constexpr double kRelativeTolerance = 0.01;

// -log softmax(row)[target] in double precision.
double NegativeLogLikelihood(const float* row, int64_t vocab, int32_t target) {
  const double max = *std::max_element(row, row + vocab);
  double sum = 0.0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - max);
  return std::log(sum) + max - row[target];
}

TEST(SmallModelPerplexityTest, HeldOutSliceWithinOnePercentOfTrainingScript) {
  auto model = Model::Load(kModelDir.string());
  ASSERT_TRUE(model.ok()) << model.status();
  const json record = small_model_testing::ReadJson(kFixturesDir / "logits.json").at("perplexity");
  const auto context = record.at("context").get<int64_t>();
  const std::vector<int32_t> ids = small_model_testing::HeldOutIds();
  ASSERT_FALSE(ids.empty());
  const int64_t vocab = model->config().vocab_size;

  double nll = 0.0;
  int64_t predicted = 0;
  double worst_chunk_diff = 0.0;  // |engine - script| nll_sum per predicted token, worst chunk
  const json& chunks = record.at("chunks");
  ASSERT_EQ(static_cast<int64_t>(chunks.size()),
            (static_cast<int64_t>(ids.size()) + context - 1) / context);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const auto begin = static_cast<int64_t>(c) * context;
    const int64_t end = std::min<int64_t>(begin + context, static_cast<int64_t>(ids.size()));
    const std::vector<int32_t> chunk(ids.begin() + begin, ids.begin() + end);
    ModelState state = model->NewState();
    auto logits = model->Forward(&state, chunk);
    ASSERT_TRUE(logits.ok()) << logits.status();
    double chunk_nll = 0.0;
    for (int64_t t = 0; t + 1 < end - begin; ++t) {
      chunk_nll += NegativeLogLikelihood(logits->ptr() + t * vocab, vocab, chunk[t + 1]);
    }
    const int64_t chunk_predicted = end - begin - 1;
    EXPECT_EQ(chunk_predicted, chunks[c].at("predicted").get<int64_t>());
    worst_chunk_diff =
        std::max(worst_chunk_diff,
                 std::fabs(chunk_nll - chunks[c].at("nll_sum").get<double>()) / chunk_predicted);
    nll += chunk_nll;
    predicted += chunk_predicted;
  }

  ASSERT_EQ(predicted, record.at("predicted_tokens").get<int64_t>());
  const double perplexity = std::exp(nll / predicted);
  const double expected = record.at("perplexity").get<double>();
  const double relative = std::fabs(perplexity - expected) / expected;
  std::printf(
      "[ perplexity ] engine %.4f (loss %.6f) vs training script %.4f: relative diff %.2e; worst "
      "chunk |diff| %.2e nats/token\n",
      perplexity, nll / predicted, expected, relative, worst_chunk_diff);
  EXPECT_LE(relative, kRelativeTolerance);
  small_model_testing::WriteReport("perplexity_report.json",
                                   {{"predicted_tokens", predicted},
                                    {"loss", nll / predicted},
                                    {"perplexity", perplexity},
                                    {"script_perplexity", expected},
                                    {"relative_diff", relative},
                                    {"worst_chunk_nll_diff_per_token", worst_chunk_diff}});
}

}  // namespace
}  // namespace pdserve::engine
