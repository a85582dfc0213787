#include "loadgen/dataset.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_split.h"

namespace pdserve::loadgen {
namespace {

std::vector<std::string> Words(const std::string& s) {
  return absl::StrSplit(s, ' ', absl::SkipEmpty());
}

TEST(SyntheticPromptsTest, SetLengthsAndSharedPrefixes) {
  SyntheticOptions o;
  o.num_prompts = 6;
  o.input_len = 20;
  o.output_len = 7;
  o.shared_prefix_len = 12;
  o.num_prefixes = 2;
  auto prompts = MakeSyntheticPrompts(o);
  ASSERT_TRUE(prompts.ok());
  ASSERT_EQ(prompts->size(), 6u);
  std::vector<std::vector<std::string>> w;
  for (const PromptItem& p : *prompts) {
    EXPECT_EQ(p.max_tokens, 7);
    w.push_back(Words(p.prompt));
    EXPECT_EQ(w.back().size(), 20u);
  }
  auto prefix = [](const std::vector<std::string>& v) {
    return std::vector<std::string>(v.begin(), v.begin() + 12);
  };
  EXPECT_EQ(prefix(w[0]), prefix(w[2]));  // group 0
  EXPECT_EQ(prefix(w[1]), prefix(w[5]));  // group 1
  EXPECT_NE(prefix(w[0]), prefix(w[1]));
  EXPECT_NE(w[0], w[2]);  // distinct suffixes
}

TEST(SyntheticPromptsTest, TokenIdsHaveExactLengthAndRange) {
  SyntheticOptions o;
  o.num_prompts = 3;
  o.input_len = 50;
  o.token_ids = true;
  o.token_id_min = 100;
  o.token_id_max = 110;
  auto prompts = MakeSyntheticPrompts(o);
  ASSERT_TRUE(prompts.ok());
  for (const PromptItem& p : *prompts) {
    ASSERT_EQ(p.token_ids.size(), 50u);
    for (int32_t id : p.token_ids) {
      EXPECT_GE(id, 100);
      EXPECT_LE(id, 110);
    }
  }
  const auto body = nlohmann::json::parse(RequestBody((*prompts)[0], {}));
  EXPECT_EQ(body["prompt"].size(), 50u);
  EXPECT_EQ(body["stream"], true);
  EXPECT_FALSE(body.contains("temperature"));  // the server's defaults apply
}

TEST(SyntheticPromptsTest, RejectsPrefixLongerThanInput) {
  SyntheticOptions o;
  o.input_len = 4;
  o.shared_prefix_len = 5;
  EXPECT_EQ(MakeSyntheticPrompts(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PromptFileTest, ReadsPromptsAndMessagesAndNamesTheBadLine) {
  const std::string path =
      (std::filesystem::temp_directory_path() / "pdserve_dataset_test.jsonl").string();
  {
    std::ofstream out(path);
    out << R"({"prompt": "a", "max_tokens": 5})"
        << "\n\n"
        << R"({"id": "c", "messages": [{"role": "user", "content": "hi"}], "expect": "x"})"
        << "\n";
  }
  auto items = LoadPromptFile(path);
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 2u);
  EXPECT_EQ((*items)[0].id, "line1");
  EXPECT_EQ((*items)[0].max_tokens, 5);
  EXPECT_EQ((*items)[1].id, "c");
  EXPECT_EQ((*items)[1].extra["expect"], "x");
  const auto chat = nlohmann::json::parse(RequestBody((*items)[1], {.api = Api::kChat}));
  EXPECT_EQ(chat["messages"][0]["content"], "hi");
  {
    std::ofstream out(path);
    out << R"({"prompt": "a"})"
        << "\n"
        << R"({"messages": "nope"})"
        << "\n";
  }
  auto bad = LoadPromptFile(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(path + ":2:"), std::string::npos) << bad.status();
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pdserve::loadgen
