// The conversation as a whole (frontend/chat_history.h) and continuing the last assistant message
// (continue_final_message / DeepSeek's "prefix"), found by breaker53 (F5, F6, F7.5, F7.8, F7.9):
// these requests were answered 200 with text generated after an EOS, or with tool results that
// answered no call, or content "" in an SDK's accumulated tool-call message.
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

ParsedRequest Parse(const std::string& messages, const std::string& extra = "") {
  return ParseRequest(Endpoint::kChatCompletions,
                      absl::StrCat(R"({"model":"m","messages":)", messages, extra, "}"));
}

ApiError Err(const std::string& messages, const std::string& extra = "") {
  ParsedRequest p = Parse(messages, extra);
  if (auto* e = std::get_if<ApiError>(&p)) return *e;
  ADD_FAILURE() << "accepted: " << messages << extra;
  return {};
}

ApiRequest Ok(const std::string& messages, const std::string& extra = "") {
  ParsedRequest p = Parse(messages, extra);
  if (auto* e = std::get_if<ApiError>(&p)) {
    ADD_FAILURE() << e->message;
    return {};
  }
  return std::get<ApiRequest>(p);
}

constexpr const char* kCalls =
    R"({"role":"assistant","content":null,"tool_calls":[)"
    R"({"id":"a","type":"function","function":{"name":"f","arguments":"{}"}},)"
    R"({"id":"b","type":"function","function":{"name":"f","arguments":"{}"}}]})";

TEST(ChatHistoryTest, ToolResultsMustAnswerACallOfTheAssistantMessageBeforeThem) {
  ApiError e = Err(R"([{"role":"user","content":"x"},{"role":"tool","content":"42",
                       "tool_call_id":"nope"}])");
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages");
  EXPECT_EQ(e.message,
            "messages[1]: a tool message must answer a tool call of an earlier assistant "
            "message, and no assistant message comes before it");
  EXPECT_EQ(Err(R"([{"role":"tool","content":"42","tool_call_id":"a"}])").message,
            "messages[0]: a tool message must answer a tool call of an earlier assistant "
            "message, and no assistant message comes before it");
  EXPECT_EQ(Err(absl::StrCat(R"([{"role":"user","content":"x"},)", kCalls,
                             R"(,{"role":"tool","content":"1","tool_call_id":"c"}])"))
                .message,
            "messages[2]: tool_call_id 'c' is not among the tool_calls of the assistant message "
            "before it (messages[1])");
  EXPECT_EQ(Err(absl::StrCat(R"([{"role":"user","content":"x"},)", kCalls,
                             R"(,{"role":"tool","content":"1"}])"))
                .message,
            "messages[2]: a tool message needs 'tool_call_id', the id of the call it answers");
}

// Parallel calls answered in any order, a user message between, a second round: all valid.
TEST(ChatHistoryTest, ValidToolConversationsAreAccepted) {
  const ApiRequest r =
      Ok(absl::StrCat(R"([{"role":"user","content":"x"},)", kCalls,
                      R"(,{"role":"tool","content":"2","tool_call_id":"b"},)"
                      R"({"role":"user","content":"also"},)"
                      R"({"role":"tool","content":"1","tool_call_id":"a"},)"
                      R"({"role":"assistant","content":"","tool_calls":[)"
                      R"({"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},)"
                      R"({"role":"tool","content":"3","tool_call_id":"c"}])"));
  EXPECT_EQ(r.messages.size(), 7u);
  EXPECT_FALSE(r.continue_final_message);
}

// A call never answered is a 400, as OpenAI's and DeepSeek's APIs answer ("An assistant message
// with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'"): the
// chat format renders results in call order without ids, so the model would read the next
// result as the missing one's. It was accepted and rendered.
TEST(ChatHistoryTest, ToolCallsWithoutAResultAre400) {
  const std::string user = R"([{"role":"user","content":"x"},)";
  const ApiError never = Err(user + kCalls + R"(,{"role":"user","content":"never mind"}])");
  EXPECT_EQ(never.http_status, 400);
  EXPECT_EQ(never.param, "messages");
  EXPECT_EQ(never.message,
            "messages[1]: tool call 'a' has no tool message answering it after it; every tool "
            "call needs a tool message with its 'tool_call_id' before the next assistant "
            "message or the end of the conversation");
  EXPECT_EQ(Err(user + kCalls + R"(,{"role":"tool","content":"1","tool_call_id":"a"}])").message,
            "messages[1]: tool call 'b' has no tool message answering it after it; every tool "
            "call needs a tool message with its 'tool_call_id' before the next assistant "
            "message or the end of the conversation");
  // Answered after the next assistant message is too late: that result answers no call of it.
  EXPECT_EQ(Err(user + kCalls +
                R"(,{"role":"tool","content":"1","tool_call_id":"a"},)"
                R"({"role":"assistant","content":"ok"},{"role":"user","content":"y"}])")
                .message,
            "messages[1]: tool call 'b' has no tool message answering it before messages[3]; "
            "every tool call needs a tool message with its 'tool_call_id' before the next "
            "assistant message or the end of the conversation");
  EXPECT_EQ(Err(user + R"({"role":"assistant","tool_calls":[{"type":"function",)"
                       R"("function":{"name":"f","arguments":"{}"}}]},)"
                       R"({"role":"user","content":"y"}])")
                .message,
            "messages[1]: tool_calls[0] (it has no 'id') has no tool message answering it after "
            "it; every tool call needs a tool message with its 'tool_call_id' before the next "
            "assistant message or the end of the conversation");
}

// A 400 on 'messages' that says `message`.
void Expect400(const ApiError& e, const std::string& message) {
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.param, "messages");
  EXPECT_EQ(e.message, message);
}

// Each call takes exactly one result: two calls of one id shared one result and one call took
// two, and the format, which shows the results by position, had the model read a result as
// another call's (breaker54). Both were accepted and rendered.
TEST(ChatHistoryTest, RepeatedCallIdsAndCallsAnsweredTwiceAre400) {
  const std::string user = R"([{"role":"user","content":"x"},)";
  const std::string call_a =
      R"({"id":"a","type":"function","function":{"name":"f","arguments":"{}"}})";
  const std::string result_a = R"({"role":"tool","content":"1","tool_call_id":"a"})";
  const std::string calls_a_a =
      R"({"role":"assistant","content":null,"tool_calls":[)" + call_a + "," + call_a + "]}";
  Expect400(Err(user + calls_a_a + "," + result_a + "]"),
            "messages[1]: tool_calls[1] has the id 'a' of tool_calls[0]; each call needs an id "
            "of its own, which its tool message answers");
  Expect400(Err(user + kCalls + "," + result_a + R"(,{"role":"user","content":"y"},)" + result_a +
                R"(,{"role":"tool","content":"2","tool_call_id":"b"}])"),
            "messages[4]: tool call 'a' of messages[1] is already answered by messages[2]; each "
            "call takes one tool message (the format shows the model one result per call, by "
            "position)");
  // The same id in two assistant messages is two calls, each answered once.
  const std::string call_a_alone = R"({"role":"assistant","tool_calls":[)" + call_a + "]}";
  Ok(user + call_a_alone + "," + result_a + "," + call_a_alone + "," + result_a + "]");
}

// 30,000 calls and their results (a request of about 4 MiB) are all matched. The checks look ids
// up in hash maps: comparing each result with each call took the front 5.7 s of CPU per such
// request (0.16 s now; breaker54, measured, not asserted here: speed lives in benchmarks).
TEST(ChatHistoryTest, ManyCallsAreAllMatched) {
  std::string calls = R"([{"role":"user","content":"x"},{"role":"assistant","tool_calls":[)";
  std::string results;
  constexpr int kManyCalls = 30000;
  for (int i = 0; i < kManyCalls; ++i) {
    absl::StrAppend(&calls, i == 0 ? "" : ",", R"({"id":"c)", i,
                    R"(","type":"function","function":{"name":"f","arguments":"{}"}})");
    absl::StrAppend(&results, R"(,{"role":"tool","content":"","tool_call_id":"c)", i, R"("})");
  }
  const ApiRequest r = Ok(calls + "]}" + results + "]");
  EXPECT_EQ(r.messages.size(), kManyCalls + 2u);
}

TEST(ChatHistoryTest, EmptyAssistantMessagesAndEmptyPartArraysAre400) {
  EXPECT_EQ(Err(R"([{"role":"user","content":"x"},{"role":"assistant","content":null},)"
                R"({"role":"user","content":"y"}])")
                .message,
            "messages[1]: an assistant message needs 'content' or 'tool_calls'");
  EXPECT_EQ(Err(R"([{"role":"user","content":[]}])").message,
            "messages[0].content must not be an empty array");
  // "" is content (OpenAI accepts it), and so is reasoning alone.
  Ok(R"([{"role":"user","content":"x"},{"role":"assistant","content":""},)"
     R"({"role":"assistant","reasoning_content":"r"},{"role":"user","content":"y"}])");
}

TEST(ChatHistoryTest, ImageAndAudioPartsSayTheModelAcceptsTextOnly) {
  EXPECT_EQ(Err(R"([{"role":"user","content":[{"type":"text","text":"see"},)"
                R"({"type":"image_url","image_url":{"url":"http://x/a.png"}}]}])")
                .message,
            "messages[0].content[1] is a 'image_url' part: this model accepts text only (parts "
            "of type \"text\")");
  EXPECT_EQ(Err(R"([{"role":"user","content":[{"type":"input_audio","input_audio":{}}]}])").message,
            "messages[0].content[0] is a 'input_audio' part: this model accepts text only (parts "
            "of type \"text\")");
  EXPECT_EQ(Err(R"([{"role":"user","content":[{"text":"x"}]}])").message,
            "messages[0].content[0] must be {\"type\": \"text\", \"text\": ...}");
}

TEST(ChatHistoryTest, ALastAssistantMessageNeedsContinueFinalMessage) {
  const std::string ends =
      R"([{"role":"user","content":"hi"},{"role":"assistant","content":"And God"}])";
  const ApiError e = Err(ends);
  EXPECT_EQ(e.param, "messages");
  EXPECT_EQ(e.message,
            "messages[1]: the conversation ends with an assistant message, and the chat format "
            "opens a new assistant turn only after a user or tool message. To continue that "
            "message, set 'continue_final_message': true (or \"prefix\": true on it); for a new "
            "answer, end with a user message");
  EXPECT_TRUE(Ok(ends, R"(,"continue_final_message":true,"add_generation_prompt":false)")
                  .continue_final_message);
  EXPECT_TRUE(Ok(R"([{"role":"user","content":"hi"},)"
                 R"({"role":"assistant","content":"And God","prefix":true}])")
                  .continue_final_message);
}

TEST(ChatHistoryTest, ContinuationsThatCannotBeAre400) {
  const std::string user = R"([{"role":"user","content":"hi"}])";
  EXPECT_EQ(Err(user, R"(,"continue_final_message":true)").message,
            "'continue_final_message' needs the last message to be an assistant message (the "
            "answer continues it); messages[0] is a 'user' message");
  EXPECT_EQ(Err(R"([{"role":"user","content":"hi"},{"role":"assistant","content":"a",)"
                R"("prefix":true},{"role":"user","content":"x"}])")
                .message,
            "messages[1]: \"prefix\": true is for the last message only, an assistant message "
            "(the answer continues it)");
  EXPECT_EQ(Err(R"([{"role":"system","content":"s"},{"role":"assistant","content":"a"}])",
                R"(,"continue_final_message":true)")
                .message,
            "messages[1]: only an assistant message right after a user or tool message can be "
            "continued (the chat format opens an assistant turn only there)");
  EXPECT_EQ(Err(absl::StrCat(R"([{"role":"user","content":"x"},)", kCalls, "]"),
                R"(,"continue_final_message":true)")
                .message,
            "messages[1]: an assistant message with tool_calls cannot be continued");
  const std::string ends = R"([{"role":"user","content":"hi"},{"role":"assistant","content":"{"}])";
  EXPECT_EQ(
      Err(ends, R"(,"continue_final_message":true,"response_format":{"type":"json_object"})").param,
      "continue_final_message");
  EXPECT_EQ(Err(ends, R"(,"continue_final_message":true,"add_generation_prompt":true)").param,
            "add_generation_prompt");
  EXPECT_EQ(Err(user, R"(,"add_generation_prompt":false)").param, "add_generation_prompt");
}

class ContinuationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto preparer = RequestPreparer::Load(PDSERVE_BUNDLED_MODEL);
    ASSERT_TRUE(preparer.ok()) << preparer.status();
    preparer_ = std::move(*preparer);
  }
  std::string PromptText(const ApiRequest& req) {
    absl::StatusOr<std::vector<int32_t>> ids = preparer_->PromptTokens(req);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return preparer_->tokenizer().Decode(*ids, /*skip_special_tokens=*/false).value_or("");
  }
  std::unique_ptr<RequestPreparer> preparer_;
};

// A conversation that ends with a system message gets the generation prompt (it ended inside
// the system text before, and the model continued the instructions).
TEST_F(ContinuationTest, ALastSystemMessageIsFollowedByTheGenerationPrompt) {
  EXPECT_EQ(PromptText(Ok(R"([{"role":"user","content":"hi"},)"
                          R"({"role":"system","content":"Be brief."}])")),
            "<｜begin▁of▁sentence｜><｜User｜>hiBe brief.<｜Assistant｜></think>");
  EXPECT_EQ(PromptText(Ok(R"([{"role":"developer","content":"Be brief."}])",
                          R"(,"chat_template_kwargs":{"thinking":true})")),
            "<｜begin▁of▁sentence｜>Be brief.<｜Assistant｜><think>");
}

// The continued turn is the module's rendering of it without EOS (docs/chat-format.md).
TEST_F(ContinuationTest, TheContinuedTurnIsLeftOpen) {
  const std::string user = R"([{"role":"user","content":"hi"},)";
  EXPECT_EQ(PromptText(Ok(user + R"({"role":"assistant","content":"And God","prefix":true}])")),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>And God");
  const std::string thinking = R"(,"chat_template_kwargs":{"thinking":true})";
  EXPECT_EQ(PromptText(Ok(user + R"({"role":"assistant","content":"And","reasoning_content":"r",)"
                                 R"("prefix":true}])",
                          thinking)),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>r</think>And");
  // No content: the answer continues the reasoning.
  EXPECT_EQ(PromptText(Ok(user + R"({"role":"assistant","content":"","reasoning_content":"Let",)"
                                 R"("prefix":true}])",
                          thinking)),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>Let");
}

// Continuing the content in thinking mode: the answer is content from its first token (not
// reasoning), and </think> cannot be sampled; continuing the reasoning: reasoning first.
TEST_F(ContinuationTest, TheAnswerStartsWhereTheContinuedTurnStopped) {
  const std::string user = R"([{"role":"user","content":"hi"},)";
  const std::string thinking = R"(,"chat_template_kwargs":{"thinking":true})";
  const ApiRequest content =
      Ok(user + R"({"role":"assistant","content":"And","reasoning_content":"r","prefix":true}])",
         thinking);
  const ApiRequest reasoning =
      Ok(user + R"({"role":"assistant","content":"","reasoning_content":"r","prefix":true}])",
         thinking);
  const int32_t think_end = *preparer_->tokenizer().TokenToId("</think>");
  const std::vector<int32_t> ids = testing::AnswerIds(*preparer_, " God</think> said");
  for (const auto* req : {&content, &reasoning}) {
    const auto prepared = std::get<PreparedRequest>(preparer_->Prepare(*req));
    const bool biased = prepared.params.logit_bias.count(think_end) > 0;
    EXPECT_EQ(biased, req == &content);
    ChoiceText text(*preparer_, *req, 0);
    ChoiceDelta whole;
    for (size_t i = 0; i < ids.size(); ++i) {
      AppendDelta(text.Add({ids[i], 0, {}}, i + 1 == ids.size() ? "stop" : ""), whole);
    }
    if (req == &content) {
      EXPECT_EQ(whole.reasoning, "");
      EXPECT_EQ(whole.text, " God</think> said");
    } else {
      EXPECT_EQ(whole.reasoning, " God");
      EXPECT_EQ(whole.text, " said");
    }
  }
}

// A tool-call answer cut by max_tokens inside the 3-byte '｜' ended with U+FFFD (F7.9); an
// answer the model ended with EOS keeps Decode's text.
TEST_F(ContinuationTest, AnAnswerCutInsideACharacterDropsThatCharacter) {
  const ApiRequest req = Ok(R"([{"role":"user","content":"go"}],)"
                            R"("tools":[{"type":"function","function":{"name":"f"}}])");
  std::vector<int32_t> ids = testing::AnswerIds(*preparer_, "ok\n\n<｜DSML｜tool_calls>");
  ids.pop_back();  // EOS
  std::string bytes;
  size_t cut = 0;  // ids up to the one that ends inside '｜'
  for (; cut < ids.size(); ++cut) {
    ASSERT_TRUE(preparer_->tokenizer().AppendTokenBytes(ids[cut], false, &bytes).ok());
    if (bytes.size() == 6 || bytes.size() == 7) break;  // "ok\n\n<" + 1 or 2 bytes of "｜"
  }
  ASSERT_LT(cut, ids.size()) << "no token ends inside '｜' for this tokenizer";
  ChoiceText text(*preparer_, req, 0);
  ChoiceDelta whole;
  for (size_t i = 0; i <= cut; ++i) {
    AppendDelta(text.Add({ids[i], 0, {}}, i == cut ? "length" : ""), whole);
  }
  EXPECT_EQ(whole.text, "ok\n\n<");
  EXPECT_EQ(whole.finish_reason, "length");
}

// F7.8: a streamed tool-call answer's last chunk has no "content" (OpenAI's is "delta": {}), so
// accumulating the stream as the SDKs do gives content null, as the whole response has.
TEST(ChatHistoryTest, AStreamedToolCallAnswerAccumulatesToNullContent) {
  const ApiRequest req =
      Ok(R"([{"role":"user","content":"go"}],)"
         R"("tools":[{"type":"function","function":{"name":"f"}}],"stream":true)");
  ChoiceDelta call;
  call.tool_calls.push_back({0, "call_1", "f", "{}"});
  ChoiceDelta last;
  last.finish_reason = "tool_calls";
  json content = nullptr;
  bool first = true;
  for (const ChoiceDelta* d : {&call, &last}) {
    const std::string chunk = StreamChunk(req, {"chatcmpl-1", 7, "m"}, *d, first);
    const json delta = json::parse(chunk.substr(6))["choices"][0]["delta"];
    if (delta.contains("content")) {
      content = content.is_null()
                    ? delta["content"]
                    : json(content.get<std::string>() + delta["content"].get<std::string>());
    }
    first = false;
  }
  EXPECT_TRUE(content.is_null()) << content.dump();
  ApiRequest whole = req;
  whole.stream = false;
  ChoiceDelta joined;
  AppendDelta(call, joined);
  AppendDelta(last, joined);
  const json full = json::parse(FullResponse(whole, {"chatcmpl-1", 7, "m"}, {joined}, {}));
  EXPECT_TRUE(full["choices"][0]["message"]["content"].is_null());
}

}  // namespace
}  // namespace pdserve::frontend
