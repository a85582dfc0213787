// Weights::Load on the transformers fixtures (tests/fixtures/engine, written by
// tools/gen_engine_fixtures.py) and on checkpoints each test writes from them: name schemes,
// sharding, tied embeddings, quantized forms, and one precise error per bad-checkpoint case.
#include "engine/weights.h"

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/checkpoint_layout.h"
#include "engine/config.h"
#include "engine/random_weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine_loader/checkpoint_writer.h"
#include "tests/engine_loader/test_quantizer.h"

namespace pdserve::engine {
namespace {

using ::testing::HasSubstr;
using testing::StoredTensor;

std::string FixtureDir(const std::string& name) {
  return std::string(PDSERVE_FIXTURES_DIR) + "/engine/" + name;
}

const std::string kMixed = "mixed_yarn_f32";

absl::StatusOr<Weights> LoadDir(const std::string& dir) {
  auto config = ModelConfig::Load(dir);
  if (!config.ok()) return config.status();
  return Weights::Load(dir, *config);
}

// The mixed fixture's tensors as transformers saved them, ready to be edited by a test.
std::vector<StoredTensor> MixedTensors() {
  return testing::ReadAllTensors(FixtureDir(kMixed) + "/model/model.safetensors");
}

// Writes `tensors` as model.safetensors beside the mixed fixture's config.json.
std::string WriteModel(const std::string& stem, const std::vector<StoredTensor>& tensors,
                       const std::string& config_from = FixtureDir(kMixed) + "/model") {
  const std::string dir = testing::MakeTempDir(stem);
  testing::CopyFile(config_from + "/config.json", dir + "/config.json");
  testing::WriteSafetensors(dir + "/model.safetensors", tensors);
  return dir;
}

StoredTensor& Find(std::vector<StoredTensor>& tensors, const std::string& name) {
  for (StoredTensor& t : tensors) {
    if (t.name == name) return t;
  }
  ADD_FAILURE() << "no stored tensor " << name;
  return tensors.front();
}

void Erase(std::vector<StoredTensor>& tensors, const std::string& name) {
  std::erase_if(tensors, [&](const StoredTensor& t) { return t.name == name; });
}

std::vector<float> AsFloats(const StoredTensor& t) {
  std::vector<float> v(t.bytes.size() / 4);
  std::memcpy(v.data(), t.bytes.data(), t.bytes.size());
  return v;
}

void ExpectSameWeights(const Weights& a, const Weights& b) {
  ASSERT_EQ(a.all().size(), b.all().size());
  for (const auto& [name, tensor] : a.all()) {
    auto other = b.Get(name);
    ASSERT_TRUE(other.ok()) << name;
    EXPECT_EQ((*other)->shape, tensor.shape) << name;
    EXPECT_EQ(std::memcmp((*other)->ptr(), tensor.ptr(), tensor.data.size() * sizeof(float)), 0)
        << name;
  }
}

std::string LoadError(const std::string& dir) {
  auto w = LoadDir(dir);
  EXPECT_FALSE(w.ok());
  return w.ok() ? "" : std::string(w.status().message());
}

class FixtureLoadTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureLoadTest, LoadsEveryExpectedTensorWithItsShape) {
  const std::string dir = FixtureDir(GetParam()) + "/model";
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto weights = Weights::Load(dir, *config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  const auto expected = RequiredTensors(*config);
  EXPECT_EQ(weights->all().size(), expected.size());
  for (const auto& [name, spec] : expected) {
    EXPECT_EQ(weights->At(name).shape, spec.shape) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FixtureLoadTest,
                         ::testing::Values("mixed_yarn_f32", "legacy_f32", "csa_sigmoid_bf16"));

TEST(WeightsTest, TransformersNamesLoadToTheSameTensors) {
  auto saved = LoadDir(FixtureDir(kMixed) + "/model");
  auto in_memory = LoadDir(FixtureDir(kMixed) + "/model_hf_names");
  ASSERT_TRUE(saved.ok()) << saved.status();
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  ExpectSameWeights(*saved, *in_memory);
}

TEST(WeightsTest, DeepSeekReleaseNamesLoadToTheSameTensors) {
  std::vector<StoredTensor> tensors = MixedTensors();
  for (StoredTensor& t : tensors) t.name = OriginalName(*ResolveTensorName(t.name));
  EXPECT_EQ(Find(tensors, "embed.weight").shape, (std::vector<int64_t>{384, 64}));
  auto renamed = LoadDir(WriteModel("release_names", tensors));
  auto saved = LoadDir(FixtureDir(kMixed) + "/model");
  ASSERT_TRUE(renamed.ok()) << renamed.status();
  ASSERT_TRUE(saved.ok()) << saved.status();
  ExpectSameWeights(*saved, *renamed);
}

TEST(WeightsTest, ExpertsStackGateThenUp) {
  std::vector<StoredTensor> tensors = MixedTensors();
  auto weights = LoadDir(FixtureDir(kMixed) + "/model");
  ASSERT_TRUE(weights.ok()) << weights.status();
  const Tensor& gate_up = weights->At("model.layers.2.mlp.experts.gate_up_proj");
  const Tensor& down = weights->At("model.layers.2.mlp.experts.down_proj");
  const int64_t inter = 32, hidden = 64, expert = 3;
  const std::vector<float> w1 = AsFloats(Find(tensors, "model.layers.2.ffn.experts.3.w1.weight"));
  const std::vector<float> w3 = AsFloats(Find(tensors, "model.layers.2.ffn.experts.3.w3.weight"));
  const std::vector<float> w2 = AsFloats(Find(tensors, "model.layers.2.ffn.experts.3.w2.weight"));
  const float* e = gate_up.ptr() + expert * 2 * inter * hidden;
  EXPECT_EQ(std::vector<float>(e, e + inter * hidden), w1);
  EXPECT_EQ(std::vector<float>(e + inter * hidden, e + 2 * inter * hidden), w3);
  const float* d = down.ptr() + expert * hidden * inter;
  EXPECT_EQ(std::vector<float>(d, d + hidden * inter), w2);
}

TEST(WeightsTest, ShardedCheckpointEqualsSingleFile) {
  const std::vector<StoredTensor> tensors = MixedTensors();
  const std::string dir = testing::MakeTempDir("sharded");
  testing::CopyFile(FixtureDir(kMixed) + "/model/config.json", dir + "/config.json");
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  std::vector<StoredTensor> shards[3];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string shard = "model-0000" + std::to_string(i % 3 + 1) + "-of-00003.safetensors";
    shards[i % 3].push_back(tensors[i]);
    index["weight_map"][tensors[i].name] = shard;
  }
  for (int s = 0; s < 3; ++s) {
    testing::WriteSafetensors(dir + "/model-0000" + std::to_string(s + 1) + "-of-00003.safetensors",
                              shards[s]);
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  auto sharded = LoadDir(dir);
  auto single = LoadDir(FixtureDir(kMixed) + "/model");
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  ASSERT_TRUE(single.ok()) << single.status();
  ExpectSameWeights(*single, *sharded);
}

TEST(WeightsTest, Bf16ShardsConvertExactly) {
  auto weights = LoadDir(FixtureDir("csa_sigmoid_bf16") + "/model");
  ASSERT_TRUE(weights.ok()) << weights.status();
  const Tensor& q = weights->At("model.layers.0.self_attn.q_b_proj.weight");
  int nonzero = 0;
  for (float v : q.data) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    EXPECT_EQ(bits & 0xffffu, 0u);  // a widened bf16 has no low mantissa bits
    nonzero += v != 0.0f;
  }
  EXPECT_GT(nonzero, q.numel() / 2);
}

TEST(WeightsTest, Tid2eidBecomesFloatExpertIds) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& tid = Find(tensors, "model.layers.0.ffn.gate.tid2eid");
  std::vector<int64_t> ids(tid.bytes.size() / 8);
  std::memcpy(ids.data(), tid.bytes.data(), tid.bytes.size());
  // Stored as I32 instead of I64: same values.
  tid.dtype = "I32";
  tid.bytes = testing::I32Bytes(std::vector<int32_t>(ids.begin(), ids.end()));
  auto weights = LoadDir(WriteModel("tid_i32", tensors));
  ASSERT_TRUE(weights.ok()) << weights.status();
  const Tensor& t = weights->At("model.layers.0.mlp.gate.tid2eid");
  ASSERT_EQ(t.numel(), static_cast<int64_t>(ids.size()));
  for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(t.data[i], static_cast<float>(ids[i]));
}

TEST(WeightsTest, TiedEmbeddingsReuseTheEmbeddingMatrix) {
  const std::string dir = testing::MakeTempDir("tied");
  std::ifstream in(FixtureDir(kMixed) + "/model/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["tie_word_embeddings"] = true;
  std::ofstream(dir + "/config.json") << config.dump();
  std::vector<StoredTensor> tensors = MixedTensors();
  Erase(tensors, "head.weight");
  testing::WriteSafetensors(dir + "/model.safetensors", tensors);
  auto weights = LoadDir(dir);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->At("lm_head.weight").data, weights->At("model.embed_tokens.weight").data);
}

// FP8 E4M3 with 128x128 block scales under DeepSeek's names (`.scale`, UE8M0 as shipped) and
// under transformers' names (`.weight_scale_inv`, float32).
TEST(WeightsTest, Fp8WeightWithUe8m0ScaleDequantizesOnLoad) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& w = Find(tensors, "model.layers.1.attn.wq_b.weight");  // [128, 32]
  const testing::Quantized q = testing::QuantizeFp8(AsFloats(w), 128, 32, /*ue8m0=*/true);
  w.dtype = "F8_E4M3";
  w.bytes.assign(q.codes.begin(), q.codes.end());
  tensors.push_back({"model.layers.1.attn.wq_b.scale",
                     "F8_E8M0",
                     {1, 1},
                     std::string(q.e8m0.begin(), q.e8m0.end())});
  auto weights = LoadDir(WriteModel("fp8_ue8m0", tensors));
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->At("model.layers.1.self_attn.q_b_proj.weight").data, q.expected);
}

TEST(WeightsTest, Fp8WeightWithFloatScaleInvUnderTransformersNames) {
  std::vector<StoredTensor> tensors =
      testing::ReadAllTensors(FixtureDir(kMixed) + "/model_hf_names/model.safetensors");
  StoredTensor& w = Find(tensors, "model.layers.1.self_attn.q_b_proj.weight");
  const testing::Quantized q = testing::QuantizeFp8(AsFloats(w), 128, 32, /*ue8m0=*/false);
  w.dtype = "F8_E4M3";
  w.bytes.assign(q.codes.begin(), q.codes.end());
  tensors.push_back({"model.layers.1.self_attn.q_b_proj.weight_scale_inv",
                     "F32",
                     {1, 1},
                     testing::F32Bytes(q.scales)});
  auto weights = LoadDir(WriteModel("fp8_hf", tensors, FixtureDir(kMixed) + "/model_hf_names"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->At("model.layers.1.self_attn.q_b_proj.weight").data, q.expected);
}

TEST(WeightsTest, Fp8StackedExpertsWithOneScaleGridPerExpert) {
  std::vector<StoredTensor> tensors =
      testing::ReadAllTensors(FixtureDir(kMixed) + "/model_hf_names/model.safetensors");
  StoredTensor& w = Find(tensors, "model.layers.2.mlp.experts.gate_up_proj");  // [4, 64, 64]
  const std::vector<float> values = AsFloats(w);
  std::vector<float> expected;
  std::string codes, scales;
  for (int64_t e = 0; e < 4; ++e) {
    const std::vector<float> matrix(values.begin() + e * 64 * 64,
                                    values.begin() + (e + 1) * 64 * 64);
    const testing::Quantized q = testing::QuantizeFp8(matrix, 64, 64, /*ue8m0=*/true);
    codes.append(q.codes.begin(), q.codes.end());
    scales.append(q.e8m0.begin(), q.e8m0.end());
    expected.insert(expected.end(), q.expected.begin(), q.expected.end());
  }
  w.dtype = "F8_E4M3";
  w.bytes = codes;
  tensors.push_back(
      {"model.layers.2.mlp.experts.gate_up_proj_scale_inv", "F8_E8M0", {4, 1, 1}, scales});
  auto weights =
      LoadDir(WriteModel("fp8_experts", tensors, FixtureDir(kMixed) + "/model_hf_names"));
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->At("model.layers.2.mlp.experts.gate_up_proj").data, expected);
}

// FP4 E2M1 routed experts, two per byte, [rows, cols / 32] UE8M0 scales; stored as "F4"
// (safetensors' float4_e2m1fn_x2, element shape) or as packed I8 bytes (byte shape).
class Fp4ExpertTest : public ::testing::TestWithParam<const char*> {};

TEST_P(Fp4ExpertTest, ExpertWeightsDequantizeOnLoad) {
  const std::string dtype = GetParam();
  std::vector<StoredTensor> tensors = MixedTensors();
  std::vector<float> expected_gate, expected_down;
  for (const char* part : {"w1", "w2"}) {
    const std::string base = std::string("model.layers.3.ffn.experts.1.") + part;
    StoredTensor& w = Find(tensors, base + ".weight");
    const int64_t rows = w.shape[0], cols = w.shape[1];
    const testing::Quantized q = testing::QuantizeFp4(AsFloats(w), rows, cols);
    w.dtype = dtype;
    if (dtype != "F4") w.shape = {rows, cols / 2};
    w.bytes.assign(q.codes.begin(), q.codes.end());
    tensors.push_back(
        {base + ".scale", "F8_E8M0", {rows, cols / 32}, std::string(q.e8m0.begin(), q.e8m0.end())});
    (std::string(part) == "w1" ? expected_gate : expected_down) = q.expected;
  }
  auto weights = LoadDir(WriteModel("fp4_" + dtype, tensors));
  ASSERT_TRUE(weights.ok()) << weights.status();
  const int64_t inter = 32, hidden = 64;
  const float* gate =
      weights->At("model.layers.3.mlp.experts.gate_up_proj").ptr() + 1 * 2 * inter * hidden;
  EXPECT_EQ(std::vector<float>(gate, gate + inter * hidden), expected_gate);
  const float* down = weights->At("model.layers.3.mlp.experts.down_proj").ptr() + hidden * inter;
  EXPECT_EQ(std::vector<float>(down, down + hidden * inter), expected_down);
}

INSTANTIATE_TEST_SUITE_P(Storage, Fp4ExpertTest, ::testing::Values("F4", "I8", "U8"));

// ---- Bad checkpoints: each gives its own precise error, naming the file and tensor. ----

// random_weights.json instead of a checkpoint: FastRandomWeights of the config and seed.
TEST(WeightsTest, RandomWeightsFileLoadsTheSeedsWeights) {
  const std::string dir = testing::MakeTempDir("random_weights");
  testing::CopyFile(FixtureDir(kMixed) + "/model/config.json", dir + "/config.json");
  std::ofstream(dir + "/random_weights.json") << R"({"seed": 7})";
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto loaded = Weights::Load(dir, *config);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Weights expected = FastRandomWeights(*config, 7);
  const Weights other_seed = FastRandomWeights(*config, 8);
  ASSERT_EQ(loaded->all().size(), expected.all().size());
  for (const auto& [name, tensor] : expected.all()) {
    const Tensor& got = loaded->At(name);
    ASSERT_EQ(got.shape, tensor.shape) << name;
    EXPECT_EQ(got.data, tensor.data) << name;
  }
  EXPECT_NE(loaded->At("model.embed_tokens.weight").data,
            other_seed.At("model.embed_tokens.weight").data);
}

TEST(WeightsErrorTest, RandomWeightsFileErrors) {
  const std::string dir = testing::MakeTempDir("random_weights_bad");
  testing::CopyFile(FixtureDir(kMixed) + "/model/config.json", dir + "/config.json");
  auto config = ModelConfig::Load(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto error_of = [&](const std::string& text) {
    std::ofstream(dir + "/random_weights.json") << text;
    auto loaded = Weights::Load(dir, *config);
    return loaded.ok() ? std::string("ok") : std::string(loaded.status().message());
  };
  EXPECT_THAT(error_of("{"), HasSubstr("random_weights.json: malformed JSON"));
  EXPECT_THAT(error_of(R"({"seed": -1})"), HasSubstr("\"seed\" must be a non-negative integer"));
  EXPECT_THAT(error_of(R"({"sed": 1})"), HasSubstr("unknown key \"sed\""));
  testing::CopyFile(FixtureDir(kMixed) + "/model/model.safetensors", dir + "/model.safetensors");
  EXPECT_THAT(error_of(R"({"seed": 1})"),
              HasSubstr("holds both random_weights.json and model.safetensors"));
}

// tools/gpu/make_random_model.py's default directory: DeepSeek-V4-Flash shapes, which are
// engine::ModelConfig's defaults, and the default layer schedule of a config that names none.
TEST(RandomModelToolTest, FlashShapesAreTheEngineDefaults) {
  const std::string dir = testing::MakeTempDir("random_flash");
  const std::string source = PDSERVE_SOURCE_DIR;
  const std::string command = absl::StrCat(
      "python3 ", source, "/tools/gpu/make_random_model.py --out ", dir,
      "/model --layers 43 --seed 3 --tokenizer-from ", source, "/models/kjv-v4-tiny > /dev/null");
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto config = ModelConfig::Load(dir + "/model");
  ASSERT_TRUE(config.ok()) << config.status();
  const ModelConfig flash;
  EXPECT_EQ(config->hidden_size, flash.hidden_size);
  EXPECT_EQ(config->moe_intermediate_size, flash.moe_intermediate_size);
  EXPECT_EQ(config->num_attention_heads, flash.num_attention_heads);
  EXPECT_EQ(config->num_key_value_heads, flash.num_key_value_heads);
  EXPECT_EQ(config->head_dim, flash.head_dim);
  EXPECT_EQ(config->qk_rope_head_dim, flash.qk_rope_head_dim);
  EXPECT_EQ(config->q_lora_rank, flash.q_lora_rank);
  EXPECT_EQ(config->o_lora_rank, flash.o_lora_rank);
  EXPECT_EQ(config->o_groups, flash.o_groups);
  EXPECT_EQ(config->n_routed_experts, flash.n_routed_experts);
  EXPECT_EQ(config->num_experts_per_tok, flash.num_experts_per_tok);
  EXPECT_EQ(config->n_shared_experts, flash.n_shared_experts);
  EXPECT_EQ(config->index_n_heads, flash.index_n_heads);
  EXPECT_EQ(config->index_head_dim, flash.index_head_dim);
  EXPECT_EQ(config->index_topk, flash.index_topk);
  EXPECT_EQ(config->sliding_window, flash.sliding_window);
  EXPECT_EQ(config->hc_mult, flash.hc_mult);
  EXPECT_EQ(config->compress_rate_csa, flash.compress_rate_csa);
  EXPECT_EQ(config->compress_rate_hca, flash.compress_rate_hca);
  EXPECT_EQ(config->num_hidden_layers, 43);
  auto schedule =
      ModelConfig::Parse(R"({"model_type": "deepseek_v4", "num_hidden_layers": 43})", "inline");
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  EXPECT_EQ(config->layer_types, schedule->layer_types);
  EXPECT_EQ(config->mlp_layer_types, schedule->mlp_layer_types);
  EXPECT_EQ(config->layer_types[0], LayerType::kHeavilyCompressedAttention);
  EXPECT_EQ(config->layer_types[3], LayerType::kCompressedSparseAttention);
  // The tokenizer's model sets the vocabulary.
  auto bundled = ModelConfig::Load(source + "/models/kjv-v4-tiny");
  ASSERT_TRUE(bundled.ok()) << bundled.status();
  EXPECT_EQ(config->vocab_size, bundled->vocab_size);
}

TEST(WeightsErrorTest, NoCheckpointFile) {
  const std::string dir = testing::MakeTempDir("no_ckpt");
  testing::CopyFile(FixtureDir(kMixed) + "/model/config.json", dir + "/config.json");
  EXPECT_THAT(LoadError(dir), HasSubstr(dir + ": no checkpoint: neither model.safetensors nor "
                                              "model.safetensors.index.json exists"));
}

TEST(WeightsErrorTest, BadHeader) {
  const std::string dir = WriteModel("bad_header", {});
  const std::string bytes("\x10\0\0\0\0\0\0\0not json at all!", 24);
  std::ofstream(dir + "/model.safetensors", std::ios::trunc | std::ios::binary) << bytes;
  EXPECT_THAT(LoadError(dir), HasSubstr(dir + "/model.safetensors: bad safetensors header"));
}

TEST(WeightsErrorTest, TruncatedData) {
  const std::string dir = WriteModel("truncated", MixedTensors());
  const std::string path = dir + "/model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  const std::string error = LoadError(dir);
  EXPECT_THAT(error, HasSubstr(path + ": tensor \""));
  EXPECT_THAT(error, HasSubstr("file truncated"));
}

TEST(WeightsErrorTest, MissingTensorNamesBothNames) {
  std::vector<StoredTensor> tensors = MixedTensors();
  Erase(tensors, "model.layers.1.attn.compressor.ape");
  EXPECT_THAT(LoadError(WriteModel("missing", tensors)),
              HasSubstr("missing tensor model.layers.1.self_attn.compressor.position_bias "
                        "(DeepSeek name layers.1.attn.compressor.ape)"));
}

TEST(WeightsErrorTest, MissingExpertNamesTheExpert) {
  std::vector<StoredTensor> tensors = MixedTensors();
  Erase(tensors, "model.layers.2.ffn.experts.3.w3.weight");
  EXPECT_THAT(LoadError(WriteModel("missing_expert", tensors)),
              HasSubstr("missing tensor model.layers.2.mlp.experts.gate_up_proj expert 3 "
                        "(DeepSeek name layers.2.ffn.experts.3.w3.weight)"));
}

TEST(WeightsErrorTest, UnexpectedTensorName) {
  std::vector<StoredTensor> tensors = MixedTensors();
  tensors.push_back({"model.layers.0.attn.wq_c.weight", "F32", {1}, testing::F32Bytes({1})});
  const std::string dir = WriteModel("unexpected", tensors);
  EXPECT_THAT(LoadError(dir),
              HasSubstr(dir + "/model.safetensors: tensor \"model.layers.0.attn.wq_c.weight\": "
                              "unexpected tensor (not a DeepSeek-V4 tensor name)"));
}

TEST(WeightsErrorTest, TensorTheConfigDoesNotHave) {
  // Layer 0 is a sliding-window layer: it has no compressor.
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor ape = Find(tensors, "model.layers.1.attn.compressor.ape");
  ape.name = "model.layers.0.attn.compressor.ape";
  tensors.push_back(ape);
  EXPECT_THAT(LoadError(WriteModel("not_in_config", tensors)),
              HasSubstr("tensor \"model.layers.0.attn.compressor.ape\": unexpected tensor (it "
                        "would be model.layers.0.self_attn.compressor.position_bias, which this "
                        "config.json does not have)"));
}

TEST(WeightsErrorTest, WrongShape) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& w = Find(tensors, "model.layers.0.attn.wq_a.weight");
  w.shape = {w.shape[1], w.shape[0]};
  EXPECT_THAT(LoadError(WriteModel("wrong_shape", tensors)),
              HasSubstr("tensor \"model.layers.0.attn.wq_a.weight\": wrong shape [64, 32], "
                        "expected [32, 64] for model.layers.0.self_attn.q_a_proj.weight"));
}

TEST(WeightsErrorTest, WrongDtype) {
  std::vector<StoredTensor> tensors = MixedTensors();
  Find(tensors, "model.norm.weight").dtype = "I32";
  EXPECT_THAT(LoadError(WriteModel("wrong_dtype", tensors)),
              HasSubstr("tensor \"model.norm.weight\": wrong dtype I32 (expected F32, BF16 or "
                        "F16)"));
}

TEST(WeightsErrorTest, FloatTid2eidIsWrongDtype) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& tid = Find(tensors, "model.layers.0.ffn.gate.tid2eid");
  tid.dtype = "F64";
  EXPECT_THAT(LoadError(WriteModel("tid_f64", tensors)),
              HasSubstr("tensor \"model.layers.0.ffn.gate.tid2eid\": wrong dtype F64 (expected "
                        "I32 or I64)"));
}

TEST(WeightsErrorTest, Tid2eidOutsideTheExperts) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& tid = Find(tensors, "model.layers.1.ffn.gate.tid2eid");
  const int64_t bad = 4;  // n_routed_experts is 4
  std::memcpy(tid.bytes.data() + 8 * 5, &bad, 8);
  EXPECT_THAT(LoadError(WriteModel("tid_range", tensors)),
              HasSubstr("entry 5 is expert id 4, outside [0, 4)"));
}

TEST(WeightsErrorTest, QuantizedWeightWithoutScale) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& w = Find(tensors, "model.layers.1.attn.wq_b.weight");
  w.dtype = "F8_E4M3";
  w.bytes.resize(w.bytes.size() / 4);
  EXPECT_THAT(LoadError(WriteModel("fp8_no_scale", tensors)),
              HasSubstr("F8_E4M3 weight without its block scales"));
}

TEST(WeightsErrorTest, ScaleWithWrongShape) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor& w = Find(tensors, "model.layers.1.attn.wq_b.weight");
  w.dtype = "F8_E4M3";
  w.bytes.resize(w.bytes.size() / 4);
  tensors.push_back({"model.layers.1.attn.wq_b.scale", "F32", {2, 1}, testing::F32Bytes({1, 1})});
  EXPECT_THAT(LoadError(WriteModel("fp8_bad_scale", tensors)),
              HasSubstr("wrong shape [2, 1] for the scales of model.layers.1.attn.wq_b.weight "
                        "[128, 32], expected [1, 1]"));
}

TEST(WeightsErrorTest, SameTensorUnderTwoNames) {
  std::vector<StoredTensor> tensors = MixedTensors();
  StoredTensor head = Find(tensors, "head.weight");
  head.name = "lm_head.weight";
  tensors.push_back(head);
  EXPECT_THAT(LoadError(WriteModel("duplicate", tensors)),
              HasSubstr("duplicate tensor: head.weight / lm_head.weight"));
}

TEST(WeightsErrorTest, IndexNamesMissingShard) {
  const std::string dir = WriteModel("index_missing_shard", {});
  std::filesystem::remove(dir + "/model.safetensors");
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"head.weight": "model-00001-of-00002.safetensors"}})";
  auto w = LoadDir(dir);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(w.status().message(), HasSubstr(dir + "/model-00001-of-00002.safetensors"));
}

TEST(WeightsErrorTest, IndexListsTensorItsShardLacks) {
  const std::string dir = WriteModel("index_wrong_shard", MixedTensors());
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"head.weight": "model.safetensors", "extra.weight": "model.safetensors"}})";
  EXPECT_THAT(LoadError(dir), HasSubstr("tensor \"extra.weight\" is listed in " + dir +
                                        "/model.safetensors, which does not contain it"));
}

TEST(WeightsErrorTest, IndexShardOutsideTheModelDirectory) {
  const std::string dir = WriteModel("index_escape", {});
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"weight_map": {"head.weight": "../model.safetensors"}})";
  EXPECT_THAT(LoadError(dir), HasSubstr("names bad shard \"../model.safetensors\""));
}

TEST(WeightsErrorTest, UnknownModelType) {
  const std::string dir = WriteModel("model_type", {});
  std::ifstream in(FixtureDir(kMixed) + "/model/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["model_type"] = "llama";
  std::ofstream(dir + "/config.json", std::ios::trunc) << config.dump();
  EXPECT_THAT(LoadError(dir), HasSubstr(dir + "/config.json: key \"model_type\": unknown "
                                              "model_type \"llama\""));
}

}  // namespace
}  // namespace pdserve::engine
