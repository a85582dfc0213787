#include "router/grpc_request.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/json_depth.h"
#include "common/json_parse_failure.h"
#include "common/ordered_json.h"
#include "nlohmann/json.hpp"

namespace pdserve::router {
namespace {

namespace pv1 = pdserve::v1;
using ordered_json = nlohmann::ordered_json;

// A NaN / infinite sampling value would become JSON null (then the model's default), so it is
// refused here.
std::optional<frontend::ApiError> CheckFinite(const pv1::GenerateRequest& request) {
  const std::pair<const char*, std::optional<double>> values[] = {
      {"temperature",
       request.has_temperature() ? std::optional(request.temperature()) : std::nullopt},
      {"top_p", request.has_top_p() ? std::optional(request.top_p()) : std::nullopt},
      {"min_p", request.has_min_p() ? std::optional(request.min_p()) : std::nullopt},
      {"presence_penalty",
       request.has_presence_penalty() ? std::optional(request.presence_penalty()) : std::nullopt},
      {"frequency_penalty",
       request.has_frequency_penalty() ? std::optional(request.frequency_penalty()) : std::nullopt},
      {"repetition_penalty", request.has_repetition_penalty()
                                 ? std::optional(request.repetition_penalty())
                                 : std::nullopt},
  };
  for (const auto& [name, value] : values) {
    if (value && !std::isfinite(*value)) {
      return frontend::InvalidRequest(absl::StrCat("'", name, "' must be a finite number"), name);
    }
  }
  for (const auto& [id, value] : request.logit_bias()) {
    if (!std::isfinite(value)) {
      return frontend::InvalidRequest(
          absl::StrCat("'logit_bias' for token ", id, " must be a finite number"), "logit_bias");
    }
  }
  return std::nullopt;
}

// The chat-only fields are refused on a text or token-id prompt: the completions endpoint would
// ignore them silently.
std::optional<frontend::ApiError> CheckChatOnly(const pv1::GenerateRequest& request) {
  if (request.prompt_case() == pv1::GenerateRequest::kChat) {
    if (request.has_tool_choice() && request.has_tool_choice_function()) {
      return frontend::InvalidRequest("set 'tool_choice' or 'tool_choice_function', not both",
                                      "tool_choice");
    }
    return std::nullopt;
  }
  const std::pair<const char*, bool> chat_only[] = {
      {"thinking", request.has_thinking()},
      {"reasoning_effort", request.has_reasoning_effort()},
      {"tools", !request.tools().empty()},
      {"tool_choice", request.has_tool_choice()},
      {"tool_choice_function", request.has_tool_choice_function()},
      {"parallel_tool_calls", request.has_parallel_tool_calls()},
      {"response_format", request.has_response_format()},
      {"continue_final_message", request.has_continue_final_message()}};
  for (const auto& [name, set] : chat_only) {
    if (set) {
      return frontend::InvalidRequest(absl::StrCat("'", name, "' is for chat prompts only"), name);
    }
  }
  return std::nullopt;
}

// `text` (a JSON document inside a proto string) parsed with its key order kept, or a 400 naming
// `param`: `what` nests deeper than kMaxJsonDepth levels, holds a number beyond a double (named
// by its place in the HTTP body, `where` and the path inside the text, as the HTTP front names
// it), or is not JSON. The depth is checked on the text first: parsing into an ordered_json
// object that grows copies its members, and copying recurses once per level
// (common/json_depth.h).
std::variant<ordered_json, frontend::ApiError> ParseJsonText(const std::string& text,
                                                             const std::string& what,
                                                             std::string_view where,
                                                             const char* param) {
  if (absl::Status depth = CheckJsonDepth(text, what); !depth.ok()) {
    return frontend::InvalidRequest(std::string(depth.message()), param);
  }
  ordered_json value = ParseOrderedJson(text);
  if (value.is_discarded()) {
    const std::optional<JsonParseFailure> failure = FindJsonParseFailure(text);
    if (failure && failure->kind == JsonParseFailure::Kind::kNumberOutOfRange) {
      return frontend::InvalidRequest(NumberOutOfRangeMessage(where, *failure), param);
    }
    return frontend::InvalidRequest(absl::StrCat(what, " is not JSON"), param);
  }
  return value;
}

ordered_json ChatMessageJson(const pv1::ChatMessage& m) {
  ordered_json j = {{"role", m.role()}, {"content", m.content()}};
  if (!m.reasoning_content().empty()) j["reasoning_content"] = m.reasoning_content();
  if (!m.tool_call_id().empty()) j["tool_call_id"] = m.tool_call_id();
  for (const pv1::ToolCall& c : m.tool_calls()) {
    j["tool_calls"].push_back({{"id", c.id()},
                               {"type", "function"},
                               {"function", {{"name", c.name()}, {"arguments", c.arguments()}}}});
  }
  return j;
}

// tools, tool_choice and parallel_tool_calls in the HTTP API's shape.
std::optional<frontend::ApiError> AddTools(const pv1::GenerateRequest& request,
                                           ordered_json& body) {
  for (int i = 0; i < request.tools_size(); ++i) {
    const pv1::Tool& tool = request.tools(i);
    ordered_json function = {{"name", tool.name()}};
    if (!tool.description().empty()) function["description"] = tool.description();
    if (!tool.parameters_json().empty()) {
      const std::string where = absl::StrCat("tools[", i, "].function.parameters");
      auto parameters = ParseJsonText(tool.parameters_json(), where, where, "tools");
      if (auto* error = std::get_if<frontend::ApiError>(&parameters)) return *error;
      function["parameters"] = std::move(std::get<ordered_json>(parameters));
    }
    body["tools"].push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  if (request.has_tool_choice()) body["tool_choice"] = request.tool_choice();
  if (request.has_tool_choice_function()) {
    body["tool_choice"] = {{"type", "function"},
                           {"function", {{"name", request.tool_choice_function()}}}};
  }
  if (request.has_parallel_tool_calls()) {
    body["parallel_tool_calls"] = request.parallel_tool_calls();
  }
  return std::nullopt;
}

// response_format in the HTTP API's shape; frontend::ParseRequest checks it.
std::optional<frontend::ApiError> AddResponseFormat(const pv1::ResponseFormat& format,
                                                    ordered_json& body) {
  ordered_json out = {{"type", format.type()}};
  if (format.has_json_schema()) {
    const pv1::JsonSchemaFormat& spec = format.json_schema();
    ordered_json j = {{"name", spec.name()}};
    if (spec.has_description()) j["description"] = spec.description();
    if (!spec.schema_json().empty()) {
      auto schema = ParseJsonText(spec.schema_json(), "'response_format.json_schema.schema'",
                                  "response_format.json_schema.schema", "response_format");
      if (auto* error = std::get_if<frontend::ApiError>(&schema)) return *error;
      j["schema"] = std::move(std::get<ordered_json>(schema));
    }
    if (spec.has_strict()) j["strict"] = spec.strict();
    out["json_schema"] = std::move(j);
  }
  body["response_format"] = std::move(out);
  return std::nullopt;
}

// The chat fields: messages, the thinking knobs, tools, response_format.
std::optional<frontend::ApiError> AddChat(const pv1::GenerateRequest& request, ordered_json& body) {
  body["messages"] = ordered_json::array();
  for (const pv1::ChatMessage& m : request.chat().messages()) {
    body["messages"].push_back(ChatMessageJson(m));
  }
  // DeepSeek's own switch, which carries the gRPC field's name into the HTTP parser's errors.
  if (request.has_thinking()) {
    body["thinking"] = {{"type", request.thinking() ? "enabled" : "disabled"}};
  }
  if (request.has_reasoning_effort()) body["reasoning_effort"] = request.reasoning_effort();
  if (request.has_continue_final_message()) {
    body["continue_final_message"] = request.continue_final_message();
  }
  if (auto error = AddTools(request, body)) return error;
  if (request.has_response_format()) return AddResponseFormat(request.response_format(), body);
  return std::nullopt;
}

// Sampling, stops and logprobs, shared by both prompt forms.
void AddSampling(const pv1::GenerateRequest& request, bool chat, ordered_json& body) {
  if (request.has_n()) body["n"] = request.n();
  if (request.has_max_tokens()) body["max_tokens"] = request.max_tokens();
  if (request.has_temperature()) body["temperature"] = request.temperature();
  if (request.has_top_p()) body["top_p"] = request.top_p();
  if (request.has_top_k()) body["top_k"] = request.top_k();
  if (request.has_min_p()) body["min_p"] = request.min_p();
  if (request.has_presence_penalty()) body["presence_penalty"] = request.presence_penalty();
  if (request.has_frequency_penalty()) body["frequency_penalty"] = request.frequency_penalty();
  if (request.has_repetition_penalty()) body["repetition_penalty"] = request.repetition_penalty();
  if (!request.logit_bias().empty()) {
    ordered_json bias = ordered_json::object();
    for (const auto& [id, value] : request.logit_bias()) bias[std::to_string(id)] = value;
    body["logit_bias"] = bias;
  }
  // The HTTP API's seed is a signed 64-bit integer whose bits key the generator; the same bits
  // here, so every uint64 is accepted and 2^64 - 1 samples as HTTP's -1.
  if (request.has_seed()) body["seed"] = static_cast<int64_t>(request.seed());
  if (!request.stop().empty()) {
    body["stop"] = std::vector<std::string>(request.stop().begin(), request.stop().end());
  }
  if (!request.stop_token_ids().empty()) {
    body["stop_token_ids"] =
        std::vector<int32_t>(request.stop_token_ids().begin(), request.stop_token_ids().end());
  }
  if (request.has_min_tokens()) body["min_tokens"] = request.min_tokens();
  if (request.has_logprobs()) {
    if (chat) {
      body["logprobs"] = true;
      body["top_logprobs"] = request.logprobs();
    } else {
      body["logprobs"] = request.logprobs();
    }
  }
}

}  // namespace

std::variant<std::string, frontend::ApiError> ToOpenAiJson(const pv1::GenerateRequest& request,
                                                           frontend::Endpoint* endpoint) {
  const bool chat = request.prompt_case() == pv1::GenerateRequest::kChat;
  *endpoint = chat ? frontend::Endpoint::kChatCompletions : frontend::Endpoint::kCompletions;
  if (auto error = CheckFinite(request)) return *error;
  if (auto error = CheckChatOnly(request)) return *error;
  // Ordered: the tools' and the schema's properties keep the order the client wrote them in
  // (the prompt shows them, the output generates them, in that order).
  ordered_json body;
  body["model"] = request.model();
  if (chat) {
    if (auto error = AddChat(request, body)) return *error;
  } else if (request.prompt_case() == pv1::GenerateRequest::kTokenIds) {
    if (request.token_ids().ids().empty()) {
      return frontend::InvalidRequest("'token_ids' must hold at least one token id", "token_ids");
    }
    body["prompt"] =
        std::vector<int32_t>(request.token_ids().ids().begin(), request.token_ids().ids().end());
  } else {
    body["prompt"] = request.text();
  }
  AddSampling(request, chat, body);
  body["stream"] = true;
  return body.dump();
}

namespace {

// An error about an HTTP body field that the proto names otherwise names the proto's field:
// chat's `top_logprobs` is GenerateRequest.logprobs, a completion's `prompt` is `token_ids` or
// `text` (param and the quoted name in the message; the rest of the message is the HTTP front's).
void NameGrpcField(const pv1::GenerateRequest& request, frontend::ApiError* error) {
  std::string field;
  if (error->param == "top_logprobs" && request.prompt_case() == pv1::GenerateRequest::kChat) {
    field = "logprobs";
  } else if (error->param == "prompt" && request.prompt_case() == pv1::GenerateRequest::kTokenIds) {
    field = "token_ids";
  } else if (error->param == "prompt" && request.prompt_case() == pv1::GenerateRequest::kText) {
    field = "text";
  } else {
    return;
  }
  error->message = absl::StrReplaceAll(
      error->message, {{absl::StrCat("'", error->param, "'"), absl::StrCat("'", field, "'")}});
  error->param = field;
}

}  // namespace

frontend::ParsedRequest ParseGenerateRequest(const pv1::GenerateRequest& request,
                                             frontend::Endpoint* endpoint) {
  std::variant<std::string, frontend::ApiError> body = ToOpenAiJson(request, endpoint);
  if (auto* error = std::get_if<frontend::ApiError>(&body)) return *error;
  // Each JSON text field has passed its own kMaxJsonDepth check (ParseJsonText, naming the
  // field); the body wraps the deepest of them, a tool's parameters, kJsonTextWrapLevels deep, and
  // nothing else in the proto nests that far. So the body's own check allows those levels more:
  // otherwise a field within its limit would be refused as "request body".
  frontend::ParsedRequest parsed = frontend::ParseRequest(*endpoint, std::get<std::string>(body),
                                                          kMaxJsonDepth + kJsonTextWrapLevels);
  if (auto* api = std::get_if<frontend::ApiRequest>(&parsed)) api->front = frontend::Front::kGrpc;
  if (auto* error = std::get_if<frontend::ApiError>(&parsed)) NameGrpcField(request, error);
  return parsed;
}

}  // namespace pdserve::router
