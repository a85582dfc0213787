#include "frontend/chat_history.h"

#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pdserve::frontend {
namespace {

// A client's id, quoted in an error message: its first 64 bytes.
std::string Shown(std::string_view id) {
  constexpr size_t kShown = 64;
  return id.size() <= kShown ? std::string(id) : std::string(id.substr(0, kShown)) + "...";
}

std::string Where(size_t i) { return absl::StrCat("messages[", i, "]"); }

std::optional<ApiError> CheckToolResult(const ApiRequest& req, size_t i) {
  const ChatMessage& m = req.messages[i];
  if (m.tool_call_id.empty()) {
    return InvalidRequest(
        absl::StrCat(Where(i),
                     ": a tool message needs 'tool_call_id', the id of the call it "
                     "answers"),
        "messages");
  }
  size_t a = i;
  while (a > 0 && req.messages[a - 1].role != "assistant") --a;
  if (a == 0) {
    return InvalidRequest(absl::StrCat(Where(i),
                                       ": a tool message must answer a tool call of an earlier "
                                       "assistant message, and no assistant message comes before "
                                       "it"),
                          "messages");
  }
  const ChatMessage& assistant = req.messages[a - 1];
  for (const ToolCall& call : assistant.tool_calls) {
    if (call.id == m.tool_call_id) return std::nullopt;
  }
  return InvalidRequest(
      absl::StrCat(Where(i), ": tool_call_id '", Shown(m.tool_call_id),
                   "' is not among the tool_calls of the assistant message before it (",
                   Where(a - 1), ")"),
      "messages");
}

// The calls of assistant message `i` must each be answered by a tool message before the next
// assistant message (or the end): the chat format renders results in the order of the calls and
// without their ids, so the model matches them by position, and a missing one would have it read
// the next result as the answer to the unanswered call (docs/chat-format.md).
std::optional<ApiError> CheckCallsAnswered(const ApiRequest& req, size_t i) {
  size_t end = i + 1;
  while (end < req.messages.size() && req.messages[end].role != "assistant") ++end;
  const std::vector<ToolCall>& calls = req.messages[i].tool_calls;
  for (size_t c = 0; c < calls.size(); ++c) {
    bool answered = false;
    for (size_t j = i + 1; j < end && !answered; ++j) {
      answered = req.messages[j].role == "tool" && !calls[c].id.empty() &&
                 req.messages[j].tool_call_id == calls[c].id;
    }
    if (answered) continue;
    const std::string call = calls[c].id.empty()
                                 ? absl::StrCat("tool_calls[", c, "] (it has no 'id')")
                                 : absl::StrCat("tool call '", Shown(calls[c].id), "'");
    return InvalidRequest(
        absl::StrCat(Where(i), ": ", call, " has no tool message answering it ",
                     end < req.messages.size() ? absl::StrCat("before ", Where(end))
                                               : std::string("after it"),
                     "; every tool call needs a tool message with its 'tool_call_id' before the "
                     "next assistant message"),
        "messages");
  }
  return std::nullopt;
}

std::optional<ApiError> CheckContinuation(const ApiRequest& req) {
  const size_t last = req.messages.size() - 1;
  const ChatMessage& m = req.messages[last];
  if (m.role != "assistant") {
    return InvalidRequest(
        absl::StrCat("'continue_final_message' needs the last message to be an assistant "
                     "message (the answer continues it); ",
                     Where(last), " is a '", m.role, "' message"),
        "continue_final_message");
  }
  if (!m.tool_calls.empty()) {
    return InvalidRequest(absl::StrCat(Where(last),
                                       ": an assistant message with tool_calls cannot be "
                                       "continued"),
                          "continue_final_message");
  }
  if (last == 0 ||
      (req.messages[last - 1].role != "user" && req.messages[last - 1].role != "tool")) {
    return InvalidRequest(
        absl::StrCat(Where(last),
                     ": only an assistant message right after a user or tool message can be "
                     "continued (the chat format opens an assistant turn only there)"),
        "continue_final_message");
  }
  const bool forced =
      req.tool_choice == ToolChoice::kRequired || req.tool_choice == ToolChoice::kNamed;
  if (forced || !req.json_schema.empty()) {
    return InvalidRequest(
        absl::StrCat(
            "'continue_final_message' cannot be combined with ",
            forced ? "'tool_choice' \"required\" or a named function" : "'response_format' json",
            ": the constrained output starts at a new answer's first token"),
        "continue_final_message");
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> CheckChatHistory(const ApiRequest& req) {
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const ChatMessage& m = req.messages[i];
    if (m.role == "tool") {
      if (auto error = CheckToolResult(req, i)) return error;
    }
    if (m.role == "assistant" && m.content_null && m.tool_calls.empty() &&
        m.reasoning_content.empty()) {
      return InvalidRequest(
          absl::StrCat(Where(i), ": an assistant message needs 'content' or 'tool_calls'"),
          "messages");
    }
  }
  // After the checks of each message: a tool message that answers no call is named as such.
  for (size_t i = 0; i + 1 < req.messages.size(); ++i) {
    if (req.messages[i].role != "assistant") continue;
    if (auto error = CheckCallsAnswered(req, i)) return error;
  }
  if (req.continue_final_message) return CheckContinuation(req);
  const size_t last = req.messages.size() - 1;
  if (req.messages[last].role == "assistant") {
    return InvalidRequest(
        absl::StrCat(Where(last),
                     ": the conversation ends with an assistant message, and the chat format "
                     "opens a new assistant turn only after a user or tool message. To continue "
                     "that message, set 'continue_final_message': true (or \"prefix\": true on "
                     "it); for a new answer, end with a user message"),
        "messages");
  }
  return std::nullopt;
}

}  // namespace pdserve::frontend
