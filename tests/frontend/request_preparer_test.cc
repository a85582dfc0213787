// RequestPreparer on the bundled model: the chat format's control tokens are suppressed in chat
// answers (docs/chat-format.md, "Control tokens in answers"); a prompt over the 512-token
// context is blamed on the prompt, a max_tokens that does not fit on max_tokens; a tool schema
// that tool_choice "required" cannot enforce is a 400 on "tools".
#include "frontend/request_preparer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "frontend/api_request.h"
#include "text/tokenizer.h"

namespace pdserve::frontend {
namespace {

class RequestPreparerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto preparer = RequestPreparer::Load(PDSERVE_BUNDLED_MODEL);
    ASSERT_TRUE(preparer.ok()) << preparer.status();
    preparer_ = std::move(*preparer);
    auto tokenizer = text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL);
    ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
    tokenizer_ = std::move(*tokenizer);
  }

  PreparedRequest Prepare(Endpoint endpoint, const std::string& body) {
    ParsedRequest parsed = ParseRequest(endpoint, body);
    EXPECT_TRUE(std::holds_alternative<ApiRequest>(parsed)) << body;
    Prepared prepared = preparer_->Prepare(std::get<ApiRequest>(parsed));
    EXPECT_TRUE(std::holds_alternative<PreparedRequest>(prepared)) << body;
    return std::get<PreparedRequest>(prepared);
  }

  // The 400 for `body`, and the prompt's length in tokens.
  std::pair<ApiError, int64_t> Reject(Endpoint endpoint, const std::string& body) {
    ParsedRequest parsed = ParseRequest(endpoint, body);
    EXPECT_TRUE(std::holds_alternative<ApiRequest>(parsed)) << body;
    const ApiRequest& req = std::get<ApiRequest>(parsed);
    Prepared prepared = preparer_->Prepare(req);
    EXPECT_TRUE(std::holds_alternative<ApiError>(prepared)) << body;
    auto tokens = preparer_->PromptTokens(req);
    EXPECT_TRUE(tokens.ok()) << tokens.status();
    return {std::get<ApiError>(prepared), static_cast<int64_t>(tokens->size())};
  }

  // A text of `words` copies of " And".
  static std::string Words(int words) {
    std::string text = "And";
    for (int i = 1; i < words; ++i) text += " And";
    return text;
  }

  int32_t Id(const std::string& token) { return tokenizer_->TokenToId(token).value_or(-1); }

  std::unique_ptr<RequestPreparer> preparer_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
};

TEST_F(RequestPreparerTest, ChatAnswerCannotSampleControlTokens) {
  const PreparedRequest p =
      Prepare(Endpoint::kChatCompletions,
              R"({"model":"kjv-v4-tiny","messages":[{"role":"user","content":"Hi"}]})");
  for (const char* token :
       {"<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"}) {
    const int32_t id = Id(token);
    ASSERT_GE(id, 0) << token;
    ASSERT_TRUE(p.params.logit_bias.contains(id)) << token;
    EXPECT_EQ(p.params.logit_bias.at(id), -100.0) << token;
  }
  EXPECT_EQ(p.params.logit_bias.size(), 5u);
  EXPECT_FALSE(p.params.logit_bias.contains(Id("<｜end▁of▁sentence｜>")));
}

TEST_F(RequestPreparerTest, ThinkingModeMayCloseItsReasoning) {
  const PreparedRequest p =
      Prepare(Endpoint::kChatCompletions,
              R"({"model":"kjv-v4-tiny","chat_template_kwargs":{"thinking":true},)"
              R"("messages":[{"role":"user","content":"Hi"}]})");
  EXPECT_FALSE(p.params.logit_bias.contains(Id("</think>")));
  EXPECT_TRUE(p.params.logit_bias.contains(Id("<think>")));
}

TEST_F(RequestPreparerTest, RequestBiasOnAControlTokenWins) {
  const std::string body = R"({"model":"kjv-v4-tiny","logit_bias":{")" +
                           std::to_string(Id("</think>")) +
                           R"(":5},"messages":[{"role":"user","content":"Hi"}]})";
  const PreparedRequest p = Prepare(Endpoint::kChatCompletions, body);
  EXPECT_EQ(p.params.logit_bias.at(Id("</think>")), 5.0);
}

TEST_F(RequestPreparerTest, MinTokensThatNoTokenCanMeetIs400) {
  std::string all = "0";
  for (int i = 1; i < 4096; ++i) all += "," + std::to_string(i);
  const std::string body =
      R"({"model": "kjv-v4-tiny", "prompt": "And", "max_tokens": 3, "min_tokens": 3,
                               "stop_token_ids": [)" +
      all + "]}";
  auto [error, length] = Reject(Endpoint::kCompletions, body);
  EXPECT_EQ(error.http_status, 400);
  EXPECT_EQ(error.param, "min_tokens");
  EXPECT_NE(error.message.find("cover all 4096 tokens"), std::string::npos) << error.message;
  // Without min_tokens the same stop ids only end the choice at its first token.
  Prepare(Endpoint::kCompletions, R"({"model": "kjv-v4-tiny", "prompt": "And", "max_tokens": 3,
                                      "stop_token_ids": [)" +
                                      all + "]}");
}

// The sampling checks past the JSON schema name their parameter too, as OpenAI's errors do
// (param was null: a client could not tell which field to fix).
TEST_F(RequestPreparerTest, SamplingErrorsNameTheirParameter) {
  const std::pair<const char*, const char*> cases[] = {
      {R"("logit_bias": {"4096": 1})", "logit_bias"},
      {R"("stop_token_ids": [4096])", "stop_token_ids"},
      {R"("max_tokens": 3, "min_tokens": 4)", "min_tokens"},
      {R"("top_p": 1e-40)", "top_p"},
      {R"("logit_bias": {"7": 1e-40})", "logit_bias"},
  };
  for (const auto& [fields, param] : cases) {
    const std::string body =
        absl::StrCat(R"({"model": "kjv-v4-tiny", "prompt": "And", )", fields, "}");
    auto [error, length] = Reject(Endpoint::kCompletions, body);
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, param) << body << ": " << error.message;
  }
}

TEST_F(RequestPreparerTest, CompletionsAreLeftAlone) {
  const PreparedRequest p =
      Prepare(Endpoint::kCompletions, R"({"model":"kjv-v4-tiny","prompt":"In the beginning"})");
  EXPECT_TRUE(p.params.logit_bias.empty());
}

TEST_F(RequestPreparerTest, ServedNameIsTheDirectoryNameEvenWithATrailingSlash) {
  EXPECT_EQ(preparer_->model_names(),
            (std::vector<std::string>{"kjv-v4-tiny", PDSERVE_BUNDLED_MODEL}));
  auto slash = RequestPreparer::Load(std::string(PDSERVE_BUNDLED_MODEL) + "/");
  ASSERT_TRUE(slash.ok()) << slash.status();
  EXPECT_EQ((*slash)->model_names().front(), "kjv-v4-tiny");
}

TEST_F(RequestPreparerTest, ChatOverTheContextNamesTheMessages) {
  const auto [error, length] = Reject(
      Endpoint::kChatCompletions,
      R"({"model":"kjv-v4-tiny","messages":[{"role":"user","content":")" + Words(600) + R"("}]})");
  ASSERT_GT(length, 512);
  EXPECT_EQ(error.http_status, 400);
  EXPECT_EQ(error.code, "context_length_exceeded");
  EXPECT_EQ(error.param, "messages");
  EXPECT_EQ(error.message,
            "This model's maximum context length is 512 tokens. However, your "
            "messages resulted in " +
                std::to_string(length) + " tokens. Please reduce the length of the messages.");
}

TEST_F(RequestPreparerTest, ChatFillingTheContextLeavesNoRoom) {
  // Find a message that renders to exactly 512 tokens.
  for (int words = 400; words < 600; ++words) {
    ParsedRequest parsed =
        ParseRequest(Endpoint::kChatCompletions,
                     R"({"model":"kjv-v4-tiny","messages":[{"role":"user","content":")" +
                         Words(words) + R"("}]})");
    const ApiRequest& req = std::get<ApiRequest>(parsed);
    auto tokens = preparer_->PromptTokens(req);
    ASSERT_TRUE(tokens.ok());
    if (tokens->size() < 512) continue;
    if (tokens->size() > 512) GTEST_SKIP() << "no message of exactly 512 tokens";
    Prepared prepared = preparer_->Prepare(req);
    ASSERT_TRUE(std::holds_alternative<ApiError>(prepared));
    const ApiError& error = std::get<ApiError>(prepared);
    EXPECT_EQ(error.param, "messages");
    EXPECT_EQ(error.message,
              "This model's maximum context length is 512 tokens. However, your messages "
              "resulted in 512 tokens, which leaves no room for the completion. Please reduce "
              "the length of the messages.");
    return;
  }
  FAIL() << "no message reached 512 tokens";
}

TEST_F(RequestPreparerTest, CompletionOverTheContextNamesThePrompt) {
  const auto [error, length] =
      Reject(Endpoint::kCompletions,
             R"({"model":"kjv-v4-tiny","max_tokens":5,"prompt":")" + Words(600) + R"("})");
  ASSERT_GT(length, 512);
  EXPECT_EQ(error.param, "prompt");
  EXPECT_EQ(error.code, "context_length_exceeded");
  EXPECT_EQ(error.message,
            "This model's maximum context length is 512 tokens. However, your "
            "prompt resulted in " +
                std::to_string(length) + " tokens. Please reduce the length of the prompt.");
}

// A text whose byte length alone shows it cannot fit (at least bytes / (2 * the longest token's
// bytes) tokens, that many >= the context) is refused before it is tokenized, saying so; one
// byte shorter than that bound it is tokenized and refused with its exact length.
TEST_F(RequestPreparerTest, PromptsSurelyTooLongAreRefusedBeforeTokenizing) {
  int64_t longest = 1;
  std::string bytes;
  for (int32_t id = 0; id < tokenizer_->vocab_size(); ++id) {
    bytes.clear();
    ASSERT_TRUE(tokenizer_->AppendTokenBytes(id, false, &bytes).ok());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(bytes.size()));
  }
  ASSERT_GT(longest, 1);
  const int64_t bound = 2 * longest * 512;  // the first length refused from its bytes
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    const bool chat = endpoint == Endpoint::kChatCompletions;
    auto body = [&](int64_t n) {
      std::string text = Words(static_cast<int>(n / 4 + 1)).substr(0, static_cast<size_t>(n));
      return chat ? R"({"model":"kjv-v4-tiny","messages":[{"role":"user","content":")" + text +
                        R"("}]})"
                  : R"({"model":"kjv-v4-tiny","prompt":")" + text + R"("})";
    };
    for (int64_t n : {bound, int64_t{3} << 20}) {
      ParsedRequest parsed = ParseRequest(endpoint, body(n));
      Prepared prepared = preparer_->Prepare(std::get<ApiRequest>(parsed));
      ASSERT_TRUE(std::holds_alternative<ApiError>(prepared));
      const ApiError& error = std::get<ApiError>(prepared);
      EXPECT_EQ(error.code, "context_length_exceeded");
      EXPECT_EQ(error.param, chat ? "messages" : "prompt");
      const char* what = chat ? "messages" : "prompt";
      EXPECT_EQ(
          error.message,
          absl::StrCat("This model's maximum context length is 512 tokens. However, your ", what,
                       " (", n, " bytes) ", chat ? "have" : "has", " at least ", n / (2 * longest),
                       " tokens. Please reduce the length of the ", what, "."));
    }
    const auto [error, length] = Reject(endpoint, body(bound - 1));
    EXPECT_NE(error.message.find("resulted in " + std::to_string(length) + " tokens"),
              std::string::npos)
        << error.message;
  }
}

TEST_F(RequestPreparerTest, MaxTokensOverTheContextNamesMaxTokens) {
  const auto [error, length] =
      Reject(Endpoint::kChatCompletions,
             R"({"model":"kjv-v4-tiny","max_tokens":510,"messages":[{"role":"user","content":")" +
                 Words(20) + R"("}]})");
  ASSERT_LT(length, 512);
  EXPECT_EQ(error.param, "max_tokens");
  EXPECT_EQ(error.code, "context_length_exceeded");
  EXPECT_EQ(error.message,
            "This model's maximum context length is 512 tokens. However, you requested " +
                std::to_string(length + 510) + " tokens (" + std::to_string(length) +
                " in the messages, 510 for the completion). Please reduce the length of the "
                "messages, or max_tokens to at most " +
                std::to_string(512 - length) + ".");
}

TEST_F(RequestPreparerTest, ChatWithoutMaxTokensGetsTheRoomLeft) {
  const std::string body =
      R"({"model":"kjv-v4-tiny","messages":[{"role":"user","content":")" + Words(20) + R"("}]})";
  const PreparedRequest p = Prepare(Endpoint::kChatCompletions, body);
  EXPECT_EQ(p.params.max_tokens, 512 - static_cast<int64_t>(p.prompt.size()));
}

TEST_F(RequestPreparerTest, ToolSchemaTheGrammarCannotEnforceIs400OnToolsOnlyWhenForced) {
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",)"
      R"("properties":{"n":{"type":"integer","minimum":1}}}}}])";
  for (const char* choice : {R"("required")", R"({"type":"function","function":{"name":"f"}})"}) {
    const std::string body =
        absl::StrCat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)", tools,
                     R"(,"tool_choice":)", choice, "}");
    const ApiError error = Reject(Endpoint::kChatCompletions, body).first;
    EXPECT_EQ(error.param, "tools") << choice;
    EXPECT_NE(error.message.find("keyword 'minimum' is not supported (at #/properties/n)"),
              std::string::npos)
        << error.message;
  }
  // "auto" is not constrained: the same tools are refused only for the bundled model's context.
  const ApiError error =
      Reject(Endpoint::kChatCompletions,
             absl::StrCat(R"({"model":"m","messages":[{"role":"user","content":"x"}],)", tools,
                          R"(,"tool_choice":"auto"})"))
          .first;
  EXPECT_EQ(error.code, "context_length_exceeded");
}

// Logprob carries a token's raw bytes: the bundled tokenizer's byte-level pieces include lone
// UTF-8 lead bytes, whose text decodes to U+FFFD while their bytes stay the byte itself.
TEST_F(RequestPreparerTest, LogprobBytesOfAPartialUtf8TokenAreItsOwnByte) {
  std::optional<int32_t> partial;
  for (int32_t id = 0; id < 4096 && !partial; ++id) {
    std::string bytes;
    if (!tokenizer_->AppendTokenBytes(id, false, &bytes).ok()) continue;
    if (bytes.size() == 1 && static_cast<unsigned char>(bytes[0]) >= 0xC2) partial = id;
  }
  ASSERT_TRUE(partial.has_value()) << "no lone UTF-8 lead byte among the first 4096 ids";
  std::string expected;
  ASSERT_TRUE(tokenizer_->AppendTokenBytes(*partial, false, &expected).ok());
  const TokenLogprob lp = preparer_->Logprob({*partial, -1.0f, {{*partial, -1.0f}, {65, -2.0f}}});
  EXPECT_EQ(lp.token, "\xEF\xBF\xBD");
  EXPECT_EQ(lp.bytes, expected);
  ASSERT_EQ(lp.top_bytes.size(), 2u);
  EXPECT_EQ(lp.top_bytes[0], expected);
  std::string other;
  ASSERT_TRUE(tokenizer_->AppendTokenBytes(65, false, &other).ok());
  EXPECT_EQ(lp.top_bytes[1], other);
  EXPECT_EQ(lp.top[1].first, other);  // valid UTF-8: text and bytes agree
}

}  // namespace
}  // namespace pdserve::frontend
