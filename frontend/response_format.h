// The chat request's response_format (OpenAI): text, json_object, or json_schema with a JSON
// Schema, read into the schema the sampler enforces (structured/json_constraint.h).
//
// Pure function; thread-safe.
#pragma once

#include <string>
#include <string_view>
#include <variant>

#include "frontend/api_request.h"
#include "nlohmann/json.hpp"

namespace pdserve::frontend {

// The JSON Schema (compact JSON text) that `value` asks the output to satisfy: "" for
// {"type": "text"}, structured::kJsonObjectSchema for {"type": "json_object"}, the compiled
// schema's text for {"type": "json_schema", "json_schema": {"name", "schema", "strict", ...}}.
// A 400 naming response_format when the value is malformed or the schema uses a keyword that
// cannot be enforced (the message names it and where it is). `body`: the request's JSON text,
// read again for the schema with its properties in the order the client wrote them (the order
// they are generated in; `value` comes from a parse that sorts keys). REQUIRES: `body` passed
// CheckJsonDepth (common/json_depth.h; ParseRequest checks it), as re-parsing it as ordered_json
// may copy every level recursively.
std::variant<std::string, ApiError> ReadResponseFormat(const nlohmann::json& value,
                                                       std::string_view body);

}  // namespace pdserve::frontend
