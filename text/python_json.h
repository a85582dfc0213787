// JSON text in the layout of Python's json.dumps(value, ensure_ascii=False): ", " between items,
// ": " after keys, keys in the object's own order, non-ASCII characters written as they are.
//
// DeepSeek's encoding module (encoding/encoding_dsv4.py) writes tool schemas, tool-call
// arguments and the arguments it parses back out of model output this way, so a prompt or a
// parsed tool call equals the module's byte for byte only with this layout.
//
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <string_view>

#include "nlohmann/json.hpp"

namespace pdserve::text {

// `value` as json.dumps(value, ensure_ascii=False) writes it. Invalid UTF-8 in strings becomes
// U+FFFD (Python strings cannot hold it).
std::string PythonJsonDumps(const nlohmann::ordered_json& value);

// A string as a JSON string literal in the same layout (quotes included).
std::string PythonJsonString(std::string_view text);

}  // namespace pdserve::text
