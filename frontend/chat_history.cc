#include "frontend/chat_history.h"

#include <string>
#include <string_view>
#include <unordered_map>
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

// Which tool message answers each call of one assistant message, found in one pass over the
// conversation with the ids in a hash map: a 4 MiB request holds about 30,000 calls and results,
// and comparing each result with each call costs seconds of the front's CPU.
struct CallAnswers {
  size_t message = 0;                                 // the assistant message
  std::unordered_map<std::string_view, size_t> call;  // id -> index in its tool_calls
  std::vector<size_t> answered_by;                    // per call: the tool message, or 0
};

// The calls' ids must differ: a result names its call by id, and two calls of one id would
// share one result while the format shows the model one result per call, by position.
std::optional<ApiError> IndexCalls(const ApiRequest& req, size_t i, CallAnswers& calls) {
  const std::vector<ToolCall>& tool_calls = req.messages[i].tool_calls;
  calls.message = i;
  calls.call.clear();
  calls.answered_by.assign(tool_calls.size(), 0);
  for (size_t c = 0; c < tool_calls.size(); ++c) {
    if (tool_calls[c].id.empty()) continue;
    auto [it, added] = calls.call.emplace(tool_calls[c].id, c);
    if (added) continue;
    return InvalidRequest(
        absl::StrCat(Where(i), ": tool_calls[", c, "] has the id '", Shown(tool_calls[c].id),
                     "' of tool_calls[", it->second,
                     "]; each call needs an id of its own, which its tool message answers"),
        "messages");
  }
  return std::nullopt;
}

// Tool message `i` must answer a call of the latest assistant message before it (`calls`, null
// when there is none) that no tool message answered yet.
std::optional<ApiError> CheckToolResult(const ApiRequest& req, size_t i, CallAnswers* calls) {
  const ChatMessage& m = req.messages[i];
  if (m.tool_call_id.empty()) {
    return InvalidRequest(
        absl::StrCat(Where(i),
                     ": a tool message needs 'tool_call_id', the id of the call it "
                     "answers"),
        "messages");
  }
  if (calls == nullptr) {
    return InvalidRequest(absl::StrCat(Where(i),
                                       ": a tool message must answer a tool call of an earlier "
                                       "assistant message, and no assistant message comes before "
                                       "it"),
                          "messages");
  }
  const auto it = calls->call.find(m.tool_call_id);
  if (it == calls->call.end()) {
    return InvalidRequest(
        absl::StrCat(Where(i), ": tool_call_id '", Shown(m.tool_call_id),
                     "' is not among the tool_calls of the assistant message before it (",
                     Where(calls->message), ")"),
        "messages");
  }
  size_t& answered_by = calls->answered_by[it->second];
  if (answered_by != 0) {
    return InvalidRequest(
        absl::StrCat(Where(i), ": tool call '", Shown(m.tool_call_id), "' of ",
                     Where(calls->message), " is already answered by ", Where(answered_by),
                     "; each call takes one tool message (the format shows the model one result "
                     "per call, by position)"),
        "messages");
  }
  answered_by = i;
  return std::nullopt;
}

// The calls of an assistant message must each be answered by a tool message before the next
// assistant message (or the end): the chat format renders results in the order of the calls and
// without their ids, so the model matches them by position, and a missing one would have it read
// the next result as the answer to the unanswered call (docs/chat-format.md).
std::optional<ApiError> CheckCallsAnswered(const ApiRequest& req, const CallAnswers& calls) {
  const size_t i = calls.message;
  size_t end = i + 1;
  while (end < req.messages.size() && req.messages[end].role != "assistant") ++end;
  const std::vector<ToolCall>& tool_calls = req.messages[i].tool_calls;
  for (size_t c = 0; c < tool_calls.size(); ++c) {
    if (calls.answered_by[c] != 0) continue;
    const std::string call = tool_calls[c].id.empty()
                                 ? absl::StrCat("tool_calls[", c, "] (it has no 'id')")
                                 : absl::StrCat("tool call '", Shown(tool_calls[c].id), "'");
    return InvalidRequest(
        absl::StrCat(Where(i), ": ", call, " has no tool message answering it ",
                     end < req.messages.size() ? absl::StrCat("before ", Where(end))
                                               : std::string("after it"),
                     "; every tool call needs a tool message with its 'tool_call_id' before the "
                     "next assistant message or the end of the conversation"),
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
  std::vector<CallAnswers> answers;  // one per assistant message, in order
  for (size_t i = 0; i < req.messages.size(); ++i) {
    const ChatMessage& m = req.messages[i];
    if (m.role == "tool") {
      if (auto error = CheckToolResult(req, i, answers.empty() ? nullptr : &answers.back())) {
        return error;
      }
    }
    if (m.role == "assistant" && m.content_null && m.tool_calls.empty() &&
        m.reasoning_content.empty()) {
      return InvalidRequest(
          absl::StrCat(Where(i), ": an assistant message needs 'content' or 'tool_calls'"),
          "messages");
    }
    if (m.role == "assistant") {
      if (auto error = IndexCalls(req, i, answers.emplace_back())) return error;
    }
  }
  // After the checks of each message: a tool message that answers no call is named as such.
  for (const CallAnswers& calls : answers) {
    if (calls.message + 1 == req.messages.size()) continue;
    if (auto error = CheckCallsAnswered(req, calls)) return error;
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
