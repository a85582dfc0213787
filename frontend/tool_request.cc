#include "frontend/tool_request.h"

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"

namespace pdserve::frontend {
namespace {

template <typename Json>
bool IsString(const Json& obj, const char* key) {
  return obj.is_object() && obj.contains(key) && obj[key].is_string();
}

}  // namespace

std::optional<ApiError> ReadTools(const nlohmann::ordered_json& tools,
                                  std::vector<nlohmann::ordered_json>* out) {
  if (!tools.is_array()) return InvalidRequest("'tools' must be an array", "tools");
  for (size_t i = 0; i < tools.size(); ++i) {
    const nlohmann::ordered_json& tool = tools[i];
    const std::string where = absl::StrCat("tools[", i, "]");
    if (!tool.is_object() || !IsString(tool, "type") || tool["type"] != "function") {
      return InvalidRequest(absl::StrCat(where, " must be {\"type\": \"function\", ...}"), "tools");
    }
    if (!tool.contains("function") || !tool["function"].is_object()) {
      return InvalidRequest(absl::StrCat(where, ".function must be an object"), "tools");
    }
    const nlohmann::ordered_json& function = tool["function"];
    if (!IsString(function, "name") || function["name"].get<std::string>().empty()) {
      return InvalidRequest(absl::StrCat(where, ".function.name must be a non-empty string"),
                            "tools");
    }
    if (function.contains("description") && !function["description"].is_string()) {
      return InvalidRequest(absl::StrCat(where, ".function.description must be a string"), "tools");
    }
    if (function.contains("parameters") && !function["parameters"].is_object()) {
      return InvalidRequest(absl::StrCat(where, ".function.parameters must be an object"), "tools");
    }
    out->push_back(function);
  }
  return std::nullopt;
}

std::optional<ApiError> ReadToolChoice(const nlohmann::json& choice,
                                       const std::vector<nlohmann::ordered_json>& tools,
                                       ApiRequest* req) {
  if (choice.is_string()) {
    const std::string mode = choice.get<std::string>();
    if (mode == "auto") {
      req->tool_choice = ToolChoice::kAuto;
    } else if (mode == "none") {
      req->tool_choice = ToolChoice::kNone;
    } else if (mode == "required") {
      req->tool_choice = ToolChoice::kRequired;
    } else {
      return InvalidRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or a function",
                            "tool_choice");
    }
  } else if (choice.is_object() && IsString(choice, "type") && choice["type"] == "function" &&
             choice.contains("function") && IsString(choice["function"], "name")) {
    req->tool_choice = ToolChoice::kNamed;
    req->tool_choice_name = choice["function"]["name"].get<std::string>();
    bool known = false;
    for (const auto& tool : tools) known = known || tool["name"] == req->tool_choice_name;
    if (!known) {
      return InvalidRequest(absl::StrCat("'tool_choice' names function '", req->tool_choice_name,
                                         "', which is not in 'tools'"),
                            "tool_choice");
    }
  } else {
    return InvalidRequest(
        "'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        "tool_choice");
  }
  if (tools.empty() && req->tool_choice != ToolChoice::kNone &&
      req->tool_choice != ToolChoice::kAuto) {
    return InvalidRequest("'tool_choice' requires 'tools'", "tool_choice");
  }
  return std::nullopt;
}

std::optional<ApiError> ReadToolCalls(const nlohmann::json& calls, const std::string& where,
                                      std::vector<ToolCall>* out) {
  if (!calls.is_array()) {
    return InvalidRequest(absl::StrCat(where, ".tool_calls must be an array"), "messages");
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    const nlohmann::json& call = calls[i];
    const std::string at = absl::StrCat(where, ".tool_calls[", i, "]");
    if (!call.is_object() || !call.contains("function") || !IsString(call["function"], "name") ||
        !IsString(call["function"], "arguments")) {
      return InvalidRequest(
          absl::StrCat(at,
                       " must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                       "\"arguments\"}} with string name and arguments"),
          "messages");
    }
    if (call.contains("id") && !call["id"].is_string()) {
      return InvalidRequest(absl::StrCat(at, ".id must be a string"), "messages");
    }
    // JSON inside a string, which the chat format parses to render the call in the prompt.
    const std::string& arguments = call["function"]["arguments"].get_ref<const std::string&>();
    if (absl::Status depth = CheckJsonDepth(arguments, absl::StrCat(at, ".function.arguments"));
        !depth.ok()) {
      return InvalidRequest(std::string(depth.message()), "messages");
    }
    out->push_back({IsString(call, "id") ? call["id"].get<std::string>() : "",
                    call["function"]["name"].get<std::string>(),
                    call["function"]["arguments"].get<std::string>()});
  }
  return std::nullopt;
}

}  // namespace pdserve::frontend
