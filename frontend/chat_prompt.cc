#include "frontend/chat_prompt.h"

#include <utility>

#include "common/status.h"

namespace pdserve::frontend {

text::ChatOptions ChatOptionsOf(const ApiRequest& req) {
  text::ChatOptions options;
  options.thinking = ThinkingOn(req);
  options.reasoning_effort_max = req.reasoning_effort == "max";
  if (req.tool_choice != ToolChoice::kNone) options.tools = req.tools;
  if (req.continue_final_message && !req.messages.empty()) {
    // docs/chat-format.md: in thinking mode a last message without content (and without tool
    // calls) continues in its reasoning; otherwise the answer continues its content.
    const ChatMessage& last = req.messages.back();
    options.continuation = options.thinking && last.content.empty() && last.tool_calls.empty()
                               ? text::ChatContinuation::kReasoning
                               : text::ChatContinuation::kContent;
  }
  return options;
}

absl::StatusOr<std::vector<int32_t>> ChatPromptTokens(const text::ChatFormat& format,
                                                      const text::Tokenizer& tokenizer,
                                                      const ApiRequest& req) {
  std::vector<text::ChatMessage> messages;
  for (const ChatMessage& m : req.messages) {
    text::ChatMessage& out = messages.emplace_back();
    out.role = m.role == "developer" ? "system" : m.role;
    out.content = m.content;
    out.reasoning_content = m.reasoning_content;
    out.tool_call_id = m.tool_call_id;
    for (const ToolCall& c : m.tool_calls) out.tool_calls.push_back({c.id, c.name, c.arguments});
  }
  PDSERVE_ASSIGN_OR_RETURN(std::vector<text::ChatSegment> segments,
                           format.Render(messages, ChatOptionsOf(req)));
  return text::EncodeChat(tokenizer, segments);
}

}  // namespace pdserve::frontend
