// Model::FromWeights refuses weights that do not fit the config, naming the tensor, instead of
// crashing later in Forward.
#include <gtest/gtest.h>

#include <string>

#include "engine/model.h"
#include "engine/random_weights.h"
#include "tests/engine/tiny_config.h"

namespace pdserve::engine {
namespace {

TEST(ModelValidationTest, MissingTensorIsNamed) {
  const ModelConfig config = testing::TinyConfig();
  Weights weights;
  const Weights all = RandomWeights(config, 1);
  for (const auto& [name, tensor] : all.all()) {
    if (name != "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight") {
      weights.Set(name, tensor);
    }
  }
  auto model = Model::FromWeights(config, std::move(weights));
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("indexer.q_b_proj.weight"), std::string::npos)
      << model.status();
}

TEST(ModelValidationTest, WrongShapeIsNamed) {
  const ModelConfig config = testing::TinyConfig();
  Weights weights = RandomWeights(config, 1);
  weights.Set("model.layers.2.self_attn.sinks", Tensor({config.num_attention_heads + 1}));
  auto model = Model::FromWeights(config, std::move(weights));
  ASSERT_FALSE(model.ok());
  EXPECT_NE(model.status().message().find("layers.2.self_attn.sinks"), std::string::npos)
      << model.status();
}

TEST(ModelValidationTest, HashTableOutOfRangeIsRejected) {
  const ModelConfig config = testing::TinyConfig();
  Weights weights = RandomWeights(config, 1);
  Tensor table({config.vocab_size, config.num_experts_per_tok});
  table.data[5] = static_cast<float>(config.n_routed_experts);
  weights.Set("model.layers.0.mlp.gate.tid2eid", table);
  EXPECT_FALSE(Model::FromWeights(config, std::move(weights)).ok());
}

TEST(ModelValidationTest, TiedEmbeddingsServeAsLmHead) {
  ModelConfig config = testing::TinyConfig();
  config.tie_word_embeddings = true;
  Weights weights;
  const Weights all = RandomWeights(config, 1);
  for (const auto& [name, tensor] : all.all()) {
    if (name != "lm_head.weight") weights.Set(name, tensor);
  }
  EXPECT_TRUE(Model::FromWeights(config, std::move(weights)).ok());
}

}  // namespace
}  // namespace pdserve::engine
