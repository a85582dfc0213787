// engine::FastRandomWeights (engine/random_weights.h): every expected tensor with valid values of
// the documented means and spreads, the same values whatever the thread count, and a model the
// CPU engine accepts and runs to finite logits.
#include "engine/random_weights.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "engine/model.h"
#include "engine/tensor_spec.h"
#include "tests/engine/tiny_config.h"

namespace pdserve::engine {
namespace {

TEST(FastRandomWeightsTest, ValidWeightsWithTheDocumentedSpreads) {
  ModelConfig config = testing::TinyConfig();
  config.hidden_size = 512;  // a projection [*, 512] with enough values for its moments
  config.n_routed_experts = 16;
  const Weights w = FastRandomWeights(config, 3, 4);
  ASSERT_TRUE(ValidateWeights(config, w).ok()) << ValidateWeights(config, w);
  const Tensor& ids = w.At("model.layers.0.mlp.gate.tid2eid");
  std::vector<int> seen(16, 0);
  for (float v : ids.data) {
    ASSERT_EQ(v, std::floor(v));
    ASSERT_GE(v, 0.0f);
    ASSERT_LT(v, 16.0f);
    ++seen[static_cast<size_t>(v)];
  }
  int used = 0;
  for (int s : seen) used += s > 0;
  EXPECT_GE(used, 12);  // 64 tokens x 2 picks spread over the 16 experts
  auto moments = [](const Tensor& t) {
    double sum = 0.0;
    double sq = 0.0;
    for (float v : t.data) {
      sum += v;
      sq += static_cast<double>(v) * v;
    }
    const double n = static_cast<double>(t.data.size());
    return std::pair<double, double>(sum / n, std::sqrt(sq / n - (sum / n) * (sum / n)));
  };
  const auto [gate_mean, gate_sd] =
      moments(w.At("model.layers.1.mlp.experts.gate_up_proj"));  // [16, 32, 512]
  EXPECT_NEAR(gate_mean, 0.0, 0.005);
  EXPECT_NEAR(gate_sd * std::sqrt(512.0), 1.0, 0.05);
  const auto [norm_mean, norm_sd] = moments(w.At("model.norm.weight"));
  EXPECT_NEAR(norm_mean, 1.0, 0.02);
  EXPECT_NEAR(norm_sd, 0.1, 0.02);
}

TEST(FastRandomWeightsTest, SameValuesWhateverTheThreadCount) {
  ModelConfig config = testing::TinyConfig();
  config.vocab_size = 8192;  // the embedding passes the size above which the fill is split
  config.hidden_size = 256;
  const Weights one = FastRandomWeights(config, 9, 1);
  const Weights many = FastRandomWeights(config, 9, 7);
  ASSERT_EQ(one.all().size(), many.all().size());
  for (const auto& [name, tensor] : one.all()) {
    const Tensor& other = many.At(name);
    ASSERT_EQ(tensor.data.size(), other.data.size()) << name;
    EXPECT_EQ(std::memcmp(tensor.data.data(), other.data.data(), tensor.data.size() * 4), 0)
        << name;
  }
  const Weights reseeded = FastRandomWeights(config, 10, 7);
  EXPECT_NE(reseeded.At("model.embed_tokens.weight").data[5],
            one.At("model.embed_tokens.weight").data[5]);
}

TEST(FastRandomWeightsTest, TheCpuEngineRunsTheModel) {
  const ModelConfig config = testing::TinyConfig();
  auto model = Model::FromWeights(config, FastRandomWeights(config, 1));
  ASSERT_TRUE(model.ok()) << model.status();
  ModelState state = model->NewState();
  auto logits = model->Forward(&state, {1, 2, 3, 4, 5, 6, 7});
  ASSERT_TRUE(logits.ok()) << logits.status();
  for (float v : logits->data) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace pdserve::engine
