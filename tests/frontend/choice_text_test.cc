// ChoiceText on the bundled model's token streams: chat answers built from DeepSeek's encoding
// (tools/text_chat_golden.py completions) come out as reasoning, content and tool calls equal to
// DeepSeek's own parse, the streamed deltas join to the whole answer, reasoning tokens are
// counted, and the EOS that ends a choice has no logprob.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "frontend/api_request.h"
#include "frontend/api_response.h"
#include "frontend/request_preparer.h"
#include "nlohmann/json.hpp"
#include "tests/frontend/golden_answers.h"

namespace pdserve::frontend {
namespace {

using nlohmann::json;

using testing::GoldenCompletions;
using testing::kEos;

class ChoiceTextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto preparer = RequestPreparer::Load(PDSERVE_BUNDLED_MODEL);
    ASSERT_TRUE(preparer.ok()) << preparer.status();
    preparer_ = std::move(*preparer);
  }

  ApiRequest Request(const std::string& body) {
    ParsedRequest parsed = ParseRequest(Endpoint::kChatCompletions, body);
    EXPECT_TRUE(std::holds_alternative<ApiRequest>(parsed)) << body;
    return std::get<ApiRequest>(parsed);
  }

  // A request with one tool, in thinking mode or not, asking for logprobs.
  ApiRequest ToolRequest(bool thinking) {
    return Request(
        absl::StrCat(R"({"model":"m","messages":[{"role":"user","content":"go"}],"logprobs":true,)",
                     R"("tools":[{"type":"function","function":{"name":"get_weather"}}],)",
                     R"("chat_template_kwargs":{"thinking":)", thinking ? "true" : "false", "}}"));
  }

  // The ids of `text` (control tokens included) then EOS.
  std::vector<int32_t> Ids(const std::string& text) { return testing::AnswerIds(*preparer_, text); }

  // Runs `ids` through one ChoiceText, the last with finish_reason "stop"; the deltas.
  static std::vector<ChoiceDelta> Run(const std::vector<int32_t>& ids, ChoiceText* text) {
    std::vector<ChoiceDelta> deltas;
    for (size_t i = 0; i < ids.size(); ++i) {
      deltas.push_back(text->Add({ids[i], -0.5f, {}}, i + 1 == ids.size() ? "stop" : ""));
    }
    return deltas;
  }

  std::unique_ptr<RequestPreparer> preparer_;
};

TEST_F(ChoiceTextTest, AnswersSplitLikeDeepSeekParser) {
  const json cases = GoldenCompletions();
  ASSERT_GE(cases.size(), 8u);
  for (const json& c : cases) {
    const ApiRequest req = ToolRequest(c["thinking"]);
    ChoiceText text(*preparer_, req, 0);
    ChoiceDelta whole;
    for (ChoiceDelta& d : Run(Ids(c["completion"]), &text)) AppendDelta(std::move(d), whole);
    EXPECT_EQ(whole.reasoning, c["reasoning_content"].get<std::string>()) << c.dump();
    EXPECT_EQ(whole.text, c["content"].get<std::string>()) << c.dump();
    ASSERT_EQ(whole.tool_calls.size(), c["tool_calls"].size()) << c.dump();
    for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
      const ToolCallDelta& call = whole.tool_calls[i];
      EXPECT_EQ(call.index, static_cast<int>(i));
      EXPECT_TRUE(call.id.starts_with("call_")) << call.id;
      EXPECT_EQ(call.id.size(), 29u);
      EXPECT_EQ(call.name, c["tool_calls"][i]["name"].get<std::string>());
      EXPECT_EQ(call.arguments, c["tool_calls"][i]["arguments"].get<std::string>());
    }
    EXPECT_EQ(*whole.finish_reason, c["tool_calls"].empty() ? "stop" : "tool_calls");
  }
}

TEST_F(ChoiceTextTest, ReasoningTokensCountTheTokensThroughThinkEnd) {
  const ApiRequest req = ToolRequest(/*thinking=*/true);
  ChoiceText text(*preparer_, req, 0);
  const std::vector<int32_t> ids = Ids("Let me think</think>Done.");
  Run(ids, &text);
  const std::vector<int32_t> reasoning = Ids("Let me think</think>");
  EXPECT_EQ(text.reasoning_tokens(), static_cast<int64_t>(reasoning.size()) - 1);  // - EOS
  EXPECT_EQ(text.tokens(), static_cast<int64_t>(ids.size()));
}

TEST_F(ChoiceTextTest, EosThatEndsTheChoiceHasNoLogprob) {
  const ApiRequest req =
      Request(R"({"model":"m","messages":[{"role":"user","content":"go"}],"logprobs":true})");
  ChoiceText text(*preparer_, req, 0);
  const std::vector<int32_t> ids = Ids("In the beginning God created");
  ChoiceDelta whole;
  for (ChoiceDelta& d : Run(ids, &text)) AppendDelta(std::move(d), whole);
  ASSERT_EQ(whole.logprobs.size(), ids.size() - 1);
  std::string joined;
  for (const TokenLogprob& lp : whole.logprobs) joined += lp.token;
  EXPECT_EQ(joined, whole.text);
  EXPECT_EQ(whole.text, "In the beginning God created");
}

TEST_F(ChoiceTextTest, ParallelToolCallsFalseKeepsTheFirstCall) {
  ApiRequest req = ToolRequest(/*thinking=*/false);
  req.parallel_tool_calls = false;
  const json cases = GoldenCompletions();
  for (const json& c : cases) {
    if (c["tool_calls"].size() < 2 || c["thinking"]) continue;
    ChoiceText text(*preparer_, req, 0);
    ChoiceDelta whole;
    for (ChoiceDelta& d : Run(Ids(c["completion"]), &text)) AppendDelta(std::move(d), whole);
    ASSERT_EQ(whole.tool_calls.size(), 1u);
    EXPECT_EQ(whole.tool_calls[0].name, c["tool_calls"][0]["name"].get<std::string>());
    return;
  }
  FAIL() << "no golden completion with two tool calls";
}

// breaker G3: a forced call that max_tokens cut inside its block's closing tag came back as a
// parsed tool call with finish_reason "length". An answer cut inside its block has no tool
// calls: its DSML is content and finish_reason "length" (OpenAI returns no parsed call for an
// incomplete one), streamed and not; the whole block is one call with "tool_calls".
TEST_F(ChoiceTextTest, AForcedCallCutInsideItsClosingTagIsTextWithFinishLength) {
  const ApiRequest streamed = [&] {
    ApiRequest req = Request(std::string(testing::kForcedCallRequest));
    req.stream = true;
    return req;
  }();
  ApiRequest whole_req = streamed;
  whole_req.stream = false;
  std::string cut_text;
  const std::vector<int32_t> cut = testing::CutInsideTheClosingTag(*preparer_, &cut_text);
  ASSERT_FALSE(cut.empty());
  ASSERT_NE(cut_text.find("</｜DSML｜invoke>\n</"), std::string::npos) << cut_text;
  ChoiceText text(*preparer_, streamed, 0);
  ChoiceDelta joined;
  bool first = true;
  for (size_t i = 0; i < cut.size(); ++i) {
    ChoiceDelta delta = text.Add({cut[i], -0.5f, {}}, i + 1 == cut.size() ? "length" : "");
    EXPECT_TRUE(delta.tool_calls.empty()) << "token " << i;
    // The SSE chunk a client reads: never a tool call.
    const json chunk =
        json::parse(StreamChunk(streamed, {"chatcmpl-1", 7, "m"}, delta, first).substr(6));
    EXPECT_FALSE(chunk["choices"][0]["delta"].contains("tool_calls")) << chunk.dump();
    first = false;
    AppendDelta(std::move(delta), joined);
  }
  EXPECT_TRUE(joined.tool_calls.empty());
  EXPECT_EQ(joined.text, cut_text);
  EXPECT_EQ(joined.finish_reason, "length");
  const json full = json::parse(FullResponse(whole_req, {"chatcmpl-1", 7, "m"}, {joined}, {}));
  EXPECT_FALSE(full["choices"][0]["message"].contains("tool_calls")) << full.dump();
  EXPECT_EQ(full["choices"][0]["message"]["content"], cut_text);
  EXPECT_EQ(full["choices"][0]["finish_reason"], "length");

  // The whole block, ended by EOS: one call, finish_reason "tool_calls".
  ChoiceText complete(*preparer_, whole_req, 0);
  ChoiceDelta all;
  for (ChoiceDelta& d : Run(Ids(std::string(testing::kForcedCallBlock)), &complete)) {
    AppendDelta(std::move(d), all);
  }
  ASSERT_EQ(all.tool_calls.size(), 1u);
  EXPECT_EQ(all.tool_calls[0].name, "get_weather");
  EXPECT_EQ(all.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
  EXPECT_EQ(all.text, "");
  EXPECT_EQ(*all.finish_reason, "tool_calls");
}

TEST_F(ChoiceTextTest, ToolChoiceNoneLeavesDsmlAsText) {
  ApiRequest req = ToolRequest(/*thinking=*/false);
  req.tool_choice = ToolChoice::kNone;
  for (const json& c : GoldenCompletions()) {
    if (c["tool_calls"].empty() || c["thinking"]) continue;
    ChoiceText text(*preparer_, req, 0);
    ChoiceDelta whole;
    for (ChoiceDelta& d : Run(Ids(c["completion"]), &text)) AppendDelta(std::move(d), whole);
    EXPECT_TRUE(whole.tool_calls.empty());
    std::string completion = c["completion"];
    completion.resize(completion.size() - kEos.size());
    EXPECT_EQ(whole.text, completion);
    EXPECT_EQ(*whole.finish_reason, "stop");
  }
}

}  // namespace
}  // namespace pdserve::frontend
