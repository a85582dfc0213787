// The name mapping against what transformers 5.17 actually wrote: every saved name recorded in
// the fixtures' name_map.json (tools/gen_engine_fixtures.py matched tensor values) must resolve
// to the transformers tensor it came from.
#include "engine/checkpoint_layout.h"

#include <fstream>
#include <sstream>
#include <string>

#include "engine/config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::engine {
namespace {

// "model.layers.0.mlp.experts.gate_up_proj[3][up]" -> target with expert 3, part kExpertUp.
TensorTarget ParseNameMapKey(const std::string& key) {
  TensorTarget t;
  const size_t bracket = key.find('[');
  t.canonical = key.substr(0, bracket);
  if (bracket == std::string::npos) return t;
  t.expert = std::stoll(key.substr(bracket + 1));
  if (key.ends_with("[gate]")) {
    t.part = TensorTarget::Part::kExpertGate;
  } else if (key.ends_with("[up]")) {
    t.part = TensorTarget::Part::kExpertUp;
  } else {
    t.part = TensorTarget::Part::kExpertDown;
  }
  return t;
}

class NameMapTest : public ::testing::TestWithParam<std::string> {};

TEST_P(NameMapTest, EverySavedNameResolvesToItsTransformersTensor) {
  const std::string dir = std::string(PDSERVE_FIXTURES_DIR) + "/engine/" + GetParam();
  std::ifstream in(dir + "/name_map.json");
  ASSERT_TRUE(in) << dir;
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json map = nlohmann::json::parse(text.str());
  auto config = ModelConfig::Load(dir + "/model");
  ASSERT_TRUE(config.ok()) << config.status();
  const auto expected = RequiredTensors(*config);
  int checked = 0;
  for (auto it = map.begin(); it != map.end(); ++it) {
    const TensorTarget want = ParseNameMapKey(it.key());
    EXPECT_TRUE(expected.count(want.canonical)) << want.canonical << " is not expected";
    for (const auto& saved : it.value()) {
      const auto got = ResolveTensorName(saved.get<std::string>());
      ASSERT_TRUE(got.has_value()) << saved;
      EXPECT_EQ(got->canonical, want.canonical) << saved;
      EXPECT_EQ(got->part, want.part) << saved;
      EXPECT_EQ(got->expert, want.expert) << saved;
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, NameMapTest,
                         ::testing::Values("mixed_yarn_f32", "legacy_f32", "csa_sigmoid_bf16"));

TEST(CheckpointLayoutTest, DeepSeekReleaseNamesResolve) {
  EXPECT_EQ(ResolveTensorName("embed.weight")->canonical, "model.embed_tokens.weight");
  EXPECT_EQ(ResolveTensorName("hc_head_fn")->canonical, "model.hc_head.hc_fn");
  EXPECT_EQ(ResolveTensorName("layers.3.attn.kv_norm.weight")->canonical,
            "model.layers.3.self_attn.kv_norm.weight");
  const auto w2 = ResolveTensorName("layers.1.ffn.experts.17.w2.weight");
  ASSERT_TRUE(w2.has_value());
  EXPECT_EQ(w2->canonical, "model.layers.1.mlp.experts.down_proj");
  EXPECT_EQ(w2->part, TensorTarget::Part::kExpertDown);
  EXPECT_EQ(w2->expert, 17);
}

TEST(CheckpointLayoutTest, OriginalNameInvertsResolveForEveryExpectedTensor) {
  auto config =
      ModelConfig::Load(std::string(PDSERVE_FIXTURES_DIR) + "/engine/mixed_yarn_f32/model");
  ASSERT_TRUE(config.ok()) << config.status();
  for (const auto& [name, spec] : RequiredTensors(*config)) {
    if (name.ends_with("_proj") && name.find(".experts.") != std::string::npos) continue;
    const std::string original = OriginalName(TensorTarget{name});
    EXPECT_NE(original, name) << "no original name for " << name;
    const auto back = ResolveTensorName(original);
    ASSERT_TRUE(back.has_value()) << original;
    EXPECT_EQ(back->canonical, name);
  }
}

TEST(CheckpointLayoutTest, UnknownNamesDoNotResolve) {
  EXPECT_FALSE(ResolveTensorName("layers.0.attn.wq_c.weight").has_value());
  EXPECT_FALSE(ResolveTensorName("layers.x.attn.wq_a.weight").has_value());
  EXPECT_FALSE(ResolveTensorName("transformer.h.0.weight").has_value());
}

TEST(CheckpointLayoutTest, MtpTensorsAreIgnored) {
  EXPECT_TRUE(IsIgnoredTensorName("mtp.0.attn.wq_a.weight"));
  EXPECT_TRUE(IsIgnoredTensorName("model.mtp.0.emb.weight"));
  EXPECT_FALSE(IsIgnoredTensorName("layers.0.attn.wq_a.weight"));
}

}  // namespace
}  // namespace pdserve::engine
