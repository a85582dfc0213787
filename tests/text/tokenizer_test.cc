// Behaviours of Tokenizer beyond the golden cross-check: merge formats, special-token policy,
// post-processing, errors for unsupported components.
#include "text/tokenizer.h"

#include <algorithm>
#include <thread>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/text/test_util.h"
#include "text/regex.h"
#include "text/tokenizer_config.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

json FixtureJson() {
  auto text = ReadFile(FixtureDir() + "/tokenizer.json");
  EXPECT_TRUE(text.ok());
  return json::parse(*text);
}

std::unique_ptr<Tokenizer> Build(const json& spec, TokenizerConfig config = {}) {
  auto tokenizer = Tokenizer::FromJson(spec.dump(), std::move(config));
  EXPECT_TRUE(tokenizer.ok()) << tokenizer.status();
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

const char* const kSamples[] = {"Hello, world! It's 2026.", "  x = f(y)\n\treturn 42;",
                                "你好世界 こんにちは",
                                "naïve café 👨‍👩‍👧‍👦 e\u0301"};

TEST(TokenizerTest, StringFormMergesEncodeLikeArrayForm) {
  json spec = FixtureJson();
  ASSERT_TRUE(spec["model"]["merges"][0].is_array());
  for (json& merge : spec["model"]["merges"]) {
    merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  }
  auto string_form = Build(spec);
  ASSERT_NE(string_form, nullptr);
  for (const char* text : kSamples) {
    EXPECT_EQ(*string_form->Encode(text), *FixtureTokenizer().Encode(text)) << text;
  }
}

TEST(TokenizerTest, SpecialTokenTextIsPlainTextUnlessAllowed) {
  const Tokenizer& tok = FixtureTokenizer();
  const auto user = tok.TokenToId("<｜User｜>");
  ASSERT_TRUE(user.has_value());
  ASSERT_TRUE(tok.IsSpecial(*user));
  auto plain = tok.Encode("a<｜User｜>b", {.add_special_tokens = false, .allow_special = false});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(std::count(plain->begin(), plain->end(), *user), 0);
  EXPECT_EQ(*tok.Decode(*plain), "a<｜User｜>b");
  auto allowed = tok.Encode("a<｜User｜>b", {.add_special_tokens = false, .allow_special = true});
  ASSERT_TRUE(allowed.ok());
  EXPECT_EQ(std::count(allowed->begin(), allowed->end(), *user), 1);
  EXPECT_GT(plain->size(), allowed->size());
}

TEST(TokenizerTest, NonSpecialAddedTokensMatchInPlainText) {
  const Tokenizer& tok = FixtureTokenizer();
  const auto think = tok.TokenToId("<think>");
  ASSERT_TRUE(think.has_value());
  ASSERT_FALSE(tok.IsSpecial(*think));
  auto ids = tok.Encode("x<think>y", {.add_special_tokens = false, .allow_special = false});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(std::count(ids->begin(), ids->end(), *think), 1);
}

TEST(TokenizerTest, AddSpecialTokensPrependsBos) {
  const Tokenizer& tok = FixtureTokenizer();
  ASSERT_TRUE(tok.bos_id().has_value());
  auto with = tok.Encode("hi", {.add_special_tokens = true});
  auto without = tok.Encode("hi", {.add_special_tokens = false});
  ASSERT_TRUE(with.ok() && without.ok());
  ASSERT_EQ(with->size(), without->size() + 1);
  EXPECT_EQ(with->front(), *tok.bos_id());
  EXPECT_TRUE(std::equal(without->begin(), without->end(), with->begin() + 1));
}

TEST(TokenizerTest, NullPostProcessorTakesBosFromConfig) {
  json spec = FixtureJson();
  spec["post_processor"] = nullptr;
  TokenizerConfig config;
  config.bos_token = "<｜begin▁of▁sentence｜>";
  config.add_bos_token = true;
  auto tok = Build(spec, config);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(*tok->Encode("hi"), *FixtureTokenizer().Encode("hi"));
  auto bare = Build(spec);
  ASSERT_NE(bare, nullptr);
  EXPECT_EQ(*bare->Encode("hi"), *FixtureTokenizer().Encode("hi", {.add_special_tokens = false}));
}

TEST(TokenizerTest, SkipSpecialTokensDropsOnlySpecialTokens) {
  const Tokenizer& tok = FixtureTokenizer();
  auto ids = tok.Encode("<｜User｜>q<think>r", {.add_special_tokens = true, .allow_special = true});
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*tok.Decode(*ids, /*skip_special_tokens=*/true), "q<think>r");
  EXPECT_EQ(*tok.Decode(*ids, false), "<｜begin▁of▁sentence｜><｜User｜>q<think>r");
}

TEST(TokenizerTest, InvalidUtf8InputIsRejected) {
  auto ids = FixtureTokenizer().Encode(std::string("ab\xC3(", 4));
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerTest, UnknownIdIsOutOfRange) {
  const std::vector<int32_t> ids = {FixtureTokenizer().vocab_size()};
  EXPECT_EQ(FixtureTokenizer().Decode(ids).status().code(), absl::StatusCode::kOutOfRange);
}

TEST(TokenizerTest, UnsupportedNormalizerIsUnimplemented) {
  json spec = FixtureJson();
  spec["normalizer"] = {{"type", "NFKC"}};
  auto tok = Tokenizer::FromJson(spec.dump());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(tok.status().message().find("NFKC"), std::string::npos);
}

TEST(TokenizerTest, PreTokenizerWithoutByteLevelIsUnimplemented) {
  json spec = FixtureJson();
  spec["pre_tokenizer"]["pretokenizers"].erase(3);
  auto tok = Tokenizer::FromJson(spec.dump());
  EXPECT_EQ(tok.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(TokenizerTest, MalformedMergeIsInvalidArgument) {
  json spec = FixtureJson();
  spec["model"]["merges"][0] = "a b c";
  EXPECT_EQ(Tokenizer::FromJson(spec.dump()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerTest, ConcurrentEncodesAgreeWithSequentialOnes) {
  // Fresh tokenizer, so the threads race on filling the shared piece memo.
  auto tok = Build(FixtureJson());
  ASSERT_NE(tok, nullptr);
  std::vector<std::string> texts;
  for (int i = 0; i < 200; ++i) {
    texts.push_back(std::string(kSamples[i % 4]) + " #" + std::to_string(i * 7919));
  }
  std::vector<std::vector<std::vector<int32_t>>> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (const std::string& text : texts) results[t].push_back(*tok->Encode(text));
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> expected = *FixtureTokenizer().Encode(texts[i]);
    for (int t = 0; t < 4; ++t) ASSERT_EQ(results[t][i], expected) << texts[i];
  }
}

TEST(TokenizerTest, RemovedSplitDropsMatchesAndLiteralPatternsWork) {
  // A Split that removes literal spaces: each space-free word encodes as if on its own.
  json spec = FixtureJson();
  json removed = {{"type", "Split"},
                  {"pattern", {{"String", " "}}},
                  {"behavior", "Removed"},
                  {"invert", false}};
  spec["pre_tokenizer"]["pretokenizers"].insert(spec["pre_tokenizer"]["pretokenizers"].begin(),
                                                removed);
  auto tok = Build(spec);
  ASSERT_NE(tok, nullptr);
  std::vector<int32_t> expected;
  for (const char* word : {"alpha", "beta", "gamma"}) {
    auto ids = FixtureTokenizer().Encode(word, {.add_special_tokens = false});
    expected.insert(expected.end(), ids->begin(), ids->end());
  }
  EXPECT_EQ(*tok->Encode("alpha beta  gamma", {.add_special_tokens = false}), expected);
}

TEST(RegexTest, WhiteSpaceIncludesNextLineLikeOniguruma) {
  auto regex = Regex::Compile("\\s+(?!\\S)|\\s+");
  ASSERT_TRUE(regex.ok());
  std::vector<Regex::Match> matches;
  const std::string subject = "\xC2\x85\xC2\x85";  // two U+0085
  ASSERT_TRUE(regex->FindAll(subject, &matches).ok());
  ASSERT_EQ(matches.size(), 1u);
  EXPECT_EQ(matches[0].end - matches[0].begin, subject.size());
}

TEST(RegexTest, UnicodeEscapeIsTranslated) {
  auto regex = Regex::Compile("[\\u3040-\\u309F]+");
  ASSERT_TRUE(regex.ok()) << regex.status();
  std::vector<Regex::Match> matches;
  ASSERT_TRUE(regex->FindAll("aあいb", &matches).ok());
  ASSERT_EQ(matches.size(), 1u);
  EXPECT_EQ(matches[0].begin, 1u);
  EXPECT_EQ(matches[0].end, 7u);
}

TEST(RegexTest, BadPatternIsInvalidArgument) {
  EXPECT_EQ(Regex::Compile("(unclosed").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::text
