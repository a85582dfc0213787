// The gRPC front's chat surface (issue 29): thinking knobs, tools, tool_choice,
// parallel_tool_calls, tool-call / tool messages and response_format reach the service as the
// HTTP front reads the same request (each case is written once as a GenerateRequest in text
// format and once as the equivalent HTTP JSON body), errors are INVALID_ARGUMENT with the HTTP
// front's error JSON, and a model's token stream (DeepSeek's own encoding of answers with
// reasoning and tool calls, tools/text_chat_golden.py) comes back as reasoning, text, parsed tool
// calls, finish_reason "tool_calls" and reasoning-token usage, delta by delta.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "frontend/request_preparer.h"
#include "google/protobuf/text_format.h"
#include "grpcpp/grpcpp.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generate.grpc.pb.h"
#include "router/grpc_front.h"
#include "router/grpc_request.h"
#include "tests/frontend/golden_answers.h"
#include "tests/router/fake_workers.h"
#include "tests/router/generation_client.h"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;
using nlohmann::json;

using frontend::testing::GoldenCompletions;
using frontend::testing::kEos;

// Records each request and answers it with `ids` (the model's tokens, EOS last) run through
// frontend::ChoiceText for that request, as the router's dispatch runs a decode worker's tokens:
// every delta with a payload goes to the sink, then usage with the choice's reasoning tokens.
class TokenStreamService : public frontend::GenerationService {
 public:
  explicit TokenStreamService(const frontend::RequestPreparer* preparer) : preparer_(preparer) {}
  std::vector<std::string> ModelNames() const override { return {"tiny"}; }
  frontend::StartResult Start(const frontend::ApiRequest& req,
                              std::shared_ptr<frontend::GenerationSink> sink) override {
    absl::MutexLock lock(&mu);
    last = req;
    sent.clear();
    frontend::ChoiceText text(*preparer_, req, 0);
    for (size_t i = 0; i < ids.size(); ++i) {
      frontend::ChoiceDelta delta =
          text.Add({ids[i], -0.5f, {}}, i + 1 == ids.size() ? last_finish : "");
      if (!delta.HasPayload()) continue;
      sent.push_back(delta);
      sink->OnDelta(std::move(delta));
    }
    sink->OnComplete({7, text.tokens(), text.reasoning_tokens()});
    return std::unique_ptr<frontend::Generation>(new NoopGeneration());
  }
  bool Ready() const override { return true; }
  std::string MetricsText() const override { return ""; }

  absl::Mutex mu;
  std::vector<int32_t> ids;                 // the next answers' tokens; empty: usage only
  std::string last_finish = "stop";         // how the last of `ids` ends the choice
  frontend::ApiRequest last;                // the last request started
  std::vector<frontend::ChoiceDelta> sent;  // the deltas of the last request

 private:
  class NoopGeneration : public frontend::Generation {
   public:
    void Cancel() override {}
  };
  const frontend::RequestPreparer* preparer_;
};

// A choice's deltas joined, as a client joins a stream.
struct Joined {
  std::string text;
  std::string reasoning;
  std::vector<pv1::ToolCall> tool_calls;
  std::string finish_reason;
  pv1::Usage usage;
  int deltas = 0;
};

class GrpcFrontChatTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::KeepCallbackQueueAlive();
    auto preparer = frontend::RequestPreparer::Load(PDSERVE_BUNDLED_MODEL);
    ASSERT_TRUE(preparer.ok()) << preparer.status();
    preparer_ = std::move(*preparer);
    service_ = std::make_unique<TokenStreamService>(preparer_.get());
    auto front = GrpcFront::Start("127.0.0.1", 0, service_.get());
    ASSERT_TRUE(front.ok()) << front.status();
    front_ = std::move(*front);
    stub_ = pv1::Generation::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", front_->port()),
                                                         grpc::InsecureChannelCredentials()));
  }

  static pv1::GenerateRequest FromText(const std::string& text) {
    pv1::GenerateRequest request;
    EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &request)) << text;
    return request;
  }

  grpc::Status Generate(const pv1::GenerateRequest& request,
                        std::vector<pv1::GenerateResponse>* out) {
    return testing::GenerateAll(*stub_, request, out);
  }

  Joined GenerateJoined(const pv1::GenerateRequest& request) {
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(request, &out);
    EXPECT_TRUE(status.ok()) << status.error_message();
    Joined joined;
    for (const pv1::GenerateResponse& response : out) {
      for (const pv1::ChoiceDelta& delta : response.choices()) {
        EXPECT_EQ(delta.index(), 0);
        ++joined.deltas;
        joined.text += delta.text();
        joined.reasoning += delta.reasoning();
        joined.tool_calls.insert(joined.tool_calls.end(), delta.tool_calls().begin(),
                                 delta.tool_calls().end());
        if (!delta.finish_reason().empty()) joined.finish_reason = delta.finish_reason();
      }
      if (response.has_usage()) joined.usage = response.usage();
    }
    return joined;
  }

  // The ids of a golden completion's text (control tokens included), then EOS.
  std::vector<int32_t> Ids(const std::string& text) {
    return frontend::testing::AnswerIds(*preparer_, text);
  }

  std::unique_ptr<frontend::RequestPreparer> preparer_;
  std::unique_ptr<TokenStreamService> service_;
  std::unique_ptr<GrpcFront> front_;
  std::unique_ptr<pv1::Generation::Stub> stub_;
};

frontend::ApiRequest HttpRequest(const std::string& body) {
  frontend::ParsedRequest parsed =
      frontend::ParseRequest(frontend::Endpoint::kChatCompletions, body);
  EXPECT_TRUE(std::holds_alternative<frontend::ApiRequest>(parsed)) << body;
  return std::get<frontend::ApiRequest>(parsed);
}

// The fields of the chat surface, equal in the request the gRPC front built and the HTTP one.
void ExpectSameChatRequest(const frontend::ApiRequest& grpc, const frontend::ApiRequest& http) {
  EXPECT_EQ(grpc.endpoint, frontend::Endpoint::kChatCompletions);
  ASSERT_EQ(grpc.messages.size(), http.messages.size());
  for (size_t i = 0; i < grpc.messages.size(); ++i) {
    const frontend::ChatMessage& g = grpc.messages[i];
    const frontend::ChatMessage& h = http.messages[i];
    EXPECT_EQ(g.role, h.role) << i;
    EXPECT_EQ(g.content, h.content) << i;
    EXPECT_EQ(g.reasoning_content, h.reasoning_content) << i;
    EXPECT_EQ(g.tool_call_id, h.tool_call_id) << i;
    ASSERT_EQ(g.tool_calls.size(), h.tool_calls.size()) << i;
    for (size_t c = 0; c < g.tool_calls.size(); ++c) {
      EXPECT_EQ(g.tool_calls[c].id, h.tool_calls[c].id);
      EXPECT_EQ(g.tool_calls[c].name, h.tool_calls[c].name);
      EXPECT_EQ(g.tool_calls[c].arguments, h.tool_calls[c].arguments);
    }
  }
  EXPECT_EQ(grpc.json_schema, http.json_schema);
  EXPECT_EQ(grpc.thinking, http.thinking);
  EXPECT_EQ(grpc.reasoning_effort, http.reasoning_effort);
  ASSERT_EQ(grpc.tools.size(), http.tools.size());
  for (size_t i = 0; i < grpc.tools.size(); ++i) {
    EXPECT_EQ(grpc.tools[i].dump(), http.tools[i].dump()) << i;  // key order included
  }
  EXPECT_EQ(grpc.tool_choice, http.tool_choice);
  EXPECT_EQ(grpc.tool_choice_name, http.tool_choice_name);
  EXPECT_EQ(grpc.parallel_tool_calls, http.parallel_tool_calls);
  EXPECT_EQ(grpc.max_tokens, http.max_tokens);
  EXPECT_EQ(grpc.min_tokens, http.min_tokens);
}

struct Equivalent {
  std::string grpc;  // GenerateRequest in protobuf text format
  std::string http;  // the same request as a /v1/chat/completions body
};

TEST_F(GrpcFrontChatTest, ChatFieldsReachTheServiceAsTheHttpFrontReadsThem) {
  const std::vector<Equivalent> cases = {
      // A tool round trip: the assistant's reasoning and call, the tool's answer; a named
      // function, one call at most, thinking off.
      {R"pb(model: "tiny"
            max_tokens: 5
            chat {
              messages { role: "user" content: "Weather in Paris?" }
              messages {
                role: "assistant"
                reasoning_content: "Need it."
                tool_calls { id: "call_1" name: "get_weather" arguments: "{\"city\": \"Paris\"}" }
              }
              messages { role: "tool" tool_call_id: "call_1" content: "sunny" }
            }
            thinking: false
            tools {
              name: "get_weather"
              description: "Weather of a city"
              parameters_json: "{\"type\":\"object\",\"properties\":"
                               "{\"zeta\":{\"type\":\"string\"},\"city\":{\"type\":\"string\"}}}"
            }
            tools { name: "now" }
            tool_choice_function: "get_weather"
            parallel_tool_calls: false)pb",
       R"({"model":"tiny","max_tokens":5,"messages":[
            {"role":"user","content":"Weather in Paris?"},
            {"role":"assistant","content":"","reasoning_content":"Need it.","tool_calls":[
              {"id":"call_1","type":"function",
               "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
            {"role":"tool","tool_call_id":"call_1","content":"sunny"}],
           "chat_template_kwargs":{"thinking":false},
           "tools":[{"type":"function","function":{"name":"get_weather",
             "description":"Weather of a city","parameters":{"type":"object",
             "properties":{"zeta":{"type":"string"},"city":{"type":"string"}}}}},
             {"type":"function","function":{"name":"now"}}],
           "tool_choice":{"type":"function","function":{"name":"get_weather"}},
           "parallel_tool_calls":false})"},
      // reasoning_effort none (thinking off: response_format needs it) and a strict json_schema,
      // property order kept.
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "Who?" } }
            reasoning_effort: "none"
            response_format {
              type: "json_schema"
              json_schema {
                name: "person"
                description: "a person"
                strict: true
                schema_json: "{\"type\":\"object\",\"properties\":{\"zeta\":{\"type\":\"string\"},"
                             "\"alpha\":{\"enum\":[1,2]}},\"required\":[\"zeta\"]}"
              }
            })pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"Who?"}],
           "reasoning_effort":"none",
           "response_format":{"type":"json_schema","json_schema":{"name":"person",
             "description":"a person","strict":true,"schema":{"type":"object","properties":
             {"zeta":{"type":"string"},"alpha":{"enum":[1,2]}},"required":["zeta"]}}}})"},
      // json_object; json_schema without a schema (any JSON value); text.
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "x" } }
            response_format { type: "json_object" })pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"x"}],
           "response_format":{"type":"json_object"}})"},
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "x" } }
            response_format {
              type: "json_schema"
              json_schema { name: "any" }
            })pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"x"}],
           "response_format":{"type":"json_schema","json_schema":{"name":"any"}}})"},
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "x" } }
            response_format { type: "text" })pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"x"}],
           "response_format":{"type":"text"}})"},
      // tool_choice required and none.
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "x" } }
            thinking: false
            tools { name: "now" }
            tool_choice: "required")pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"x"}],
           "chat_template_kwargs":{"thinking":false},
           "tools":[{"type":"function","function":{"name":"now"}}],"tool_choice":"required"})"},
      {R"pb(model: "tiny"
            chat { messages { role: "user" content: "x" } }
            thinking: true
            tools { name: "now" }
            tool_choice: "none")pb",
       R"({"model":"tiny","messages":[{"role":"user","content":"x"}],
           "chat_template_kwargs":{"thinking":true},
           "tools":[{"type":"function","function":{"name":"now"}}],"tool_choice":"none"})"},
  };
  for (const Equivalent& c : cases) {
    SCOPED_TRACE(c.http);
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(FromText(c.grpc), &out);
    ASSERT_TRUE(status.ok()) << status.error_message();
    frontend::ApiRequest grpc_request;
    {
      absl::MutexLock lock(&service_->mu);
      grpc_request = service_->last;
    }
    ExpectSameChatRequest(grpc_request, HttpRequest(c.http));
  }
  // The fields took effect (not merely equal because both were left at their defaults).
  const frontend::ApiRequest first = HttpRequest(cases[0].http);
  EXPECT_EQ(first.tool_choice, frontend::ToolChoice::kNamed);
  EXPECT_FALSE(first.parallel_tool_calls);
  EXPECT_LT(first.tools[0].dump().find("\"zeta\""), first.tools[0].dump().find("\"city\""));
  EXPECT_EQ(HttpRequest(cases[1].http).json_schema,
            R"({"type":"object","properties":{"zeta":{"type":"string"},"alpha":{"enum":[1,2]}},)"
            R"("required":["zeta"]})");
  EXPECT_EQ(HttpRequest(cases[2].http).json_schema, R"({"type":"object"})");
}

// A schema nesting `depth` arrays deep, as JSON text.
std::string DeepSchema(int depth) {
  std::string schema;
  for (int i = 0; i < depth; ++i) schema += R"({"items":)";
  return schema + "{}" + std::string(depth, '}');
}

TEST_F(GrpcFrontChatTest, RefusalsAreInvalidArgumentWithTheHttpFrontsError) {
  // Deeper than the schema compiler takes (24), well under the JSON depth limit (256): both fronts
  // read it and refuse it alike. Past 256 they differ: the gRPC front names the field, the HTTP
  // front the body (ProtoOnlyRefusalsNameTheField).
  const std::string deep = DeepSchema(30);
  pv1::GenerateRequest deep_request =
      FromText(R"pb(model: "tiny"
                    chat { messages { role: "user" content: "x" } })pb");
  deep_request.mutable_response_format()->set_type("json_schema");
  deep_request.mutable_response_format()->mutable_json_schema()->set_name("deep");
  deep_request.mutable_response_format()->mutable_json_schema()->set_schema_json(deep);
  const std::string messages = R"("model":"tiny","messages":[{"role":"user","content":"x"}])";
  const std::string grpc_chat = R"pb(model: "tiny"
                                     chat { messages { role: "user" content: "x" } })pb";
  const std::vector<std::pair<pv1::GenerateRequest, std::string>> cases = {
      {FromText(grpc_chat +
                R"pb(response_format {
                       type: "json_schema"
                       json_schema {
                         name: "p"
                         schema_json: "{\"type\":\"object\",\"properties\":"
                                      "{\"id\":{\"type\":\"string\",\"pattern\":\"^a\"}}}"
                       }
                     })pb"),
       R"("response_format":{"type":"json_schema","json_schema":{"name":"p","schema":)"
       R"({"type":"object","properties":{"id":{"type":"string","pattern":"^a"}}}}})"},
      {FromText(grpc_chat + R"pb(response_format { type: "xml" })pb"),
       R"("response_format":{"type":"xml"})"},
      {FromText(grpc_chat + R"pb(response_format { type: "json_schema" })pb"),
       R"("response_format":{"type":"json_schema"})"},
      {FromText(grpc_chat + R"pb(response_format {
                                   type: "json_object"
                                   json_schema { name: "p" }
                                 })pb"),
       R"("response_format":{"type":"json_object","json_schema":{"name":"p"}})"},
      {FromText(grpc_chat + R"pb(response_format {
                                   type: "json_schema"
                                   json_schema { name: "not a name" }
                                 })pb"),
       R"("response_format":{"type":"json_schema","json_schema":{"name":"not a name"}})"},
      {deep_request, absl::StrCat(R"("response_format":{"type":"json_schema","json_schema":)",
                                  R"({"name":"deep","schema":)", deep, "}}")},
      {FromText(grpc_chat + R"pb(thinking: false
                                 tools { name: "now" }
                                 tool_choice_function: "then")pb"),
       R"("chat_template_kwargs":{"thinking":false},)"
       R"("tools":[{"type":"function","function":{"name":"now"}}],)"
       R"("tool_choice":{"type":"function","function":{"name":"then"}})"},
      {FromText(grpc_chat + R"pb(thinking: true
                                 tools { name: "now" }
                                 tool_choice: "required")pb"),
       R"("thinking":{"type":"enabled"},)"
       R"("tools":[{"type":"function","function":{"name":"now"}}],"tool_choice":"required")"},
      {FromText(grpc_chat + R"pb(tool_choice: "always")pb"), R"("tool_choice":"always")"},
      {FromText(grpc_chat + R"pb(tools { name: "" })pb"),
       R"("tools":[{"type":"function","function":{"name":""}}])"},
      {FromText(grpc_chat + R"pb(reasoning_effort: "extreme")pb"),
       R"("reasoning_effort":"extreme")"},
      {FromText(R"pb(model: "tiny"
                     chat { messages { role: "robot" content: "x" } })pb"),
       R"("model":"tiny","messages":[{"role":"robot","content":"x"}])"},
      // A number beyond a double inside a JSON text field is named by its place in the HTTP body.
      {FromText(grpc_chat + R"pb(response_format {
                                   type: "json_schema"
                                   json_schema {
                                     name: "big"
                                     schema_json: "{\"type\":\"number\",\"maximum\":1e400}"
                                   }
                                 })pb"),
       R"("response_format":{"type":"json_schema","json_schema":{"name":"big","schema":)"
       R"({"type":"number","maximum":1e400}}})"},
      {FromText(grpc_chat + R"pb(tools {
                                   name: "f"
                                   parameters_json: "{\"properties\":{\"n\":{\"enum\":[1,-1e999]}}}"
                                 })pb"),
       R"("tools":[{"type":"function","function":{"name":"f","parameters":)"
       R"({"properties":{"n":{"enum":[1,-1e999]}}}}}])"},
  };
  for (const auto& [request, fields] : cases) {
    const std::string body = fields.starts_with(R"("model")")
                                 ? absl::StrCat("{", fields, "}")
                                 : absl::StrCat("{", messages, ",", fields, "}");
    SCOPED_TRACE(body.substr(0, 300));
    frontend::ParsedRequest http =
        frontend::ParseRequest(frontend::Endpoint::kChatCompletions, body);
    ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(http));
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(request, &out);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(), std::get<frontend::ApiError>(http).ToJson());
    EXPECT_TRUE(out.empty());
  }
}

// A refusal that needs thinking off names the field the gRPC client set, `thinking`.
TEST_F(GrpcFrontChatTest, ThinkingRefusalsNameTheThinkingField) {
  const std::string grpc_chat = R"pb(model: "tiny"
                                     chat { messages { role: "user" content: "x" } }
                                     thinking: true)pb";
  for (const std::string& fields :
       {std::string(R"pb(tools { name: "now" }
                         tool_choice: "required")pb"),
        std::string(R"pb(tools { name: "now" }
                         tool_choice_function: "now")pb"),
        std::string(R"pb(response_format { type: "json_object" })pb")}) {
    SCOPED_TRACE(fields);
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(FromText(grpc_chat + "\n" + fields), &out);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    const json error = json::parse(status.error_message())["error"];
    EXPECT_EQ(error["param"], "thinking");
    EXPECT_NE(error["message"].get<std::string>().find("which 'thinking' turned on"),
              std::string::npos)
        << error["message"];
  }
}

// What only the proto can express: chat fields on a text prompt, JSON text fields that do not
// parse, and documents too deep to re-serialize (a 400, not a stack overflow).
TEST_F(GrpcFrontChatTest, ProtoOnlyRefusalsNameTheField) {
  struct Case {
    pv1::GenerateRequest request;
    std::string param;
    std::string message;
  };
  const std::string grpc_chat = R"pb(model: "tiny"
                                     chat { messages { role: "user" content: "x" } })pb";
  pv1::GenerateRequest deep_tool = FromText(grpc_chat);
  deep_tool.add_tools()->set_name("f");
  deep_tool.mutable_tools(0)->set_parameters_json(std::string(200000, '[') +
                                                  std::string(200000, ']'));
  pv1::GenerateRequest deep_schema = FromText(grpc_chat);
  deep_schema.mutable_response_format()->set_type("json_schema");
  deep_schema.mutable_response_format()->mutable_json_schema()->set_name("d");
  deep_schema.mutable_response_format()->mutable_json_schema()->set_schema_json(DeepSchema(200000));
  // Members after the deep one: an ordered_json object that grows copies what it holds, once per
  // level, so these crashed in the parse itself (found by a breaker, 2026-12-04).
  const std::string deep_then_keys =
      R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + R"(,"b":1,"c":2})";
  pv1::GenerateRequest deep_tool_keys = FromText(grpc_chat);
  deep_tool_keys.add_tools()->set_name("f");
  deep_tool_keys.mutable_tools(0)->set_parameters_json(deep_then_keys);
  pv1::GenerateRequest deep_schema_keys = FromText(grpc_chat);
  deep_schema_keys.mutable_response_format()->set_type("json_schema");
  deep_schema_keys.mutable_response_format()->mutable_json_schema()->set_name("d");
  deep_schema_keys.mutable_response_format()->mutable_json_schema()->set_schema_json(
      deep_then_keys);
  pv1::GenerateRequest deep_arguments = FromText(grpc_chat);
  pv1::ChatMessage* assistant = deep_arguments.mutable_chat()->add_messages();
  assistant->set_role("assistant");
  pv1::ToolCall* call = assistant->add_tool_calls();
  call->set_id("c1");
  call->set_name("f");
  call->set_arguments(deep_then_keys);
  const std::vector<Case> cases = {
      {FromText(R"pb(model: "tiny"
                     text: "x"
                     response_format { type: "json_object" })pb"),
       "response_format", "'response_format' is for chat prompts only"},
      {FromText(R"pb(model: "tiny"
                     text: "x"
                     tools { name: "f" })pb"),
       "tools", "'tools' is for chat prompts only"},
      {FromText(grpc_chat + R"pb(response_format {
                                   type: "json_schema"
                                   json_schema { name: "p" schema_json: "{\"type\":" }
                                 })pb"),
       "response_format", "'response_format.json_schema.schema' is not JSON"},
      {FromText(grpc_chat + R"pb(tools { name: "f" parameters_json: "{" })pb"), "tools",
       "tools[0].function.parameters is not JSON"},
      {FromText(grpc_chat + R"pb(tools { name: "f" parameters_json: "{\"maximum\":2e308}" })pb"),
       "tools",
       "'tools[0].function.parameters.maximum': the number 2e308 is out of range (a JSON number "
       "here must fit a double, at most about 1.8e308 in magnitude)"},
      {FromText(grpc_chat + R"pb(tools { name: "f" }
                                 tool_choice: "required"
                                 tool_choice_function: "f")pb"),
       "tool_choice", "set 'tool_choice' or 'tool_choice_function', not both"},
      {deep_tool, "tools", "tools[0].function.parameters nests deeper than 256 JSON levels"},
      {deep_schema, "response_format",
       "'response_format.json_schema.schema' nests deeper than 256 JSON levels"},
      {deep_tool_keys, "tools", "tools[0].function.parameters nests deeper than 256 JSON levels"},
      {deep_schema_keys, "response_format",
       "'response_format.json_schema.schema' nests deeper than 256 JSON levels"},
      {deep_arguments, "messages",
       "messages[1].tool_calls[0].function.arguments nests deeper than 256 JSON levels"},
      // HTTP fields the proto names otherwise: the refusal names the proto's field.
      {FromText(grpc_chat + R"pb(logprobs: 50)pb"), "logprobs",
       "'logprobs' must be between 0 and 20, got 50"},
      {FromText(R"pb(model: "tiny"
                     token_ids {})pb"),
       "token_ids", "'token_ids' must hold at least one token id"},
      {FromText(R"pb(model: "tiny"
                     token_ids { ids: [ 5, -1 ] })pb"),
       "token_ids", "'token_ids' token ids must be non-negative integers"},
      {FromText(R"pb(model: "tiny" text: "")pb"), "text", "'text' must not be empty"},
      // A completion's logprobs is the HTTP field of the same name.
      {FromText(R"pb(model: "tiny" text: "x" logprobs: 50)pb"), "logprobs",
       "'logprobs' must be between 0 and 20, got 50"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    std::vector<pv1::GenerateResponse> out;
    const grpc::Status status = Generate(c.request, &out);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    const json error = json::parse(status.error_message())["error"];
    EXPECT_EQ(error["param"], c.param);
    EXPECT_EQ(error["message"], c.message);
  }
}

// A JSON text field may nest kMaxJsonDepth (256) levels itself, although the OpenAI body the
// front builds wraps it deeper (a tool's parameters 4 levels in): at 256 it is read, at 257 the
// refusal names the field, never "request body".
TEST_F(GrpcFrontChatTest, JsonTextFieldsTakeTheFullDepthAndTheirRefusalNamesTheField) {
  auto nested = [](int depth) {  // {"a": [[...]]}, `depth` levels in all
    return R"({"a":)" + std::string(depth - 1, '[') + std::string(depth - 1, ']') + "}";
  };
  auto with_parameters = [&](int depth) {
    pv1::GenerateRequest request =
        FromText(R"pb(model: "tiny"
                      chat { messages { role: "user" content: "x" } })pb");
    pv1::Tool* tool = request.add_tools();
    tool->set_name("f");
    tool->set_parameters_json(nested(depth));
    return request;
  };
  frontend::Endpoint endpoint;
  const frontend::ParsedRequest at_limit = ParseGenerateRequest(with_parameters(256), &endpoint);
  ASSERT_TRUE(std::holds_alternative<frontend::ApiRequest>(at_limit))
      << std::get<frontend::ApiError>(at_limit).message;
  const frontend::ParsedRequest over = ParseGenerateRequest(with_parameters(257), &endpoint);
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(over));
  EXPECT_EQ(std::get<frontend::ApiError>(over).message,
            "tools[0].function.parameters nests deeper than 256 JSON levels");
  EXPECT_EQ(std::get<frontend::ApiError>(over).param, "tools");
  // The schema is wrapped 3 levels deep; at 256 the compiler, not the body's depth, answers.
  pv1::GenerateRequest schema = FromText(R"pb(model: "tiny"
                                              chat { messages { role: "user" content: "x" } })pb");
  schema.mutable_response_format()->set_type("json_schema");
  schema.mutable_response_format()->mutable_json_schema()->set_name("d");
  schema.mutable_response_format()->mutable_json_schema()->set_schema_json(nested(256));
  const frontend::ParsedRequest deep_schema = ParseGenerateRequest(schema, &endpoint);
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(deep_schema));
  EXPECT_EQ(std::get<frontend::ApiError>(deep_schema).param, "response_format")
      << std::get<frontend::ApiError>(deep_schema).message;
}

// The gRPC front checks the conversation as the HTTP front does (breaker53 F5, F6): a last
// assistant message needs continue_final_message, a tool result must answer a call.
TEST_F(GrpcFrontChatTest, ConversationChecksAndContinuationMatchHttp) {
  // The refusal of `request` (an empty error when it was accepted).
  auto refusal = [](const pv1::GenerateRequest& request) {
    frontend::Endpoint endpoint;
    const frontend::ParsedRequest parsed = ParseGenerateRequest(request, &endpoint);
    const auto* error = std::get_if<frontend::ApiError>(&parsed);
    return error ? *error : frontend::ApiError{};
  };
  pv1::GenerateRequest ends = FromText(R"pb(model: "tiny"
                                            chat {
                                              messages { role: "user" content: "hi" }
                                              messages { role: "assistant" content: "And God" }
                                            })pb");
  EXPECT_EQ(refusal(ends).param, "messages");
  EXPECT_NE(refusal(ends).message.find("'continue_final_message': true"), std::string::npos);
  ends.set_continue_final_message(true);
  EXPECT_EQ(refusal(ends).message, "");
  frontend::Endpoint endpoint;
  const frontend::ParsedRequest continued = ParseGenerateRequest(ends, &endpoint);
  ASSERT_TRUE(std::holds_alternative<frontend::ApiRequest>(continued));
  EXPECT_TRUE(std::get<frontend::ApiRequest>(continued).continue_final_message);

  pv1::GenerateRequest text = FromText(R"pb(model: "tiny" text: "In")pb");
  text.set_continue_final_message(true);
  EXPECT_EQ(refusal(text).message, "'continue_final_message' is for chat prompts only");
  EXPECT_EQ(refusal(FromText(R"pb(model: "tiny"
                                  chat {
                                    messages { role: "user" content: "x" }
                                    messages { role: "tool" content: "42" }
                                  })pb"))
                .message,
            "messages[1]: a tool message needs 'tool_call_id', the id of the call it answers");
}

// Every golden answer (thinking on and off; none, one and two tool calls) streamed through the
// front: the joined deltas are DeepSeek's own parse, each delta arrives as the service sent it,
// usage counts the reasoning tokens.
TEST_F(GrpcFrontChatTest, ModelTokensComeBackAsReasoningContentAndToolCalls) {
  const json cases = GoldenCompletions();
  ASSERT_GE(cases.size(), 8u);
  for (const json& c : cases) {
    SCOPED_TRACE(c.dump());
    const bool thinking = c["thinking"];
    {
      absl::MutexLock lock(&service_->mu);
      service_->ids = Ids(c["completion"]);
    }
    const Joined joined = GenerateJoined(FromText(absl::StrCat(
        R"pb(model: "tiny"
             chat { messages { role: "user" content: "go" } }
             tools { name: "get_weather" }
             tools { name: "now" }
             thinking:)pb",
        thinking ? "true" : "false")));
    EXPECT_EQ(joined.reasoning, c["reasoning_content"].get<std::string>());
    EXPECT_EQ(joined.text, c["content"].get<std::string>());
    ASSERT_EQ(joined.tool_calls.size(), c["tool_calls"].size());
    for (size_t i = 0; i < joined.tool_calls.size(); ++i) {
      const pv1::ToolCall& call = joined.tool_calls[i];
      EXPECT_EQ(call.index(), static_cast<int>(i));
      EXPECT_TRUE(call.id().starts_with("call_")) << call.id();
      EXPECT_EQ(call.id().size(), 29u);
      EXPECT_EQ(call.name(), c["tool_calls"][i]["name"].get<std::string>());
      EXPECT_EQ(call.arguments(), c["tool_calls"][i]["arguments"].get<std::string>());
      EXPECT_TRUE(json::accept(call.arguments())) << call.arguments();
    }
    EXPECT_EQ(joined.finish_reason, c["tool_calls"].empty() ? "stop" : "tool_calls");
    absl::MutexLock lock(&service_->mu);
    // Streamed: one response per delta the service sent, with its tool calls whole.
    EXPECT_EQ(joined.deltas, static_cast<int>(service_->sent.size()));
    EXPECT_GT(service_->sent.size(), 1u);
    int64_t reasoning_tokens = 0;
    if (thinking) {
      const std::string reasoning = c["completion"].get<std::string>();
      const size_t end = reasoning.find("</think>");
      ASSERT_NE(end, std::string::npos);
      reasoning_tokens = static_cast<int64_t>(Ids(reasoning.substr(0, end + 8)).size()) - 1;
    }
    EXPECT_EQ(joined.usage.reasoning_tokens(), reasoning_tokens);
    EXPECT_EQ(joined.usage.completion_tokens(), static_cast<int64_t>(service_->ids.size()));
    EXPECT_EQ(joined.usage.prompt_tokens(), 7);
  }
}

// The deltas on the wire are the service's, one for one (tool calls in the delta that completed
// them), for the answer with two calls.
TEST_F(GrpcFrontChatTest, ToolCallDeltasArriveInTheResponseThatCompletedThem) {
  for (const json& c : GoldenCompletions()) {
    if (c["tool_calls"].size() < 2 || c["thinking"]) continue;
    {
      absl::MutexLock lock(&service_->mu);
      service_->ids = Ids(c["completion"]);
    }
    std::vector<pv1::GenerateResponse> out;
    ASSERT_TRUE(Generate(FromText(R"pb(model: "tiny"
                                       chat { messages { role: "user" content: "go" } }
                                       tools { name: "get_weather" }
                                       thinking: false)pb"),
                         &out)
                    .ok());
    absl::MutexLock lock(&service_->mu);
    ASSERT_EQ(out.size(), service_->sent.size() + 1);  // + the usage message
    int calls = 0;
    for (size_t i = 0; i < service_->sent.size(); ++i) {
      const frontend::ChoiceDelta& want = service_->sent[i];
      ASSERT_EQ(out[i].choices_size(), 1);
      const pv1::ChoiceDelta& got = out[i].choices(0);
      EXPECT_EQ(got.text(), want.text);
      EXPECT_EQ(got.reasoning(), want.reasoning);
      EXPECT_EQ(got.finish_reason(), want.finish_reason.value_or(""));
      ASSERT_EQ(got.tool_calls_size(), static_cast<int>(want.tool_calls.size()));
      for (int k = 0; k < got.tool_calls_size(); ++k) {
        EXPECT_EQ(got.tool_calls(k).id(), want.tool_calls[k].id);
        EXPECT_EQ(got.tool_calls(k).name(), want.tool_calls[k].name);
        EXPECT_EQ(got.tool_calls(k).arguments(), want.tool_calls[k].arguments);
        EXPECT_EQ(got.tool_calls(k).index(), calls++);
      }
    }
    EXPECT_EQ(calls, 2);
    EXPECT_TRUE(out.back().has_usage());
    return;
  }
  FAIL() << "no golden completion with two tool calls";
}

// breaker G3 over gRPC: a forced call cut by max_tokens inside its block's closing tag is text
// with finish_reason "length" and no tool call, as over HTTP (frontend choice_text_test).
TEST_F(GrpcFrontChatTest, AForcedCallCutInsideItsClosingTagIsTextWithFinishLength) {
  std::string cut_text;
  {
    absl::MutexLock lock(&service_->mu);
    service_->ids = frontend::testing::CutInsideTheClosingTag(*preparer_, &cut_text);
    service_->last_finish = "length";
  }
  const std::string forced =
      R"pb(model: "tiny"
           chat { messages { role: "user" content: "go" } }
           tools {
             name: "get_weather"
             parameters_json: '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'
           }
           tool_choice_function: "get_weather")pb";
  const Joined cut = GenerateJoined(FromText(forced));
  EXPECT_TRUE(cut.tool_calls.empty());
  EXPECT_EQ(cut.text, cut_text);
  EXPECT_EQ(cut.finish_reason, "length");
  {
    absl::MutexLock lock(&service_->mu);
    EXPECT_EQ(service_->last.tool_choice, frontend::ToolChoice::kNamed);
    service_->ids = Ids(std::string(frontend::testing::kForcedCallBlock));
    service_->last_finish = "stop";
  }
  const Joined whole = GenerateJoined(FromText(forced));
  ASSERT_EQ(whole.tool_calls.size(), 1u);
  EXPECT_EQ(whole.tool_calls[0].name(), "get_weather");
  EXPECT_EQ(whole.tool_calls[0].arguments(), "{\"city\": \"Paris\"}");
  EXPECT_EQ(whole.text, "");
  EXPECT_EQ(whole.finish_reason, "tool_calls");
}

// parallel_tool_calls false and tool_choice "none" over gRPC change how the answer is parsed.
TEST_F(GrpcFrontChatTest, ParallelToolCallsAndToolChoiceNoneApplyToTheParse) {
  for (const json& c : GoldenCompletions()) {
    if (c["tool_calls"].size() < 2 || c["thinking"]) continue;
    {
      absl::MutexLock lock(&service_->mu);
      service_->ids = Ids(c["completion"]);
    }
    const std::string base = R"pb(model: "tiny"
                                  chat { messages { role: "user" content: "go" } }
                                  tools { name: "get_weather" }
                                  thinking: false)pb";
    const Joined one = GenerateJoined(FromText(base + " parallel_tool_calls: false"));
    ASSERT_EQ(one.tool_calls.size(), 1u);
    EXPECT_EQ(one.tool_calls[0].name(), c["tool_calls"][0]["name"].get<std::string>());
    EXPECT_EQ(one.finish_reason, "tool_calls");
    const Joined none = GenerateJoined(FromText(base + " tool_choice: \"none\""));
    EXPECT_TRUE(none.tool_calls.empty());
    std::string completion = c["completion"];
    completion.resize(completion.size() - kEos.size());
    EXPECT_EQ(none.text, completion);  // the DSML block, as text
    EXPECT_EQ(none.finish_reason, "stop");
    return;
  }
  FAIL() << "no golden completion with two tool calls";
}

}  // namespace
}  // namespace pdserve::router
