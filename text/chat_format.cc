#include "text/chat_format.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

class SegmentWriter {
 public:
  void Control(const std::string& token) { segments_.push_back({token, true}); }
  void Plain(std::string_view text) {
    if (text.empty()) return;
    if (!segments_.empty() && !segments_.back().control) {
      segments_.back().text.append(text);
    } else {
      segments_.push_back({std::string(text), false});
    }
  }
  std::vector<ChatSegment> Take() { return std::move(segments_); }

 private:
  std::vector<ChatSegment> segments_;
};

// encoding_dsv4.py merges consecutive user messages into one turn joined by blank lines.
std::vector<ChatMessage> MergeUserRuns(std::span<const ChatMessage> messages) {
  std::vector<ChatMessage> merged;
  for (const ChatMessage& m : messages) {
    if (m.role == "user" && !merged.empty() && merged.back().role == "user") {
      merged.back().content += "\n\n" + m.content;
    } else {
      merged.push_back(m);
    }
  }
  return merged;
}

absl::Status CheckControlToken(const Tokenizer& tokenizer, const std::string& token,
                               const char* what) {
  if (!tokenizer.added_vocabulary().TokenToId(token)) {
    return absl::FailedPreconditionError(absl::StrCat("chat format: ", what, " token '", token,
                                                      "' is not an added token of the tokenizer"));
  }
  return absl::OkStatus();
}

absl::StatusOr<DeepSeekV4Tokens> V4Tokens(const TokenizerConfig& config, const json& overrides) {
  DeepSeekV4Tokens tokens;
  if (config.bos_token) tokens.bos = *config.bos_token;
  if (config.eos_token) tokens.eos = *config.eos_token;
  if (overrides.is_null()) return tokens;
  try {
    for (const auto& [key, value] : overrides.items()) {
      std::string* field = key == "user"          ? &tokens.user
                           : key == "assistant"   ? &tokens.assistant
                           : key == "think_begin" ? &tokens.think_begin
                           : key == "think_end"   ? &tokens.think_end
                                                  : nullptr;
      if (field == nullptr) {
        return absl::FailedPreconditionError("pdserve_chat_format: unknown token key " + key);
      }
      *field = value.get<std::string>();
    }
  } catch (const json::exception& e) {
    return absl::FailedPreconditionError(absl::StrCat("pdserve_chat_format tokens: ", e.what()));
  }
  return tokens;
}

}  // namespace

absl::StatusOr<std::vector<ChatSegment>> DeepSeekV4ChatFormat::Render(
    std::span<const ChatMessage> messages, const ChatOptions& options) const {
  if (messages.empty()) return absl::InvalidArgumentError("chat: no messages");
  const std::vector<ChatMessage> turns = MergeUserRuns(messages);
  int last_user = -1;
  for (int i = 0; i < static_cast<int>(turns.size()); ++i) {
    if (turns[i].role == "user") last_user = i;
  }
  SegmentWriter out;
  if (options.add_bos) out.Control(tokens_.bos);
  for (int i = 0; i < static_cast<int>(turns.size()); ++i) {
    const ChatMessage& m = turns[i];
    if (m.role == "system") {
      out.Plain(m.content);
    } else if (m.role == "user") {
      out.Control(tokens_.user);
      out.Plain(m.content);
    } else if (m.role == "assistant") {
      // Reasoning of turns before the last user message is dropped (drop_thinking); a turn after
      // it keeps its reasoning, closed by think_end.
      if (options.thinking && i > last_user) {
        out.Plain(m.reasoning_content);
        out.Control(tokens_.think_end);
      }
      out.Plain(m.content);
      out.Control(tokens_.eos);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("chat: unsupported role '", m.role, "'"));
    }
    const bool next_is_assistant =
        i + 1 < static_cast<int>(turns.size()) && turns[i + 1].role == "assistant";
    const bool last = i + 1 == static_cast<int>(turns.size());
    if (m.role == "user" && (next_is_assistant || last)) {
      out.Control(tokens_.assistant);
      out.Control(options.thinking && i >= last_user ? tokens_.think_begin : tokens_.think_end);
    }
  }
  return out.Take();
}

std::vector<std::string> DeepSeekV4ChatFormat::ControlTokensNotInAnswer(
    const ChatOptions& options) const {
  std::vector<std::string> out = {tokens_.bos, tokens_.user, tokens_.assistant,
                                  tokens_.think_begin};
  if (!options.thinking) out.push_back(tokens_.think_end);
  return out;
}

std::vector<int32_t> ControlTokenIdsNotInAnswer(const ChatFormat& format,
                                                const Tokenizer& tokenizer,
                                                const ChatOptions& options) {
  std::vector<int32_t> ids;
  for (const std::string& token : format.ControlTokensNotInAnswer(options)) {
    if (const std::optional<int32_t> id = tokenizer.TokenToId(token)) ids.push_back(*id);
  }
  return ids;
}

absl::StatusOr<std::unique_ptr<ChatFormat>> LoadChatFormat(const std::filesystem::path& model_dir,
                                                           const Tokenizer& tokenizer) {
  const TokenizerConfig& config = tokenizer.config();
  std::string name;
  json overrides;
  if (!config.pdserve_chat_format.is_null()) {
    const json& marker = config.pdserve_chat_format;
    if (marker.is_string()) {
      name = marker.get<std::string>();
    } else if (marker.is_object() && marker.contains("name") && marker["name"].is_string()) {
      name = marker["name"].get<std::string>();
      overrides = marker.value("tokens", json());
    } else {
      return absl::FailedPreconditionError(
          "pdserve_chat_format: expected a name or an object "
          "with \"name\"; got " +
          marker.dump());
    }
  } else if (std::filesystem::exists(model_dir / "encoding" / "encoding_dsv4.py")) {
    name = "deepseek_v4";
  } else if (config.chat_template) {
    return absl::FailedPreconditionError(absl::StrCat(
        "chat format: ", model_dir.string(),
        " has a chat_template pdserve does not implement; set \"pdserve_chat_format\" in "
        "tokenizer_config.json to a supported format (deepseek_v4)"));
  } else {
    return absl::FailedPreconditionError(absl::StrCat(
        "chat format: ", model_dir.string(),
        " names no chat format (no pdserve_chat_format, no encoding/encoding_dsv4.py)"));
  }
  if (name != "deepseek_v4") {
    return absl::FailedPreconditionError(
        absl::StrCat("chat format: unknown format '", name, "' (supported: deepseek_v4)"));
  }
  PDSERVE_ASSIGN_OR_RETURN(DeepSeekV4Tokens tokens, V4Tokens(config, overrides));
  for (const auto& [token, what] : {std::pair{&tokens.bos, "bos"},
                                    {&tokens.eos, "eos"},
                                    {&tokens.user, "user"},
                                    {&tokens.assistant, "assistant"},
                                    {&tokens.think_begin, "think_begin"},
                                    {&tokens.think_end, "think_end"}}) {
    PDSERVE_RETURN_IF_ERROR(CheckControlToken(tokenizer, *token, what));
  }
  return std::make_unique<DeepSeekV4ChatFormat>(std::move(tokens));
}

absl::StatusOr<std::vector<int32_t>> EncodeChat(const Tokenizer& tokenizer,
                                                std::span<const ChatSegment> segments) {
  std::vector<int32_t> ids;
  std::string plain;
  auto flush = [&]() -> absl::Status {
    if (plain.empty()) return absl::OkStatus();
    PDSERVE_ASSIGN_OR_RETURN(
        std::vector<int32_t> part,
        tokenizer.Encode(plain, {.add_special_tokens = false, .allow_special = false}));
    ids.insert(ids.end(), part.begin(), part.end());
    plain.clear();
    return absl::OkStatus();
  };
  for (const ChatSegment& segment : segments) {
    if (!segment.control) {
      plain += segment.text;
      continue;
    }
    PDSERVE_RETURN_IF_ERROR(flush());
    auto id = tokenizer.added_vocabulary().TokenToId(segment.text);
    if (!id) {
      return absl::FailedPreconditionError("chat: control text '" + segment.text +
                                           "' is not a token");
    }
    ids.push_back(*id);
  }
  PDSERVE_RETURN_IF_ERROR(flush());
  return ids;
}

std::string JoinSegments(std::span<const ChatSegment> segments) {
  std::string text;
  for (const ChatSegment& segment : segments) text += segment.text;
  return text;
}

}  // namespace pdserve::text
