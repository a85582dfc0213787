#include "frontend/api_request.h"

#include <gtest/gtest.h>

#include "frontend/api_response.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {
namespace {

ApiRequest ParseOk(Endpoint e, const std::string& body) {
  ParsedRequest p = ParseRequest(e, body);
  if (auto* err = std::get_if<ApiError>(&p)) {
    ADD_FAILURE() << err->message;
    return {};
  }
  return std::get<ApiRequest>(p);
}

ApiError ParseErr(Endpoint e, const std::string& body) {
  ParsedRequest p = ParseRequest(e, body);
  if (auto* err = std::get_if<ApiError>(&p)) return *err;
  ADD_FAILURE() << "accepted: " << body;
  return {};
}

TEST(ApiRequestTest, CompletionWithSamplingFields) {
  ApiRequest r = ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":"Hi","max_tokens":7,
      "temperature":0.6,"top_p":0.95,"top_k":20,"min_p":0.05,"seed":42,"n":3,"stop":["\n\n"],
      "logprobs":5,"logit_bias":{"17":-100,"0":3},"presence_penalty":0.5,"stream":true,
      "stream_options":{"include_usage":true}})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(*r.prompt_text, "Hi");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_DOUBLE_EQ(*r.temperature, 0.6);
  EXPECT_DOUBLE_EQ(*r.top_p, 0.95);
  EXPECT_EQ(*r.top_k, 20);
  EXPECT_EQ(*r.seed, 42u);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.stop, std::vector<std::string>{"\n\n"});
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.top_logprobs, 5);
  EXPECT_DOUBLE_EQ(r.logit_bias.at(17), -100);
  EXPECT_DOUBLE_EQ(r.logit_bias.at(0), 3);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(ApiRequestTest, CompletionDefaultsLeaveSamplingUnset) {
  ApiRequest r = ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":[5,6,7]})");
  EXPECT_EQ(*r.prompt_tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(*r.max_tokens, 16);  // OpenAI's completions default
  EXPECT_FALSE(r.temperature.has_value());
  EXPECT_FALSE(r.top_p.has_value());
  EXPECT_EQ(r.n, 1);
}

TEST(ApiRequestTest, CompletionBatchOfOnePromptIsThatPrompt) {
  ApiRequest ids = ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":[[5,6,7]]})");
  ASSERT_TRUE(ids.prompt_tokens.has_value());
  EXPECT_EQ(*ids.prompt_tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_FALSE(ids.prompt_text.has_value());
  ApiRequest text = ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":["In the"]})");
  ASSERT_TRUE(text.prompt_text.has_value());
  EXPECT_EQ(*text.prompt_text, "In the");
}

// Token ids are read by value as the integer fields are: 5.0 and 6e0 are ids 5 and 6; a
// fractional part, a sign or a value past int32 is refused.
TEST(ApiRequestTest, TokenIdsWrittenAsIntegralNumbersAreReadByTheirValue) {
  ApiRequest r = ParseOk(Endpoint::kCompletions,
                         R"({"model":"m","prompt":[5.0,6e0,2147483647],"stop_token_ids":[1.0]})");
  EXPECT_EQ(*r.prompt_tokens, (std::vector<int32_t>{5, 6, 2147483647}));
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{1}));
  for (const char* bad :
       {"[2147483648]", "[2147483648.0]", "[-1.0]", "[5.5]", "[1e300]", "[18446744073709551615]"}) {
    EXPECT_EQ(ParseErr(Endpoint::kCompletions, std::string(R"({"model":"m","prompt":)") + bad + "}")
                  .message,
              "'prompt' token ids must be non-negative integers")
        << bad;
  }
}

TEST(ApiRequestTest, ChatMessagesWithTextParts) {
  ApiRequest r = ParseOk(Endpoint::kChatCompletions, R"({"model":"m","messages":[
      {"role":"system","content":"Be brief."},
      {"role":"user","content":[{"type":"text","text":"Hel"},{"type":"text","text":"lo"}]}],
      "max_completion_tokens":9,"logprobs":true,"top_logprobs":3,
      "chat_template_kwargs":{"thinking":true}})");
  ASSERT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.messages[1].role, "user");
  EXPECT_EQ(r.messages[1].content, "Hello");
  EXPECT_EQ(*r.max_tokens, 9);
  EXPECT_EQ(r.top_logprobs, 3);
  EXPECT_TRUE(*r.thinking);
}

struct BadCase {
  Endpoint endpoint;
  const char* body;
  const char* message;
  const char* param;
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.message; }

class ApiRequestRejectTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(ApiRequestRejectTest, RejectsWithMessageAndParam) {
  const BadCase& c = GetParam();
  ApiError e = ParseErr(c.endpoint, c.body);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_EQ(e.message, c.message);
  EXPECT_EQ(e.param, c.param);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ApiRequestRejectTest,
    ::testing::Values(
        BadCase{Endpoint::kCompletions, "{not json", "request body is not valid JSON (at byte 3)",
                ""},
        BadCase{Endpoint::kCompletions, "[1,2]", "request body must be a JSON object", ""},
        BadCase{Endpoint::kCompletions, R"({"model":"m"})", "'prompt' is required", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":""})",
                "'prompt' must not be empty", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"prompt":"x"})", "'model' is required", "model"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","temperature":"hot"})",
                "'temperature' must be a number", "temperature"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","temperature":2.5})",
                "'temperature' must be >= 0 and <= 2, got 2.5", "temperature"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","top_p":0})",
                "'top_p' must be > 0 and <= 1, got 0", "top_p"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","max_tokens":0})",
                "'max_tokens' must be between 1 and 2147483647, got 0", "max_tokens"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","n":1.5})",
                "'n' must be an integer", "n"},
        BadCase{Endpoint::kCompletions,
                R"({"model":"m","prompt":"x","stop":["a","b","c","d","e"]})",
                "'stop' may hold at most 4 strings", "stop"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"x":1}})",
                "'logit_bias' key 'x' is not a token id", "logit_bias"},
        // Only the decimal form a client writes for an id: no sign, spaces or leading zeros.
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"+5":1}})",
                "'logit_bias' key '+5' is not a token id", "logit_bias"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{" 5":1}})",
                "'logit_bias' key ' 5' is not a token id", "logit_bias"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"5 ":1}})",
                "'logit_bias' key '5 ' is not a token id", "logit_bias"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"05":1}})",
                "'logit_bias' key '05' is not a token id", "logit_bias"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"-0":1}})",
                "'logit_bias' key '-0' is not a token id", "logit_bias"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":"x","stream_options":{}})",
                "'stream_options' requires 'stream': true", "stream_options"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":["a","b"]})",
                "batched prompts are not supported; send one prompt per request", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":[[1,2],[3]]})",
                "batched prompts are not supported; send one prompt per request", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":[1.5,2]})",
                "'prompt' token ids must be non-negative integers", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":[[7,-1]]})",
                "'prompt' token ids must be non-negative integers", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":[[]]})",
                "'prompt' must be a string or an array of token ids", "prompt"},
        BadCase{Endpoint::kCompletions, R"({"model":"m","prompt":[""]})",
                "'prompt' must not be empty", "prompt"},
        BadCase{Endpoint::kChatCompletions, R"({"model":"m","messages":[]})",
                "'messages' must be a non-empty array", "messages"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"robot","content":"x"}]})",
                "messages[0].role must be one of system, developer, user, assistant, tool",
                "messages"},
        BadCase{
            Endpoint::kChatCompletions,
            R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"f"}]})",
            "tools[0] must be {\"type\": \"function\", ...}", "tools"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":""}}]})",
                "tools[0].function.name must be a non-empty string", "tools"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                R"("tool_choice":{"type":"function","function":{"name":"g"}}})",
                "'tool_choice' names function 'g', which is not in 'tools'", "tool_choice"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tool_choice":"required"})",
                "'tool_choice' requires 'tools'", "tool_choice"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                R"("tool_choice":"required","reasoning_effort":"high"})",
                "'tool_choice' \"required\" or a named function needs thinking off, which "
                "'reasoning_effort' \"high\" turned on",
                "reasoning_effort"},
        // The refusal names the switch the client used, not one it never sent.
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                R"("tool_choice":"required","thinking":{"type":"enabled"}})",
                "'tool_choice' \"required\" or a named function needs thinking off, which "
                "'thinking' turned on",
                "thinking"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],"reasoning_effort":"low",)"
                R"("tool_choice":{"type":"function","function":{"name":"f"}},)"
                R"("chat_template_kwargs":{"thinking":true}})",
                "'tool_choice' \"required\" or a named function needs thinking off, which "
                "'chat_template_kwargs.thinking' turned on",
                "chat_template_kwargs"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("response_format":{"type":"json_object"},)"
                R"("chat_template_kwargs":{"thinking":true}})",
                "'response_format' needs thinking off, which 'chat_template_kwargs.thinking' "
                "turned on: the JSON is enforced from the answer's first token",
                "chat_template_kwargs"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                R"("tool_choice":"required","chat_template_kwargs":{"enable_thinking":true}})",
                "'tool_choice' \"required\" or a named function needs thinking off, which "
                "'chat_template_kwargs.enable_thinking' turned on",
                "chat_template_kwargs"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("response_format":{"type":"json_object"},"thinking":{"type":"enabled"}})",
                "'response_format' needs thinking off, which 'thinking' turned on: the JSON is "
                "enforced from the answer's first token",
                "thinking"},
        BadCase{Endpoint::kCompletions,
                R"({"model":"m","prompt":"x","response_format":{"type":"json_object"}})",
                "'response_format' is supported on /v1/chat/completions only (a /v1/completions "
                "answer would not follow it)",
                "response_format"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("response_format":{"type":"json_object"},"stop":["\""]})",
                "'stop' cannot be combined with 'response_format' json: the constrained output "
                "ends by itself when it is complete",
                "stop"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("tools":[{"type":"function","function":{"name":"f"}}],)"
                R"("tool_choice":"required","stop":"DSML"})",
                "'stop' cannot be combined with 'tool_choice' \"required\" or a named function: "
                "the constrained output ends by itself when it is complete",
                "stop"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],"tool_choice":"x"})",
                "'tool_choice' must be \"none\", \"auto\", \"required\" or a function",
                "tool_choice"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":"c"}]}]})",
                "messages[0].tool_calls[0] must be {\"id\", \"type\": \"function\", "
                "\"function\": {\"name\", \"arguments\"}} with string name and arguments",
                "messages"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("reasoning_effort":"extreme"})",
                "'reasoning_effort' must be one of none, minimal, low, medium, high, max; got "
                "'extreme'",
                "reasoning_effort"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],"audio":{}})",
                "'audio' is not supported: this server writes text only", "audio"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],)"
                R"("modalities":["text","audio"]})",
                "'modalities' is not supported: this server writes text only", "modalities"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],"functions":[]})",
                "'functions' is not supported: use 'tools'", "functions"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":5}]})",
                "messages[0].content must be a string or an array of text parts", "messages"},
        BadCase{Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
                "'top_logprobs' requires 'logprobs': true", "top_logprobs"},
        BadCase{
            Endpoint::kChatCompletions,
            R"({"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":5}})",
            "'response_format' must be an object with a string 'type'", "response_format"}));

// A number beyond a double is valid JSON grammar that the parser cannot hold: the 400 says so and
// names the field, not "not valid JSON".
TEST(ApiRequestTest, ANumberBeyondADoubleIsOutOfRangeNamingItsField) {
  const std::string range =
      " is out of range (a JSON number here must fit a double, at most about 1.8e308 in "
      "magnitude)";
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  struct Case {
    Endpoint endpoint;
    std::string body;
    std::string message;
    std::string param;
  };
  const Case cases[] = {
      {Endpoint::kChatCompletions, chat + R"("max_tokens": 1e400})",
       "'max_tokens': the number 1e400" + range, "max_tokens"},
      {Endpoint::kChatCompletions, chat + R"("temperature":1e400})",
       "'temperature': the number 1e400" + range, "temperature"},
      {Endpoint::kCompletions, R"({"model":"m","prompt":"x","logit_bias":{"5":-1E+999}})",
       "'logit_bias.5': the number -1E+999" + range, "logit_bias"},
      // 400 digits: too large for any integer type, then for a double.
      {Endpoint::kCompletions,
       R"({"model":"m","prompt":"x","seed":1)" + std::string(399, '0') + "}",
       "'seed': the number 10000000000000000000000000000000..." + range, "seed"},
      {Endpoint::kChatCompletions,
       R"({"model":"m","messages":[{"role":"user","content":"x"},{"role":"user","content":"y",)"
       R"("extra":[1,[2,3],4e999]}]})",
       "'messages[1].extra[2]': the number 4e999" + range, "messages"},
      {Endpoint::kCompletions, "-1e400", "request body: the number -1e400" + range, ""},
      // The first error the parser meets decides: broken grammar before the number.
      {Endpoint::kCompletions, R"({"model":,"max_tokens":1e400})",
       "request body is not valid JSON (at byte 10)", ""},
      {Endpoint::kCompletions, "",
       "request body is not valid JSON (it ends before the JSON value does)", ""},
      {Endpoint::kCompletions, R"({"model":"m","max_tokens":1)",
       "request body is not valid JSON (it ends before the JSON value does)", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    const ApiError e = ParseErr(c.endpoint, c.body);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.message, c.message);
    EXPECT_EQ(e.param, c.param);
  }
  // Below a double's range is not an error: 1e-400 reads as 0, as other JSON parsers read it.
  EXPECT_EQ(*ParseOk(Endpoint::kChatCompletions, chat + R"("temperature":1e-400})").temperature, 0);
}

// An integer field reads a number by its value, not its spelling: 1e10 is out of range as
// 10000000000 is, 2.0 is 2, and only a fractional part is "must be an integer".
TEST(ApiRequestTest, AnIntegralNumberWrittenWithAnExponentOrPointIsReadByItsValue) {
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  const std::string max_tokens_range = "'max_tokens' must be between 1 and 2147483647, got ";
  struct Case {
    std::string body;
    std::string message;
    std::string param;
  };
  const Case cases[] = {
      {chat + R"("max_tokens":10000000000})", max_tokens_range + "10000000000", "max_tokens"},
      {chat + R"("max_tokens":1e10})", max_tokens_range + "10000000000", "max_tokens"},
      {chat + R"("max_tokens":10000000000.0})", max_tokens_range + "10000000000", "max_tokens"},
      {chat + R"("max_tokens":0.0})", max_tokens_range + "0", "max_tokens"},
      {chat + R"("max_completion_tokens":-3E2})",
       "'max_completion_tokens' must be between 1 and 2147483647, got -300",
       "max_completion_tokens"},
      {chat + R"("n":1.28e2})", "", ""},
      {chat + R"("n":1.29e2})", "'n' must be between 1 and 128, got 129", "n"},
      {chat + R"("top_logprobs":2.1e1,"logprobs":true})",
       "'top_logprobs' must be between 0 and 20, got 21", "top_logprobs"},
      // Beyond int64 and beyond uint64: still the range, not the type.
      {chat + R"("seed":1e19})",
       "'seed' must be between -9223372036854775808 and 9223372036854775807, got "
       "10000000000000000000",
       "seed"},
      {chat + R"("seed":-1e30})",
       "'seed' must be between -9223372036854775808 and 9223372036854775807, got -1e+30", "seed"},
      // A huge value is not printed as its 309 digits; -0.0 is 0.
      {chat + R"("max_tokens":1e308})", max_tokens_range + "1e+308", "max_tokens"},
      {chat + R"("max_tokens":-0.0})", max_tokens_range + "0", "max_tokens"},
      {chat + R"("seed":1e20})",
       "'seed' must be between -9223372036854775808 and 9223372036854775807, got "
       "100000000000000000000",
       "seed"},
      {chat + R"("max_tokens":5.5})", "'max_tokens' must be an integer", "max_tokens"},
      {chat + R"("max_tokens":1e-1})", "'max_tokens' must be an integer", "max_tokens"},
      {chat + R"("n":"2"})", "'n' must be an integer", "n"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    ParsedRequest p = ParseRequest(Endpoint::kChatCompletions, c.body);
    if (c.message.empty()) {
      EXPECT_TRUE(std::holds_alternative<ApiRequest>(p));
      continue;
    }
    const ApiError e = ParseErr(Endpoint::kChatCompletions, c.body);
    EXPECT_EQ(e.message, c.message);
    EXPECT_EQ(e.param, c.param);
  }
  const ApiRequest r = ParseOk(
      Endpoint::kCompletions, R"({"model":"m","prompt":"x","max_tokens":1e3,"n":2.0,"seed":-7.0})");
  EXPECT_EQ(*r.max_tokens, 1000);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(*r.seed, static_cast<uint64_t>(int64_t{-7}));
}

TEST(ApiRequestTest, FieldsTheSdkSendsAreAcceptedAndUnknownOnesIgnored) {
  ApiRequest r = ParseOk(Endpoint::kChatCompletions, R"({"model":"m",
      "messages":[{"role":"user","content":"x","some_message_field":1}],
      "stream":true,"stream_options":{"include_usage":true,"include_obfuscation":false},
      "user":"u","metadata":{"k":"v"},"store":false,"service_tier":"auto",
      "parallel_tool_calls":false,"max_completion_tokens":7,"logprobs":true,"top_logprobs":2,
      "n":3,"modalities":["text"],"frobnicate":{"deep":[1]}})");
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.user, "u");
  EXPECT_FALSE(r.parallel_tool_calls);
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_EQ(r.top_logprobs, 2);
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":"x","frobnicate":1})").n, 1);
}

TEST(ApiRequestTest, ToolsToolMessagesAndToolCallsAreRead) {
  ApiRequest r = ParseOk(Endpoint::kChatCompletions, R"({"model":"m",
      "tools":[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2},
                "description":"d"}}],
      "tool_choice":{"type":"function","function":{"name":"f"}},
      "messages":[{"role":"user","content":"x"},
        {"role":"assistant","content":null,"reasoning_content":"r",
         "tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
        {"role":"tool","tool_call_id":"c1",
         "content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]})");
  ASSERT_EQ(r.tools.size(), 1u);
  // The client's key order is kept: the prompt shows the schema as it was written.
  EXPECT_EQ(r.tools[0].dump(), R"({"name":"f","parameters":{"z":1,"a":2},"description":"d"})");
  EXPECT_EQ(r.tool_choice, ToolChoice::kNamed);
  EXPECT_EQ(r.tool_choice_name, "f");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1].reasoning_content, "r");
  ASSERT_EQ(r.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.messages[1].tool_calls[0].id, "c1");
  EXPECT_EQ(r.messages[1].tool_calls[0].arguments, "{}");
  EXPECT_EQ(r.messages[2].tool_call_id, "c1");
  EXPECT_EQ(r.messages[2].content, "a\n\nb");
}

// Bodies 100000 arrays deep (under the 4 MiB body limit) are refused before anything parses
// them: the chat fields are parsed again as ordered_json, whose objects copy their members when
// they grow, and copying recurses once per level: `pdserve serve` died with SIGSEGV on these
// (found by a breaker, 2026-12-04), whichever field held the deep value.
TEST(ApiRequestTest, ABodyNestingDeeperThan256LevelsIs400NotACrash) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string messages = R"("model":"m","messages":[{"role":"user","content":"x"}])";
  const std::string bodies[] = {
      "{" + messages + R"(,"tools":[{"type":"function","function":{"name":"f"}}],"x":)" + deep +
          R"(,"y":1,"z":2})",
      "{" + messages +
          R"(,"response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{}}},)"
          R"("x":)" +
          deep + R"(,"y":1})",
      "{" + messages + R"(,"tools":[{"type":"function","function":{"name":"f","parameters":)" +
          R"({"p":)" + deep + "}}}]}",
      "{" + messages + R"(,"response_format":{"type":"json_schema","json_schema":{"name":"a",)" +
          R"("schema":{"a":)" + deep + R"(,"b":1}}}})",
  };
  for (const std::string& body : bodies) {
    const ApiError e = ParseErr(Endpoint::kChatCompletions, body);
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.message, "request body nests deeper than 256 JSON levels") << body.substr(0, 120);
  }
  const ApiError completion =
      ParseErr(Endpoint::kCompletions, R"({"model":"m","prompt":"x","x":)" + deep + "}");
  EXPECT_EQ(completion.message, "request body nests deeper than 256 JSON levels");
}

TEST(ApiRequestTest, ABodyAtTheDepthLimitIsRead) {
  // 256 levels in all: the body object, then 255 arrays.
  const std::string nested = std::string(255, '[') + std::string(255, ']');
  const ApiRequest r =
      ParseOk(Endpoint::kCompletions, R"({"model":"m","prompt":"x","x":)" + nested + "}");
  EXPECT_EQ(r.prompt_text, "x");
  const ApiError e =
      ParseErr(Endpoint::kCompletions, R"({"model":"m","prompt":"x","x":[)" + nested + "]}");
  EXPECT_EQ(e.message, "request body nests deeper than 256 JSON levels");
}

// An assistant message's tool-call arguments are JSON inside a string: the body's depth does not
// bound them, and the chat format parses them to render the prompt.
TEST(ApiRequestTest, ToolCallArgumentsNestingDeeperThan256LevelsAre400) {
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const ApiError e =
      ParseErr(Endpoint::kChatCompletions,
               R"({"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant",)"
               R"("content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"f",)"
               R"("arguments":"{\"a\":)" +
                   deep + R"(,\"b\":1}"}}]}]})");
  EXPECT_EQ(e.param, "messages");
  EXPECT_EQ(e.message,
            "messages[1].tool_calls[0].function.arguments nests deeper than 256 JSON "
            "levels");
}

TEST(ApiRequestTest, ThinkingFollowsKwargsThenReasoningEffort) {
  auto thinking = [](const std::string& fields) {
    return ThinkingOn(
        ParseOk(Endpoint::kChatCompletions,
                R"({"model":"m","messages":[{"role":"user","content":"x"}])" + fields + "}"));
  };
  EXPECT_FALSE(thinking(""));
  EXPECT_TRUE(thinking(R"(,"reasoning_effort":"max")"));
  EXPECT_FALSE(thinking(R"(,"reasoning_effort":"none","chat_template_kwargs":{"thinking":true})"));
  EXPECT_FALSE(thinking(R"(,"reasoning_effort":"high","chat_template_kwargs":{"thinking":false})"));
  EXPECT_TRUE(thinking(R"(,"chat_template_kwargs":{"enable_thinking":true})"));
}

// DeepSeek's own API switches thinking with a top-level object; it counts as
// chat_template_kwargs.thinking does (reasoning_effort "none" still turns it off).
TEST(ApiRequestTest, DeepSeeksThinkingObjectSwitchesThinking) {
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  const ApiRequest on =
      ParseOk(Endpoint::kChatCompletions, chat + R"("thinking":{"type":"enabled"}})");
  ASSERT_TRUE(on.thinking.has_value());
  EXPECT_TRUE(*on.thinking);
  EXPECT_TRUE(ThinkingOn(on));
  const ApiRequest off =
      ParseOk(Endpoint::kChatCompletions,
              chat + R"("thinking":{"type":"disabled"},"reasoning_effort":"max"})");
  ASSERT_TRUE(off.thinking.has_value());
  EXPECT_FALSE(*off.thinking);
  EXPECT_FALSE(ThinkingOn(off));
  EXPECT_FALSE(
      ThinkingOn(ParseOk(Endpoint::kChatCompletions,
                         chat + R"("thinking":{"type":"enabled"},"reasoning_effort":"none"})")));
  // Both switches given: they must agree.
  const ApiRequest both =
      ParseOk(Endpoint::kChatCompletions,
              chat + R"("thinking":{"type":"enabled"},"chat_template_kwargs":{"thinking":true}})");
  EXPECT_TRUE(*both.thinking);
  // Anthropic's budget_tokens changes nothing here; null is absent, as for every field.
  EXPECT_TRUE(*ParseOk(Endpoint::kChatCompletions,
                       chat + R"("thinking":{"type":"enabled","budget_tokens":1024}})")
                   .thinking);
  EXPECT_FALSE(ParseOk(Endpoint::kChatCompletions, chat + R"("thinking":null})").thinking);
}

TEST(ApiRequestTest, AThinkingOfTheWrongShapeIs400NamingIt) {
  const std::string chat = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  const std::string shape =
      R"('thinking' must be an object, {"type": "enabled"} or {"type": "disabled"})";
  for (const char* value : {"5", "true", R"("enabled")", "{}", R"({"type":true})",
                            R"({"type":"adaptive"})", R"([{"type":"enabled"}])"}) {
    SCOPED_TRACE(value);
    const ApiError e = ParseErr(Endpoint::kChatCompletions, chat + R"("thinking":)" + value + "}");
    EXPECT_EQ(e.http_status, 400);
    EXPECT_EQ(e.message, shape);
    EXPECT_EQ(e.param, "thinking");
  }
  const ApiError disagree = ParseErr(
      Endpoint::kChatCompletions,
      chat + R"("thinking":{"type":"disabled"},"chat_template_kwargs":{"thinking":true}})");
  EXPECT_EQ(disagree.message,
            "'thinking' and 'chat_template_kwargs.thinking' disagree; send one of the two");
  EXPECT_EQ(disagree.param, "thinking");
  // The alias the client sent is the one named (a breaker's finding, 2026-12-05).
  const ApiError alias = ParseErr(
      Endpoint::kChatCompletions,
      chat + R"("thinking":{"type":"disabled"},"chat_template_kwargs":{"enable_thinking":true}})");
  EXPECT_EQ(alias.message,
            "'thinking' and 'chat_template_kwargs.enable_thinking' disagree; send one of the two");
  EXPECT_EQ(alias.param, "thinking");
  // The two aliases against each other: a 400 (enable_thinking silently won before).
  for (const char* kwargs : {R"({"thinking":true,"enable_thinking":false})",
                             R"({"enable_thinking":false,"thinking":true})"}) {
    const ApiError both =
        ParseErr(Endpoint::kChatCompletions, chat + R"("chat_template_kwargs":)" + kwargs + "}");
    EXPECT_EQ(both.http_status, 400);
    EXPECT_EQ(both.message,
              "'chat_template_kwargs.thinking' and 'chat_template_kwargs.enable_thinking' "
              "disagree; send one of the two");
    EXPECT_EQ(both.param, "chat_template_kwargs");
  }
  // Agreeing aliases stay fine.
  EXPECT_EQ(ParseOk(Endpoint::kChatCompletions,
                    chat + R"("chat_template_kwargs":{"thinking":true,"enable_thinking":true}})")
                .thinking,
            std::optional<bool>(true));
}

TEST(ApiRequestTest, StopStringsAreAtMost512Bytes) {
  const auto body = [](size_t bytes) {
    return R"({"model":"m","prompt":"x","stop":["a",")" + std::string(bytes, 'z') + R"("]})";
  };
  EXPECT_EQ(ParseOk(Endpoint::kCompletions, body(512)).stop.back().size(), 512u);
  const ApiError e = ParseErr(Endpoint::kCompletions, body(513));
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.message, "'stop' strings may be at most 512 bytes long, got 513");
  EXPECT_EQ(e.param, "stop");
}

TEST(ApiResponseTest, DegenerateChoiceCarriesTheFlagAndItsKind) {
  ApiRequest req;
  req.endpoint = Endpoint::kCompletions;
  const ResponseMeta meta{"cmpl-1", 7, "m"};
  ChoiceDelta plain{0, "a", {}, std::nullopt, std::nullopt};
  ChoiceDelta flagged{0, "b", {}, std::string("length"), std::string("repeat")};
  const nlohmann::json full = nlohmann::json::parse(FullResponse(req, meta, {flagged}, {1, 2}));
  EXPECT_EQ(full["choices"][0]["degenerate"], true);
  EXPECT_EQ(full["choices"][0]["degeneration_kind"], "repeat");
  const nlohmann::json clean = nlohmann::json::parse(FullResponse(req, meta, {plain}, {1, 1}));
  EXPECT_FALSE(clean["choices"][0].contains("degenerate"));
  EXPECT_FALSE(clean["choices"][0].contains("degeneration_kind"));
  req.endpoint = Endpoint::kChatCompletions;
  req.stream = true;
  const std::string chunk = StreamChunk(req, meta, flagged, false);
  ASSERT_EQ(chunk.rfind("data: ", 0), 0u);
  const nlohmann::json event = nlohmann::json::parse(chunk.substr(6));
  EXPECT_EQ(event["choices"][0]["degenerate"], true);
  EXPECT_EQ(event["choices"][0]["degeneration_kind"], "repeat");
  EXPECT_EQ(event["choices"][0]["delta"]["content"], "b");
}

TEST(ApiRequestTest, ErrorJsonHasOpenAiShape) {
  ApiError e = InvalidRequest("too long", "messages", "context_length_exceeded");
  auto j = nlohmann::json::parse(e.ToJson());
  EXPECT_EQ(j["error"]["message"], "too long");
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "messages");
  EXPECT_EQ(j["error"]["code"], "context_length_exceeded");
  EXPECT_TRUE(nlohmann::json::parse(InvalidRequest("x").ToJson())["error"]["code"].is_null());
}

// The error names the model; a name of megabytes is cut (a request must not make its error
// response as large as itself), at a character boundary so the JSON stays valid UTF-8.
TEST(ApiRequestTest, ModelNotFoundNamesTheModelCutToItsStart) {
  ApiError short_name = ModelNotFound("gpt-4");
  EXPECT_EQ(short_name.http_status, 404);
  EXPECT_EQ(short_name.message, "The model 'gpt-4' does not exist");
  EXPECT_EQ(short_name.code, "model_not_found");
  EXPECT_EQ(short_name.param, "model");
  // 255 ASCII bytes, then 2-byte characters: byte 256 is the middle of one.
  const std::string long_name =
      std::string(255, 'm') + std::string(4 << 20, 'x').replace(0, 4, "\xC3\xA9\xC3\xA9");
  ApiError cut = ModelNotFound(long_name);
  EXPECT_EQ(cut.message, "The model '" + std::string(255, 'm') + "...' does not exist");
  EXPECT_NO_THROW(nlohmann::json::parse(cut.ToJson()));
}

}  // namespace
}  // namespace pdserve::frontend
