// Checks that the bundled model and the fixtures written by tools/train_small_model/train.py
// describe the same model: sizes, vocabulary, shapes and the recorded held-out perplexity. A model
// replaced without rerunning the fixture stage fails here before any engine test reads it.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "tests/small_model/small_model_fixtures.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using pdserve::small_model_testing::HeldOutIds;
using pdserve::small_model_testing::kFixturesDir;
using pdserve::small_model_testing::kModelDir;
using pdserve::small_model_testing::ReadBytes;
using pdserve::small_model_testing::ReadJson;

constexpr std::uintmax_t kMaxModelBytes = 32'000'000;

// The safetensors header: an 8-byte little-endian length, then that many bytes of JSON.
json SafetensorsHeader(const std::vector<char>& file) {
  std::uint64_t length = 0;
  std::memcpy(&length, file.data(), sizeof(length));
  return json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(length));
}

TEST(SmallModelFilesTest, SafetensorsFitsTheSizeBudget) {
  EXPECT_LE(fs::file_size(kModelDir / "model.safetensors"), kMaxModelBytes);
}

TEST(SmallModelFilesTest, SafetensorsTensorsLieInsideTheFileAndAreBf16OrInt64) {
  const std::vector<char> file = ReadBytes(kModelDir / "model.safetensors");
  const json header = SafetensorsHeader(file);
  std::uint64_t header_length = 0;
  std::memcpy(&header_length, file.data(), sizeof(header_length));
  const std::uint64_t data_bytes = file.size() - 8 - header_length;
  std::set<std::string> dtypes;
  for (const auto& [name, tensor] : header.items()) {
    if (name == "__metadata__") continue;
    dtypes.insert(tensor.at("dtype").get<std::string>());
    EXPECT_LE(tensor.at("data_offsets")[1].get<std::uint64_t>(), data_bytes) << name;
  }
  EXPECT_EQ(dtypes, (std::set<std::string>{"BF16", "I64"}));
}

TEST(SmallModelFilesTest, ConfigUsesEveryV4LayerAndMlpType) {
  const json config = ReadJson(kModelDir / "config.json");
  const auto layers = config.at("layer_types").get<std::set<std::string>>();
  const auto mlps = config.at("mlp_layer_types").get<std::set<std::string>>();
  EXPECT_EQ(layers, (std::set<std::string>{"sliding_attention", "compressed_sparse_attention",
                                           "heavily_compressed_attention"}));
  EXPECT_EQ(mlps, (std::set<std::string>{"hash_moe", "moe"}));
  EXPECT_GE(config.at("hc_mult").get<int>(), 2);
}

TEST(SmallModelFilesTest, TokenizerIdsAreDenseAndMatchConfigAndFixtures) {
  const json tokenizer = ReadJson(kModelDir / "tokenizer.json");
  std::set<std::size_t> ids;
  for (const auto& [piece, id] : tokenizer.at("model").at("vocab").items()) {
    ids.insert(id.get<std::size_t>());
  }
  for (const json& added : tokenizer.at("added_tokens"))
    ids.insert(added.at("id").get<std::size_t>());
  EXPECT_EQ(*ids.rbegin() + 1, ids.size());
  EXPECT_EQ(ids.size(), ReadJson(kModelDir / "config.json").at("vocab_size").get<std::size_t>());
  EXPECT_EQ(ids.size(), ReadJson(kFixturesDir / "logits.json").at("vocab_size").get<std::size_t>());
}

TEST(SmallModelFilesTest, TokenizerConfigNamesBosEosAndCarriesTheChatTemplate) {
  const json config = ReadJson(kModelDir / "tokenizer_config.json");
  const json tokenizer = ReadJson(kModelDir / "tokenizer.json");
  EXPECT_EQ(tokenizer.at("added_tokens")[0].at("content"), config.at("bos_token"));
  EXPECT_EQ(tokenizer.at("added_tokens")[1].at("content"), config.at("eos_token"));
  const std::string tmpl = config.at("chat_template").get<std::string>();
  EXPECT_NE(tmpl.find("<｜User｜>"), std::string::npos);
  EXPECT_NE(tmpl.find("<｜Assistant｜>"), std::string::npos);
}

TEST(SmallModelFilesTest, EveryLogitsFileHoldsOneRowPerPromptToken) {
  const json fixtures = ReadJson(kFixturesDir / "logits.json");
  const auto vocab = fixtures.at("vocab_size").get<std::uintmax_t>();
  ASSERT_EQ(fixtures.at("prompts").size(), 8u);
  for (const json& prompt : fixtures.at("prompts")) {
    const auto tokens = prompt.at("ids").size();
    EXPECT_EQ(fs::file_size(kFixturesDir / prompt.at("file").get<std::string>()),
              tokens * vocab * sizeof(float))
        << prompt.at("name");
    for (const json& id : prompt.at("ids")) EXPECT_LT(id.get<std::uintmax_t>(), vocab);
  }
}

TEST(SmallModelFilesTest, HeldOutSliceIdsAreTheTokensThePerplexityCovers) {
  const json record = ReadJson(kFixturesDir / "logits.json").at("perplexity");
  std::size_t tokens = 0;
  for (const json& chunk : record.at("chunks")) tokens += chunk.at("tokens").get<std::size_t>();
  EXPECT_EQ(HeldOutIds().size(), tokens);
}

TEST(SmallModelFilesTest, RecordedPerplexityIsTheExpOfTheMeanChunkLoss) {
  const json record = ReadJson(kFixturesDir / "logits.json").at("perplexity");
  double nll = 0;
  double predicted = 0;
  for (const json& chunk : record.at("chunks")) {
    nll += chunk.at("nll_sum").get<double>();
    predicted += chunk.at("predicted").get<double>();
  }
  EXPECT_NEAR(std::exp(nll / predicted), record.at("perplexity").get<double>(), 1e-9);
}

TEST(SmallModelFilesTest, TieReportCoversEveryFixturePromptInOrder) {
  const json prompts = ReadJson(kFixturesDir / "logits.json").at("prompts");
  const json report = ReadJson(kFixturesDir / "indexer_ties.json").at("prompts");
  ASSERT_EQ(report.size(), prompts.size());
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(report[i].at("name"), prompts[i].at("name"));
    EXPECT_EQ(report[i].at("tokens").get<std::size_t>(), prompts[i].at("ids").size());
    EXPECT_LE(report[i].at("first_tie_dependent_position").get<std::size_t>(),
              prompts[i].at("ids").size());
  }
}

}  // namespace
