// ModelConfig::Parse / Load against transformers 5.17 DeepseekV4Config.__post_init__
// (models/deepseek_v4/configuration_deepseek_v4.py): each expectation below is what that code
// computes for the given config.json.
#include "engine/config.h"

#include <cmath>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/engine_loader/checkpoint_writer.h"

namespace pdserve::engine {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr auto kSwa = LayerType::kSlidingAttention;
constexpr auto kCsa = LayerType::kCompressedSparseAttention;
constexpr auto kHca = LayerType::kHeavilyCompressedAttention;

ModelConfig ParseOk(const std::string& json) {
  auto c = ModelConfig::Parse(json, "test.json");
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : ModelConfig{};
}

std::string ParseError(const std::string& json) {
  auto c = ModelConfig::Parse(json, "test.json");
  EXPECT_FALSE(c.ok());
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(ConfigTest, DefaultLayerScheduleIsTwoHcaThenInterleavedHcaCsa) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "num_hidden_layers": 7})");
  EXPECT_THAT(c.layer_types, ElementsAre(kHca, kHca, kHca, kCsa, kHca, kCsa, kHca));
}

TEST(ConfigTest, DefaultMlpScheduleIsThreeHashLayers) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "num_hidden_layers": 5})");
  EXPECT_THAT(c.mlp_layer_types,
              ElementsAre(MlpLayerType::kHashMoe, MlpLayerType::kHashMoe, MlpLayerType::kHashMoe,
                          MlpLayerType::kMoe, MlpLayerType::kMoe));
}

TEST(ConfigTest, LegacyCompressRatiosBecomeLayerTypesTruncatedToLayerCount) {
  // DeepSeek's config lists one extra ratio for the MTP layer; transformers drops it.
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "num_hidden_layers": 4,
      "compress_ratios": [0, 4, 128, 4, 0]})");
  EXPECT_THAT(c.layer_types, ElementsAre(kSwa, kCsa, kHca, kCsa));
}

TEST(ConfigTest, ExplicitLayerTypesWinOverCompressRatios) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "num_hidden_layers": 2,
      "layer_types": ["sliding_attention", "sliding_attention"], "compress_ratios": [4, 4]})");
  EXPECT_THAT(c.layer_types, ElementsAre(kSwa, kSwa));
}

TEST(ConfigTest, LegacyCompressRateScalarsOverrideCompressRates) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4",
      "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 64},
      "compress_rate_hca": 16})");
  EXPECT_EQ(c.compress_rate_csa, 8);
  EXPECT_EQ(c.compress_rate_hca, 16);
}

TEST(ConfigTest, LegacyNumHashLayers) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "num_hidden_layers": 3,
      "num_hash_layers": 1})");
  EXPECT_THAT(c.mlp_layer_types,
              ElementsAre(MlpLayerType::kHashMoe, MlpLayerType::kMoe, MlpLayerType::kMoe));
}

TEST(ConfigTest, LegacyQkRopeHeadDimSetsPartialRotaryFactor) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "head_dim": 32,
      "qk_rope_head_dim": 8})");
  EXPECT_EQ(c.qk_rope_head_dim, 8);
  EXPECT_DOUBLE_EQ(c.rope_main.partial_rotary_factor, 0.25);
  EXPECT_DOUBLE_EQ(c.rope_compress.partial_rotary_factor, 0.25);
}

TEST(ConfigTest, ExplicitPartialRotaryFactorWinsOverQkRopeHeadDim) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "head_dim": 64,
      "qk_rope_head_dim": 8, "partial_rotary_factor": 0.25})");
  EXPECT_EQ(c.qk_rope_head_dim, 16);
}

TEST(ConfigTest, FlatYarnRopeScalingGoesToCompressWithAttentionFactorOne) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "max_position_embeddings": 4096,
      "rope_theta": 10000, "compress_rope_theta": 160000,
      "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                       "beta_fast": 32, "beta_slow": 1}})");
  EXPECT_EQ(c.rope_main.rope_type, "default");
  EXPECT_DOUBLE_EQ(c.rope_main.rope_theta, 10000.0);
  EXPECT_EQ(c.rope_compress.rope_type, "yarn");
  EXPECT_DOUBLE_EQ(c.rope_compress.rope_theta, 160000.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.factor, 16.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.original_max_position_embeddings, 256.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.attention_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.partial_rotary_factor, 0.125);
}

TEST(ConfigTest, FlatYarnWithoutOriginalLengthUsesMaxPositionEmbeddings) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "max_position_embeddings": 512,
      "rope_parameters": {"rope_type": "yarn", "factor": 4}})");
  EXPECT_DOUBLE_EQ(c.rope_compress.original_max_position_embeddings, 512.0);
}

TEST(ConfigTest, NoRopeParametersGivesDefaultRopeAtBothThetas) {
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4"})");
  EXPECT_EQ(c.rope_compress.rope_type, "default");
  EXPECT_DOUBLE_EQ(c.rope_main.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.rope_theta, 160000.0);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
}

TEST(ConfigTest, NestedYarnWithoutAttentionFactorUsesYarnMscale) {
  // Nested sub-dicts are used as they are: no attention_factor injected, and a missing
  // partial_rotary_factor means 1.0 to transformers' rope init functions.
  const ModelConfig c = ParseOk(R"({"model_type": "deepseek_v4", "head_dim": 16,
      "index_head_dim": 16, "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 500.0},
        "compress": {"rope_type": "yarn", "rope_theta": 900.0, "factor": 4.0,
                     "original_max_position_embeddings": 16}}})");
  EXPECT_DOUBLE_EQ(c.rope_main.rope_theta, 500.0);
  EXPECT_DOUBLE_EQ(c.rope_main.partial_rotary_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.attention_factor, 0.1 * std::log(4.0) + 1.0);
}

TEST(ConfigTest, EosTokenIdAcceptsIntListAndNull) {
  EXPECT_THAT(ParseOk(R"({"model_type": "deepseek_v4", "eos_token_id": 7})").eos_token_ids,
              ElementsAre(7));
  EXPECT_THAT(ParseOk(R"({"model_type": "deepseek_v4", "eos_token_id": [1, 2]})").eos_token_ids,
              ElementsAre(1, 2));
  EXPECT_TRUE(
      ParseOk(R"({"model_type": "deepseek_v4", "eos_token_id": null})").eos_token_ids.empty());
}

TEST(ConfigTest, FixtureConfigsParseAsTransformersSavedThem) {
  const std::string dir = std::string(PDSERVE_FIXTURES_DIR) + "/engine/";
  auto mixed = ModelConfig::Load(dir + "mixed_yarn_f32/model");
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_THAT(mixed->layer_types, ElementsAre(kSwa, kCsa, kHca, kCsa));
  EXPECT_EQ(mixed->compress_rate_hca, 8);
  EXPECT_EQ(mixed->rope_compress.rope_type, "yarn");
  EXPECT_DOUBLE_EQ(mixed->rope_compress.factor, 4.0);

  auto legacy = ModelConfig::Load(dir + "legacy_f32/model");
  ASSERT_TRUE(legacy.ok()) << legacy.status();
  EXPECT_THAT(legacy->layer_types, ElementsAre(kCsa, kHca, kSwa, kCsa));
  EXPECT_EQ(legacy->compress_rate_hca, 16);
  EXPECT_EQ(legacy->qk_rope_head_dim, 8);
  EXPECT_THAT(legacy->mlp_layer_types, ElementsAre(MlpLayerType::kHashMoe, MlpLayerType::kMoe,
                                                   MlpLayerType::kMoe, MlpLayerType::kMoe));

  auto bf16 = ModelConfig::Load(dir + "csa_sigmoid_bf16/model");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->scoring_func, ScoringFunc::kSigmoid);
  EXPECT_THAT(bf16->eos_token_ids, ElementsAre(1, 2));
}

TEST(ConfigTest, UnknownModelTypeIsAnError) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v3"})"),
              HasSubstr("unknown model_type \"deepseek_v3\""));
}

TEST(ConfigTest, MalformedJsonNamesTheSource) {
  EXPECT_THAT(ParseError(R"({"model_type": )"), HasSubstr("test.json: malformed JSON"));
}

TEST(ConfigTest, WrongValueTypeNamesTheKey) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "hidden_size": 4096.0})"),
              HasSubstr("key \"hidden_size\": expected an integer"));
}

TEST(ConfigTest, ShortLayerTypesIsAnError) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "num_hidden_layers": 3,
      "layer_types": ["sliding_attention"]})"),
              HasSubstr("key \"layer_types\": has 1 entries, num_hidden_layers is 3"));
}

TEST(ConfigTest, UnknownCompressRatioIsAnError) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "num_hidden_layers": 1,
      "compress_ratios": [8]})"),
              HasSubstr("entry 8 is not one of 0, 4, 128"));
}

TEST(ConfigTest, NonPositiveSizeIsAnError) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "hidden_size": 0})"),
              HasSubstr("key \"hidden_size\": must be positive"));
}

TEST(ConfigTest, ZeroHeadDimIsNamedNotTheRopeDimension) {
  // head_dim 0 used to be reported as a bad qk_rope_head_dim (the rope factor divides by it).
  const std::string error =
      ParseError(R"({"model_type": "deepseek_v4", "head_dim": 0, "qk_rope_head_dim": 64})");
  EXPECT_THAT(error, HasSubstr("key \"head_dim\": must be positive, got 0"));
  EXPECT_THAT(error, ::testing::Not(HasSubstr("qk_rope_head_dim")));
}

TEST(ConfigTest, AbsurdSizesAreRefusedBeforeAnythingIsBuilt) {
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "num_hidden_layers": 1000000000000})"),
              HasSubstr("key \"num_hidden_layers\": must be in [1, 4096]"));
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "n_routed_experts": 1000000})"),
              HasSubstr("key \"n_routed_experts\": 1000000 exceeds 65536"));
  EXPECT_THAT(ParseError(R"({"model_type": "deepseek_v4", "vocab_size": 4294967296})"),
              HasSubstr("key \"vocab_size\": 4294967296 exceeds 16777216"));
}

TEST(ConfigTest, MissingFileIsNotFound) {
  const std::string dir = testing::MakeTempDir("config_missing");
  auto c = ModelConfig::Load(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr(dir + "/config.json"));
}

}  // namespace
}  // namespace pdserve::engine
