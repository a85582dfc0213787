// Chat formats: turning a conversation into prompt token ids, natively (no Jinja).
//
// A model directory names its format (LoadChatFormat); an unknown or missing one is an error at
// startup, never a silent fallback. Control tokens (role markers, BOS/EOS, thinking markers) come
// from the tokenizer files and must be single added tokens of the tokenizer. Message content is
// always encoded as plain text, so a user typing "<｜User｜>" cannot forge a turn.
//
// Thread-safety: ChatFormat implementations are immutable; Render/EncodeChat may run concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "text/chat_output_parser.h"
#include "text/tokenizer.h"

namespace pdserve::text {

// One tool call of an assistant turn, as the OpenAI API carries it.
struct ChatToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  std::string reasoning_content;         // assistant only: the thinking text, if any
  std::vector<ChatToolCall> tool_calls;  // assistant only
  std::string tool_call_id;              // tool only: the call this result answers
};

// Where the answer starts when the request continues the conversation's last message, an
// assistant message (vLLM's `continue_final_message`, DeepSeek's `"prefix": true`): that turn is
// rendered open (no EOS) and the answer is its continuation.
enum class ChatContinuation {
  kNone,       // a new assistant turn after the last message (a user or tool message)
  kContent,    // the answer continues the last message's content
  kReasoning,  // thinking mode, the last message has no content and no tool calls: the answer
               // continues its reasoning (the turn is left open inside <think>)
};

struct ChatOptions {
  bool thinking = false;  // thinking mode (the model reasons inside <think>...</think>)
  ChatContinuation continuation = ChatContinuation::kNone;
  bool add_bos = true;
  // reasoning_effort "max": in thinking mode the prompt opens with DeepSeek's instruction
  // paragraph (REASONING_EFFORT_MAX of encoding_dsv4.py).
  bool reasoning_effort_max = false;
  // The request's tools: each tool's "function" object (name, description, parameters), in the
  // request's key order. Non-empty: the tools section goes after the first system message's
  // content (a system message is added in front when the conversation has none), and reasoning
  // of earlier assistant turns is kept.
  std::vector<nlohmann::ordered_json> tools;
};

// One run of prompt text: a control token (exactly one added token) or plain content.
struct ChatSegment {
  std::string text;
  bool control = false;
};

class ChatFormat {
 public:
  virtual ~ChatFormat() = default;
  virtual std::string_view name() const = 0;
  // Renders `messages` to prompt segments (generation prompt included after a final user, tool
  // or system message; with options.continuation, the final assistant turn left open instead).
  // Errors: InvalidArgument for an unknown role, an empty conversation, tool-call arguments that
  // are JSON but not an object, or a continuation the conversation cannot take (the last message
  // is not an assistant message right after a user or tool message, it has tool calls, or
  // kReasoning without thinking or with content).
  virtual absl::StatusOr<std::vector<ChatSegment>> Render(std::span<const ChatMessage> messages,
                                                          const ChatOptions& options) const = 0;
  // Control tokens that cannot occur in the assistant's answer to a prompt rendered with
  // `options` (the answer ends with EOS, which is not among them): a model that samples one has
  // left the format (e.g. writes a user question of its own, then a second think_end).
  virtual std::vector<std::string> ControlTokensNotInAnswer(const ChatOptions& options) const = 0;
  // How to split an answer to a prompt rendered with `options` (markers of this format);
  // `parse_tools`: read tool-call blocks as tool calls.
  virtual ChatOutputOptions AnswerOptions(const ChatOptions& options, bool parse_tools) const = 0;
};

// The token strings a DeepSeek-V4 style format uses.
struct DeepSeekV4Tokens {
  std::string bos = "<｜begin▁of▁sentence｜>";
  std::string eos = "<｜end▁of▁sentence｜>";
  std::string user = "<｜User｜>";
  std::string assistant = "<｜Assistant｜>";
  std::string think_begin = "<think>";
  std::string think_end = "</think>";
  // The DSML marker of tool-call blocks. Rendered as a control token only where the tokenizer
  // has it as an added token (`dsml_is_token`), otherwise as plain text.
  std::string dsml = "｜DSML｜";
  bool dsml_is_token = false;
};

// DeepSeek-V4's chat encoding (encoding/encoding_dsv4.py of the model repository, encode_messages
// with drop_thinking=True): tools and tool results in DSML, thinking on and off, reasoning_effort
// max. See docs/chat-format.md for the exact layout.
class DeepSeekV4ChatFormat : public ChatFormat {
 public:
  explicit DeepSeekV4ChatFormat(DeepSeekV4Tokens tokens) : tokens_(std::move(tokens)) {}
  std::string_view name() const override { return "deepseek_v4"; }
  absl::StatusOr<std::vector<ChatSegment>> Render(std::span<const ChatMessage> messages,
                                                  const ChatOptions& options) const override;
  // BOS, both role markers and think_begin; think_end too unless the answer opens in its
  // reasoning (AnswerOpensInReasoning: then the answer closes its reasoning with think_end; else
  // the prompt already has it).
  std::vector<std::string> ControlTokensNotInAnswer(const ChatOptions& options) const override;
  ChatOutputOptions AnswerOptions(const ChatOptions& options, bool parse_tools) const override;
  const DeepSeekV4Tokens& tokens() const { return tokens_; }

 private:
  DeepSeekV4Tokens tokens_;
};

// Whether the answer to a prompt rendered with `options` opens inside its reasoning: thinking
// mode, unless it continues the content of the last message.
bool AnswerOpensInReasoning(const ChatOptions& options);

// Chooses the chat format of `model_dir`, in this order:
//  1. tokenizer_config.json "pdserve_chat_format": "deepseek_v4", or
//     {"name": "deepseek_v4", "tokens": {"user": ..., "assistant": ..., "think_begin": ...,
//      "think_end": ...}} to name other role tokens (BOS/EOS come from bos_token/eos_token);
//  2. the file encoding/encoding_dsv4.py, which DeepSeek-V4 checkpoints ship instead of a Jinja
//     template -> deepseek_v4.
// Errors: FailedPrecondition when the directory has a chat_template we do not implement, names an
// unknown format, or has no format at all; FailedPrecondition when a control token is not a single
// added token of `tokenizer`.
absl::StatusOr<std::unique_ptr<ChatFormat>> LoadChatFormat(const std::filesystem::path& model_dir,
                                                           const Tokenizer& tokenizer);

// Encodes rendered segments: control segments become their token id, adjacent plain segments
// are joined and encoded with allow_special=false and no post-processor tokens.
// Errors: FailedPrecondition for a control segment that is not a token; as Tokenizer::Encode.
absl::StatusOr<std::vector<int32_t>> EncodeChat(const Tokenizer& tokenizer,
                                                std::span<const ChatSegment> segments);

// The ids of format.ControlTokensNotInAnswer(options) in `tokenizer` (tokens it lacks are left
// out), for suppressing them while sampling a chat answer (docs/chat-format.md).
std::vector<int32_t> ControlTokenIdsNotInAnswer(const ChatFormat& format,
                                                const Tokenizer& tokenizer,
                                                const ChatOptions& options);

// The prompt as one string (control and plain text concatenated), for logs and docs.
std::string JoinSegments(std::span<const ChatSegment> segments);

}  // namespace pdserve::text
