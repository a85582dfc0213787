// RequestPreparer on the bundled model: the chat format's control tokens are suppressed in chat
// answers (docs/chat-format.md, "Control tokens in answers").
#include "frontend/request_preparer.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <variant>

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

TEST_F(RequestPreparerTest, CompletionsAreLeftAlone) {
  const PreparedRequest p =
      Prepare(Endpoint::kCompletions, R"({"model":"kjv-v4-tiny","prompt":"In the beginning"})");
  EXPECT_TRUE(p.params.logit_bias.empty());
}

}  // namespace
}  // namespace pdserve::frontend
