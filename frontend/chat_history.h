// Checks of a chat request's conversation as a whole, after each message was read on its own
// (frontend/api_request.cc): every tool result answers a call of the assistant message before it
// and every call is answered, an assistant message says something, and the conversation ends
// where an answer can start (a user, tool or system message, or an assistant message the request
// continues). OpenAI (and DeepSeek's API) answer 400 for the tool-call, tool-result and
// empty-message cases too. docs/chat-format.md.
//
// Pure function; thread-safe.
#pragma once

#include <optional>

#include "frontend/api_request.h"

namespace pdserve::frontend {

// The 400 for the first inconsistency of `req.messages` (naming "messages[i]"), or nullopt:
//  - a tool message without tool_call_id, or whose id is not among the tool_calls of the latest
//    assistant message before it (or with no assistant message before it), or that answers a
//    call another tool message already answered;
//  - two tool calls of one assistant message with the same id;
//  - a tool call of an assistant message (not the last message) that no tool message answers
//    before the next assistant message or the end (the chat format matches results to calls by
//    position);
//  - an assistant message with neither content nor tool_calls nor reasoning_content;
//  - a last message that is an assistant message, unless req.continue_final_message;
//  - continue_final_message where the last message is not an assistant message right after a
//    user or tool message, has tool_calls, or with tool_choice "required" / a named function or
//    response_format json (their grammar starts at a new answer's first token).
// REQUIRES: req is a chat request with at least one message.
std::optional<ApiError> CheckChatHistory(const ApiRequest& req);

}  // namespace pdserve::frontend
