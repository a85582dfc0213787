// A chat request's prompt: its messages and options in the chat format's terms, rendered and
// encoded (the tool-call opening appended when tool_choice forces a call). Shared by
// RequestPreparer and the request fuzzer; needs only the text library.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "frontend/api_request.h"
#include "text/chat_format.h"
#include "text/tokenizer.h"

namespace pdserve::frontend {

// The chat format options of `req`: thinking (ThinkingOn), reasoning_effort max, its tools
// unless tool_choice is "none" (then the model is not offered them), and the continuation of the
// last message under continue_final_message.
text::ChatOptions ChatOptionsOf(const ApiRequest& req);

// The prompt ids of chat request `req`. Errors: InvalidArgument from ChatFormat::Render; as
// text::EncodeChat.
absl::StatusOr<std::vector<int32_t>> ChatPromptTokens(const text::ChatFormat& format,
                                                      const text::Tokenizer& tokenizer,
                                                      const ApiRequest& req);

}  // namespace pdserve::frontend
