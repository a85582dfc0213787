// Response bodies: /v1/completions' top_logprobs dicts keep the ranking (most likely first), in
// whole responses and stream chunks alike.
#include "frontend/api_response.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "frontend/api_request.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {
namespace {

using ordered_json = nlohmann::ordered_json;

ApiRequest CompletionWithLogprobs() {
  ApiRequest req;
  req.endpoint = Endpoint::kCompletions;
  req.logprobs = true;
  req.top_logprobs = 3;
  return req;
}

ChoiceDelta Delta() {
  ChoiceDelta d;
  d.text = " zeta";
  // Ranked best first, alphabetically last first: a sorted object would reverse them.
  d.logprobs.push_back({" zeta", -0.25f, {{" zeta", -0.25f}, {" mu", -1.5f}, {" alpha", -3.0f}}});
  // Two alternatives with the same text keep the better logprob, in its place.
  d.logprobs.push_back({"b", -0.5f, {{"b", -0.5f}, {"a", -1.0f}, {"b", -2.0f}}});
  d.finish_reason = "length";
  return d;
}

// The keys of top_logprobs[i] in document order, and their values.
std::vector<std::pair<std::string, float>> TopEntries(const ordered_json& logprobs, int i) {
  std::vector<std::pair<std::string, float>> out;
  for (const auto& [key, value] : logprobs["top_logprobs"][i].items()) {
    out.emplace_back(key, value.get<float>());
  }
  return out;
}

void ExpectRanked(const ordered_json& logprobs) {
  using Entries = std::vector<std::pair<std::string, float>>;
  EXPECT_EQ(TopEntries(logprobs, 0),
            (Entries{{" zeta", -0.25f}, {" mu", -1.5f}, {" alpha", -3.0f}}));
  EXPECT_EQ(TopEntries(logprobs, 1), (Entries{{"b", -0.5f}, {"a", -1.0f}}));
  EXPECT_EQ(logprobs["tokens"], ordered_json({" zeta", "b"}));
  EXPECT_EQ(logprobs["text_offset"], ordered_json({0, 5}));
}

TEST(ApiResponseTest, CompletionTopLogprobsAreMostLikelyFirst) {
  const std::string body =
      FullResponse(CompletionWithLogprobs(), {"cmpl-1", 7, "m"}, {Delta()}, {3, 2});
  const ordered_json j = ordered_json::parse(body);
  ExpectRanked(j["choices"][0]["logprobs"]);
  // The raw text too: " zeta" comes before " alpha".
  EXPECT_LT(body.find("\" zeta\":"), body.find("\" alpha\":"));
}

TEST(ApiResponseTest, StreamedCompletionTopLogprobsAreMostLikelyFirst) {
  const std::string chunk =
      StreamChunk(CompletionWithLogprobs(), {"cmpl-1", 7, "m"}, Delta(), true);
  ASSERT_EQ(chunk.rfind("data: ", 0), 0u);
  const ordered_json j = ordered_json::parse(chunk.substr(6));
  ExpectRanked(j["choices"][0]["logprobs"]);
}

TEST(ApiResponseTest, EnvelopeKeysInOpenAIOrder) {
  const ordered_json j = ordered_json::parse(
      FullResponse(CompletionWithLogprobs(), {"cmpl-1", 7, "m"}, {Delta()}, {3, 2}));
  std::vector<std::string> keys;
  for (const auto& [key, value] : j.items()) keys.push_back(key);
  EXPECT_EQ(keys,
            (std::vector<std::string>{"id", "object", "created", "model", "choices", "usage"}));
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
}

ApiRequest ThinkingChat(bool stream) {
  ApiRequest req;
  req.endpoint = Endpoint::kChatCompletions;
  req.thinking = true;
  req.stream = stream;
  return req;
}

TEST(ApiResponseTest, ChatMessageCarriesReasoningAndToolCalls) {
  ChoiceDelta d;
  d.reasoning = "plan";
  d.tool_calls.push_back({0, "call_1", "f", R"({"a": 1})"});
  d.finish_reason = "tool_calls";
  const ordered_json full = ordered_json::parse(
      FullResponse(ThinkingChat(false), {"chatcmpl-1", 7, "m"}, {d},
                   {.prompt_tokens = 3, .completion_tokens = 9, .reasoning_tokens = 4}));
  const ordered_json& message = full["choices"][0]["message"];
  EXPECT_TRUE(message["content"].is_null());
  EXPECT_EQ(message["reasoning_content"], "plan");
  EXPECT_EQ(
      message["tool_calls"].dump(),
      R"([{"id":"call_1","type":"function","function":{"name":"f","arguments":"{\"a\": 1}"}}])");
  EXPECT_EQ(full["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(full["usage"]["completion_tokens_details"]["reasoning_tokens"], 4);
}

TEST(ApiResponseTest, ChatDeltaCarriesOnlyWhatItHas) {
  const ResponseMeta meta{"chatcmpl-1", 7, "m"};
  auto delta_json = [&](const ChoiceDelta& d, bool first) {
    const std::string chunk = StreamChunk(ThinkingChat(true), meta, d, first);
    return ordered_json::parse(chunk.substr(6))["choices"][0]["delta"];
  };
  ChoiceDelta reasoning;
  reasoning.reasoning = "hm";
  EXPECT_EQ(delta_json(reasoning, true).dump(), R"({"role":"assistant","reasoning_content":"hm"})");
  ChoiceDelta call;
  call.tool_calls.push_back({1, "call_2", "g", "{}"});
  EXPECT_EQ(delta_json(call, false).dump(),
            R"({"tool_calls":[{"index":1,"id":"call_2","type":"function",)"
            R"("function":{"name":"g","arguments":"{}"}}]})");
  // Nothing else: the opening chunk has content "" (as OpenAI's), a later one no content at all
  // (OpenAI's last chunk is "delta": {}).
  EXPECT_EQ(delta_json(ChoiceDelta{}, true).dump(), R"({"role":"assistant","content":""})");
  EXPECT_EQ(delta_json(ChoiceDelta{}, false).dump(), "{}");
}

// Deltas with only reasoning or only tool calls are sent (thinking mode lost its reasoning when
// the filter looked at text and logprobs alone); a delta with nothing is not.
TEST(ApiResponseTest, ADeltaWithOnlyReasoningOrToolCallsHasAPayload) {
  ChoiceDelta empty;
  EXPECT_FALSE(empty.HasPayload());
  ChoiceDelta reasoning;
  reasoning.reasoning = " LORD";
  EXPECT_TRUE(reasoning.HasPayload());
  ChoiceDelta call;
  call.tool_calls.emplace_back();
  EXPECT_TRUE(call.HasPayload());
  ChoiceDelta finish;
  finish.finish_reason = "stop";
  EXPECT_TRUE(finish.HasPayload());
}

// A chat logprob's bytes are the token's raw bytes (a partial UTF-8 sequence keeps its own byte,
// not U+FFFD's three), for the token and for each alternative.
TEST(ApiResponseTest, ChatLogprobBytesAreTheRawBytes) {
  ApiRequest req = ThinkingChat(false);
  req.logprobs = true;
  req.top_logprobs = 2;
  ChoiceDelta d;
  d.text = "\xEF\xBF\xBD";
  d.logprobs.push_back(
      {"\xEF\xBF\xBD", -0.5f, {{"\xEF\xBF\xBD", -0.5f}, {"a", -2.0f}}, "\xC3", {"\xC3", ""}});
  d.finish_reason = "length";
  const ordered_json full = ordered_json::parse(
      FullResponse(req, {"chatcmpl-1", 7, "m"}, {d}, {.prompt_tokens = 3, .completion_tokens = 1}));
  const ordered_json& lp = full["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(lp["bytes"], ordered_json({0xC3}));
  EXPECT_EQ(lp["top_logprobs"][0]["bytes"], ordered_json({0xC3}));
  EXPECT_EQ(lp["top_logprobs"][1]["bytes"], ordered_json({'a'}));  // empty: the text's bytes
}

}  // namespace
}  // namespace pdserve::frontend
