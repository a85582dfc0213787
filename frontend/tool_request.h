// The tool-calling fields of a chat request (OpenAI's `tools`, `tool_choice` and an assistant
// message's `tool_calls`), read and checked for frontend/api_request.cc.
//
// Pure functions of their input; thread-safe.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "frontend/api_request.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {

// `tools`: an array of {"type": "function", "function": {"name", "description"?, "parameters"?,
// "strict"?}}; appends each "function" object (key order kept). Errors: 400 naming "tools".
// REQUIRES: `tools` nests at most kMaxJsonDepth levels (common/json_depth.h; ParseRequest checks
// the body), as each function is copied, which recurses once per level.
std::optional<ApiError> ReadTools(const nlohmann::ordered_json& tools,
                                  std::vector<nlohmann::ordered_json>* out);

// `tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}.
// The named function must be one of `tools`; "required" and a name need tools.
// Errors: 400 naming "tool_choice".
std::optional<ApiError> ReadToolChoice(const nlohmann::json& choice,
                                       const std::vector<nlohmann::ordered_json>& tools,
                                       ApiRequest* req);

// An assistant message's `tool_calls`: [{"id", "type": "function", "function": {"name",
// "arguments"}}]. `where` names the message in errors ("messages[2]"). Errors: 400 "messages",
// also for arguments (JSON text) nesting deeper than kMaxJsonDepth (common/json_depth.h).
std::optional<ApiError> ReadToolCalls(const nlohmann::json& calls, const std::string& where,
                                      std::vector<ToolCall>* out);

}  // namespace pdserve::frontend
