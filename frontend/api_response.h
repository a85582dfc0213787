// OpenAI-compatible response bodies: whole JSON responses and SSE stream chunks for
// /v1/completions ("text_completion") and /v1/chat/completions ("chat.completion" /
// "chat.completion.chunk"), including usage and logprobs in each endpoint's own shape. JSON
// objects keep insertion order, so /v1/completions' top_logprobs dicts list the most likely
// token first.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frontend/api_request.h"

namespace pdserve::frontend {

struct TokenLogprob {
  std::string token;  // the token's text; a partial UTF-8 sequence decodes to U+FFFD
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;  // most likely alternatives, best first
  // The raw bytes the token contributes to the text (Tokenizer::AppendTokenBytes): a partial
  // UTF-8 sequence's own bytes, so a client can join several tokens into one character. Empty:
  // the bytes of `token`. top_bytes[i] likewise for top[i] (empty vector: top's texts).
  std::string bytes;
  std::vector<std::string> top_bytes;
};

// A tool call the model made, released whole (its invoke block was complete).
struct ToolCallDelta {
  int index = 0;   // position among the choice's tool calls
  std::string id;  // "call_" + 24 hex digits
  std::string name;
  std::string arguments;  // JSON object text
};

// Text produced for one choice since the previous delta; finish_reason set on the last one.
struct ChoiceDelta {
  int index = 0;
  std::string text;  // answer text (chat: the message content)
  std::vector<TokenLogprob> logprobs;
  std::optional<std::string> finish_reason;  // "stop", "length", "degenerate", ...
  // Set once the degeneration detector flagged the choice (guards/), on this delta and every
  // later one: the kind ("repeat", "whitespace", "empty"; "unknown" from an older worker). The
  // JSON choice then carries "degenerate": true and "degeneration_kind": kind; absent otherwise.
  std::optional<std::string> degeneration_kind;
  // Chat: reasoning text (message.reasoning_content, thinking mode) and tool calls.
  std::string reasoning;
  std::vector<ToolCallDelta> tool_calls;

  // Whether the delta has anything for the client: text, reasoning, tool calls, logprobs or a
  // finish. Empty deltas (a token held back by the detokenizer) are not sent.
  bool HasPayload() const {
    return !text.empty() || !reasoning.empty() || !tool_calls.empty() || !logprobs.empty() ||
           finish_reason.has_value();
  }
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Of completion_tokens, those generated inside the reasoning (chat: reported as
  // usage.completion_tokens_details.reasoning_tokens).
  int64_t reasoning_tokens = 0;
};

// Identity of one response: "cmpl-..." / "chatcmpl-..." id, creation time (Unix seconds),
// served model name.
struct ResponseMeta {
  std::string id;
  int64_t created = 0;
  std::string model;
};

// One SSE event "data: {...}\n\n" carrying `delta`. For chat, `first` adds the
// {"role": "assistant"} delta OpenAI sends before the content. `text_offset`: where this delta's
// first token starts in the choice's text (the sum of StreamTextLength over its earlier deltas):
// /v1/completions' logprobs.text_offset counts from the start, as in the whole response.
std::string StreamChunk(const ApiRequest& req, const ResponseMeta& meta, const ChoiceDelta& delta,
                        bool first, size_t text_offset = 0);
// How far `delta` advances its choice's text_offset: the length of its logprobs' token texts.
size_t StreamTextLength(const ChoiceDelta& delta);
// The final usage-only chunk sent when stream_options.include_usage is true.
std::string StreamUsageChunk(const ApiRequest& req, const ResponseMeta& meta, const Usage& usage);
// An error event inside an already started stream, then the client must not expect [DONE].
std::string StreamErrorEvent(const ApiError& error);
inline constexpr const char* kStreamDone = "data: [DONE]\n\n";

// Appends `delta` to the accumulated choice `into` (text, reasoning, tool calls, logprobs,
// finish_reason, degeneration): a non-streamed response is its deltas joined.
void AppendDelta(ChoiceDelta delta, ChoiceDelta& into);

// The whole non-streaming response; `choices[i]` is choice i's concatenated deltas. Written
// straight into the returned string (no JSON tree of the choices: its peak memory is about the
// text's size plus the choices'), byte-identical to FullResponseTree.
std::string FullResponse(const ApiRequest& req, const ResponseMeta& meta,
                         const std::vector<ChoiceDelta>& choices, const Usage& usage);
// The same response built as a JSON tree and dumped: the reference FullResponse is tested
// against (tests/frontend/api_response_writer_test.cc). Several times the memory of the text.
std::string FullResponseTree(const ApiRequest& req, const ResponseMeta& meta,
                             const std::vector<ChoiceDelta>& choices, const Usage& usage);

// A new response id: prefix + 24 random hex digits.
std::string NewResponseId(Endpoint endpoint);
// A new tool call id: "call_" + 24 random hex digits.
std::string NewToolCallId();

}  // namespace pdserve::frontend
