// The OpenAI-compatible request schema pdserve accepts on /v1/completions and
// /v1/chat/completions, parsed and validated into one ApiRequest.
//
// Validation follows the OpenAI API: wrong JSON types and out-of-range values are rejected with
// HTTP 400 and an OpenAI-style error object naming the parameter, and so is a field that asks for
// something pdserve cannot do (audio output, predicted outputs, web search, the legacy
// `functions`). Fields the OpenAI SDK sends that change nothing here are accepted (user, metadata,
// store, service_tier, stream_options); other unknown fields are ignored and logged once per
// field name, as vLLM does. Extensions that vLLM and SGLang clients send are accepted too: top_k,
// min_p, repetition_penalty, min_tokens, ignore_eos, skip_special_tokens,
// chat_template_kwargs.thinking (alias enable_thinking), continue_final_message and
// add_generation_prompt (vLLM), and DeepSeek's own API's "thinking": {"type": "enabled" |
// "disabled"} and "prefix" on the last assistant message. The conversation is checked as a whole
// (frontend/chat_history.h). Absent sampling fields stay unset so that the model's
// generation_config.json supplies the defaults later.
//
// Pure functions of their input; thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/json_depth.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {

enum class Endpoint { kCompletions, kChatCompletions };
// The front a request came in through: the OpenAI HTTP API or the router's gRPC API
// (pdserve.v1.Generation/Generate). Both parse alike; the request metrics tell them apart.
enum class Front { kHttp, kGrpc };

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text, as the client sent it
};

struct ChatMessage {
  std::string role;                  // "system", "developer", "user", "assistant" or "tool"
  std::string content;               // text parts joined ("\n\n" between a tool message's parts)
  std::string reasoning_content;     // assistant: its reasoning, as returned by this API
  std::vector<ToolCall> tool_calls;  // assistant
  std::string tool_call_id;          // tool
  bool content_null = false;         // assistant: content absent or null (not "")
};

// tool_choice: "auto" (the model decides), "none" (tool calls are not parsed), "required" (the
// answer is a tool call), or a named function (a call of that function).
enum class ToolChoice { kAuto, kNone, kRequired, kNamed };

struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  Front front = Front::kHttp;
  std::string model;
  // Completions: the prompt as text, or as token ids (exactly one of the two is set).
  std::optional<std::string> prompt_text;
  std::optional<std::vector<int32_t>> prompt_tokens;
  // Chat completions.
  std::vector<ChatMessage> messages;
  // The answer continues the last message, an assistant message, instead of starting a new turn
  // (vLLM's `continue_final_message`, or DeepSeek's `"prefix": true` on that message); the
  // response carries only the continuation. docs/chat-format.md, "Continuing an assistant
  // message".
  bool continue_final_message = false;
  // response_format (frontend/response_format.h): the JSON Schema the output must satisfy, as
  // compact JSON; empty: text.
  std::string json_schema;
  // "thinking" ({"type": "enabled"} true, "disabled" false) or chat_template_kwargs.thinking
  // (they must agree when both are given); see ThinkingOn().
  std::optional<bool> thinking;
  // "none", "minimal", "low", "medium", "high" or "max"; "" when absent. "max" adds DeepSeek's
  // maximum-effort instruction in thinking mode; "none" turns thinking off.
  std::string reasoning_effort;
  // The tools' "function" objects ({"name", "description", "parameters", ...}) in the client's
  // key order: the prompt shows them as the client wrote them.
  std::vector<nlohmann::ordered_json> tools;
  ToolChoice tool_choice = ToolChoice::kAuto;
  std::string tool_choice_name;  // kNamed: the function
  bool parallel_tool_calls = true;

  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  int n = 1;
  std::optional<int64_t> max_tokens;
  std::optional<int64_t> min_tokens;
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> min_p;
  std::optional<double> presence_penalty;
  std::optional<double> frequency_penalty;
  std::optional<double> repetition_penalty;
  std::map<int32_t, double> logit_bias;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  // Completions: logprobs = number of top alternatives (0..20). Chat: logprobs true/false plus
  // top_logprobs (0..20). Both map onto: return logprobs, with `top_logprobs` alternatives.
  bool logprobs = false;
  int top_logprobs = 0;
  std::string user;
};

// Whether a chat request runs in thinking mode: `thinking` when given, else on
// when reasoning_effort is given (other than "none"); reasoning_effort "none" is always off.
bool ThinkingOn(const ApiRequest& req);

// An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
  std::string ToJson() const;
};

ApiError InvalidRequest(std::string message, std::string param = "", std::string code = "");
// 404 model_not_found naming `model`, cut to its first 256 bytes (at a UTF-8 character boundary,
// then "...") so that a request cannot make its error response megabytes long.
ApiError ModelNotFound(std::string_view model);
// Any other error: `http_status` (429, 500, 503, ...) with the given type and code.
ApiError ServerError(int http_status, std::string message, std::string type = "server_error",
                     std::string code = "");
// 401 invalid_api_key: a front with API keys got none, or a wrong one (docs/security.md).
ApiError InvalidApiKey();
// A stream a front ended because its client did not keep up (docs/operations.md, "Slow stream
// readers"): 408 with code "stream_stalled" (it took nothing for `idle_ms`) or "stream_too_slow"
// (`queued_bytes` were waiting for it).
ApiError StreamStalled(int64_t idle_ms);
ApiError StreamTooSlow(uint64_t queued_bytes);
// 503 shutting_down: a request a front ended or refused because its server is stopping.
ApiError ShuttingDown();

using ParsedRequest = std::variant<ApiRequest, ApiError>;

// Parses a request body for `endpoint`. Never throws; malformed JSON is a 400, and so is a body
// nesting deeper than `max_depth` JSON levels ("request body nests deeper than ..."; checked
// before any parse, common/json_depth.h). A client's body gets kMaxJsonDepth; a body the gRPC
// front built around JSON texts it checked on their own gets their wrapping levels more
// (router/grpc_request.h).
ParsedRequest ParseRequest(Endpoint endpoint, std::string_view body, int max_depth = kMaxJsonDepth);

}  // namespace pdserve::frontend
