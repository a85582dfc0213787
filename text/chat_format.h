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
#include "text/tokenizer.h"

namespace pdserve::text {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  std::string reasoning_content;  // assistant only: the thinking text, if any
};

struct ChatOptions {
  bool thinking = false;  // thinking mode (the model reasons inside <think>...</think>)
  bool add_bos = true;
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
  // Renders `messages` to prompt segments (generation prompt included after a final user turn).
  // Errors: InvalidArgument for an unknown role or an empty conversation.
  virtual absl::StatusOr<std::vector<ChatSegment>> Render(std::span<const ChatMessage> messages,
                                                          const ChatOptions& options) const = 0;
  // Control tokens that cannot occur in the assistant's answer to a prompt rendered with
  // `options` (the answer ends with EOS, which is not among them): a model that samples one has
  // left the format (e.g. writes a user question of its own, then a second think_end).
  virtual std::vector<std::string> ControlTokensNotInAnswer(const ChatOptions& options) const = 0;
};

// The token strings a DeepSeek-V4 style format uses.
struct DeepSeekV4Tokens {
  std::string bos = "<｜begin▁of▁sentence｜>";
  std::string eos = "<｜end▁of▁sentence｜>";
  std::string user = "<｜User｜>";
  std::string assistant = "<｜Assistant｜>";
  std::string think_begin = "<think>";
  std::string think_end = "</think>";
};

// DeepSeek-V4's chat encoding (encoding/encoding_dsv4.py of the model repository, encode_messages
// with drop_thinking=True, no tools): see docs/chat-format.md for the exact layout.
class DeepSeekV4ChatFormat : public ChatFormat {
 public:
  explicit DeepSeekV4ChatFormat(DeepSeekV4Tokens tokens) : tokens_(std::move(tokens)) {}
  std::string_view name() const override { return "deepseek_v4"; }
  absl::StatusOr<std::vector<ChatSegment>> Render(std::span<const ChatMessage> messages,
                                                  const ChatOptions& options) const override;
  // BOS, both role markers and think_begin; think_end too in non-thinking mode (the generation
  // prompt already ends with it). In thinking mode the answer closes its reasoning with think_end.
  std::vector<std::string> ControlTokensNotInAnswer(const ChatOptions& options) const override;
  const DeepSeekV4Tokens& tokens() const { return tokens_; }

 private:
  DeepSeekV4Tokens tokens_;
};

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
