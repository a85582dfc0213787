#include "text/chat_format.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/ordered_json.h"
#include "common/status.h"
#include "text/python_json.h"

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

// The instruction reasoning_effort "max" puts in front of a thinking-mode prompt.
constexpr std::string_view kReasoningEffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n";

// One part of a user turn: text, or a tool result (wrapped in <tool_result>).
struct UserPart {
  std::string text;
  bool tool_result = false;
  std::string tool_call_id;
};

// A message after DeepSeek's preprocessing: tool results become parts of user turns.
struct Turn {
  std::string role;                      // system, user, assistant
  const ChatMessage* message = nullptr;  // system / assistant
  std::vector<UserPart> parts;           // user
};

// merge_tool_messages: consecutive user and tool messages form one user turn whose parts are
// joined by blank lines.
std::vector<Turn> MergeTurns(std::span<const ChatMessage> messages) {
  std::vector<Turn> turns;
  for (const ChatMessage& m : messages) {
    if (m.role == "user" || m.role == "tool") {
      if (turns.empty() || turns.back().role != "user") turns.push_back({"user", nullptr, {}});
      turns.back().parts.push_back({m.content, m.role == "tool", m.tool_call_id});
    } else {
      turns.push_back({m.role, &m, {}});
    }
  }
  return turns;
}

// sort_tool_results_by_call_order: the tool results of a user turn follow the order of the
// calls of the latest assistant turn with tool calls (unknown ids rank as the first call, a
// repeated id as its first call). Each result's rank is looked up once, in a hash map: a 4 MiB
// request holds about 30,000 calls and results.
void SortToolResults(std::vector<Turn>& turns) {
  std::unordered_map<std::string_view, size_t> rank_of_id;
  for (Turn& t : turns) {
    if (t.role == "assistant" && !t.message->tool_calls.empty()) {
      rank_of_id.clear();
      const std::vector<ChatToolCall>& calls = t.message->tool_calls;
      for (size_t i = 0; i < calls.size(); ++i) {
        if (!calls[i].id.empty()) rank_of_id.emplace(calls[i].id, i);
      }
      continue;
    }
    if (t.role != "user" || rank_of_id.empty()) continue;
    std::vector<std::pair<size_t, UserPart>> results;  // (rank, result)
    for (UserPart& p : t.parts) {
      if (!p.tool_result) continue;
      const auto it = rank_of_id.find(p.tool_call_id);
      results.emplace_back(it == rank_of_id.end() ? 0 : it->second, std::move(p));
    }
    std::stable_sort(results.begin(), results.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    size_t next = 0;
    for (UserPart& p : t.parts) {
      if (p.tool_result) p = std::move(results[next++].second);
    }
  }
}

void Dsml(const DeepSeekV4Tokens& tokens, SegmentWriter& out) {
  if (tokens.dsml_is_token) {
    out.Control(tokens.dsml);
  } else {
    out.Plain(tokens.dsml);
  }
}

// The tools section (TOOLS_TEMPLATE of encoding_dsv4.py) with each tool's schema on one line.
void WriteTools(const DeepSeekV4Tokens& tokens, const std::vector<nlohmann::ordered_json>& tools,
                SegmentWriter& out) {
  std::string schemas;
  for (const nlohmann::ordered_json& tool : tools) {
    if (!schemas.empty()) schemas += "\n";
    schemas += PythonJsonDumps(tool);
  }
  // {D}: the DSML marker, {TS} / {TE}: think begin / end, {S}: the schemas, one per line.
  static constexpr std::string_view kTemplate =
      "## Tools\n\nYou have access to a set of tools to help answer the user's question. You "
      "can invoke tools by writing a \"<{D}tool_calls>\" block like the following:\n\n"
      "<{D}tool_calls>\n<{D}invoke name=\"$TOOL_NAME\">\n<{D}parameter name=\"$PARAMETER_NAME\" "
      "string=\"true|false\">$PARAMETER_VALUE</{D}parameter>\n...\n</{D}invoke>\n"
      "<{D}invoke name=\"$TOOL_NAME2\">\n...\n</{D}invoke>\n</{D}tool_calls>\n\n"
      "String parameters should be specified as is and set `string=\"true\"`. For all other "
      "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
      "`string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by {TS}), you MUST output "
      "your complete reasoning inside {TS}...{TE} BEFORE any tool calls or final response.\n\n"
      "Otherwise, output directly after {TE} with tool calls or final response.\n\n"
      "### Available Tool Schemas\n\n{S}\n\nYou MUST strictly follow the above defined tool "
      "name and parameter schemas to invoke tool calls.\n";
  std::string_view rest = kTemplate;
  while (!rest.empty()) {
    const size_t open = rest.find('{');
    out.Plain(rest.substr(0, open));
    if (open == std::string_view::npos) break;
    const size_t close = rest.find('}', open);
    const std::string_view key = rest.substr(open + 1, close - open - 1);
    if (key == "D") {
      Dsml(tokens, out);
    } else if (key == "TS") {
      out.Control(tokens.think_begin);
    } else if (key == "TE") {
      out.Control(tokens.think_end);
    } else {
      out.Plain(schemas);
    }
    rest.remove_prefix(close + 1);
  }
}

// An assistant turn's tool calls as a DSML tool_calls block (encode_arguments_to_dsml).
absl::Status WriteToolCalls(const DeepSeekV4Tokens& tokens, std::span<const ChatToolCall> calls,
                            SegmentWriter& out) {
  auto tag = [&](std::string_view before, std::string_view after) {
    out.Plain(before);
    Dsml(tokens, out);
    out.Plain(after);
  };
  tag("\n\n<", "tool_calls>\n");
  for (size_t i = 0; i < calls.size(); ++i) {
    if (i > 0) out.Plain("\n");
    tag("<", absl::StrCat("invoke name=\"", calls[i].name, "\">\n"));
    // Checked before the parse: rendering them below (PythonJsonDumps) recurses once per level.
    if (absl::Status depth = CheckJsonDepth(
            calls[i].arguments,
            absl::StrCat("chat: the arguments text of tool call '", calls[i].id, "'"));
        !depth.ok()) {
      return depth;
    }
    // Arguments that are not JSON travel as one string parameter named "arguments".
    nlohmann::ordered_json args = ParseOrderedJson(calls[i].arguments);
    if (args.is_discarded()) args = {{"arguments", calls[i].arguments}};
    if (!args.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat: arguments of tool call '", calls[i].id, "' must be a JSON object"));
    }
    bool first = true;
    for (auto it = args.begin(); it != args.end(); ++it) {
      if (!first) out.Plain("\n");
      first = false;
      const bool is_string = it.value().is_string();
      tag("<", absl::StrCat("parameter name=\"", it.key(), "\" string=\"",
                            is_string ? "true" : "false", "\">",
                            is_string ? it.value().get<std::string>() : PythonJsonDumps(it.value()),
                            "</"));
      Dsml(tokens, out);
      out.Plain("parameter>");
    }
    tag("\n</", "invoke>");
  }
  tag("\n</", "tool_calls>");
  return absl::OkStatus();
}

// A continued conversation (ChatOptions::continuation) ends with an assistant turn, without tool
// calls, right after a user turn (which opens it with the assistant marker; this format has no
// other way to open an assistant turn). kReasoning needs thinking mode and no content.
absl::Status CheckContinuation(const std::vector<Turn>& turns, const ChatOptions& options) {
  if (options.continuation == ChatContinuation::kNone) return absl::OkStatus();
  const size_t n = turns.size();
  if (turns[n - 1].role != "assistant" || n < 2 || turns[n - 2].role != "user") {
    return absl::InvalidArgumentError(
        "chat: only an assistant message right after a user or tool message can be continued");
  }
  const ChatMessage& last = *turns[n - 1].message;
  if (!last.tool_calls.empty()) {
    return absl::InvalidArgumentError(
        "chat: an assistant message with tool calls cannot be "
        "continued");
  }
  if (options.continuation == ChatContinuation::kReasoning &&
      (!options.thinking || !last.content.empty())) {
    return absl::InvalidArgumentError(
        "chat: continuing the reasoning needs thinking mode and a message without content");
  }
  return absl::OkStatus();
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
  for (const ChatMessage& m : messages) {
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
      return absl::InvalidArgumentError(absl::StrCat("chat: unsupported role '", m.role, "'"));
    }
  }
  // Request-level tools belong to a leading system message; one is added when there is none.
  std::vector<ChatMessage> with_system;
  if (!options.tools.empty() && messages[0].role != "system") {
    with_system.push_back({"system", "", "", {}, ""});
    with_system.insert(with_system.end(), messages.begin(), messages.end());
    messages = with_system;
  }
  std::vector<Turn> turns = MergeTurns(messages);
  SortToolResults(turns);
  PDSERVE_RETURN_IF_ERROR(CheckContinuation(turns, options));
  // encode_messages turns drop_thinking off when the conversation has tools.
  const bool keep_reasoning = !options.tools.empty();
  const int count = static_cast<int>(turns.size());
  int last_user = -1;
  for (int i = 0; i < count; ++i) {
    if (turns[i].role == "user") last_user = i;
  }
  SegmentWriter out;
  if (options.add_bos) out.Control(tokens_.bos);
  for (int i = 0; i < count; ++i) {
    const Turn& t = turns[i];
    if (i == 0 && options.thinking && options.reasoning_effort_max) out.Plain(kReasoningEffortMax);
    if (t.role == "system") {
      out.Plain(t.message->content);
      if (i == 0 && !options.tools.empty()) {
        out.Plain("\n\n");
        WriteTools(tokens_, options.tools, out);
      }
    } else if (t.role == "user") {
      out.Control(tokens_.user);
      for (size_t j = 0; j < t.parts.size(); ++j) {
        if (j > 0) out.Plain("\n\n");
        const UserPart& p = t.parts[j];
        out.Plain(p.tool_result ? absl::StrCat("<tool_result>", p.text, "</tool_result>") : p.text);
      }
    } else {
      // Reasoning of turns before the last user turn is dropped unless tools keep it.
      // The continued last turn stays open: no EOS, and in kReasoning no think_end either.
      const bool open = options.continuation != ChatContinuation::kNone && i + 1 == count;
      if (options.thinking && (keep_reasoning || i > last_user)) {
        out.Plain(t.message->reasoning_content);
        // kReasoning: the content is empty (CheckContinuation), nothing follows the reasoning.
        if (!open || options.continuation != ChatContinuation::kReasoning) {
          out.Control(tokens_.think_end);
        }
      }
      out.Plain(t.message->content);
      if (!t.message->tool_calls.empty()) {
        PDSERVE_RETURN_IF_ERROR(WriteToolCalls(tokens_, t.message->tool_calls, out));
      }
      if (!open) out.Control(tokens_.eos);
    }
    const bool next_is_assistant = i + 1 < count && turns[i + 1].role == "assistant";
    // A last system message opens the answer too: the module adds the assistant marker only
    // after user turns, so its prompt would end inside the system text and the model would
    // continue the instructions (docs/chat-format.md). It comes after the last user turn, so
    // thinking mode opens <think> as after a last user turn.
    const bool opens_answer =
        (t.role == "user" && next_is_assistant) || (t.role != "assistant" && i + 1 == count);
    if (opens_answer) {
      out.Control(tokens_.assistant);
      const bool think = options.thinking && (keep_reasoning || i >= last_user);
      out.Control(think ? tokens_.think_begin : tokens_.think_end);
    }
  }
  return out.Take();
}

std::vector<std::string> DeepSeekV4ChatFormat::ControlTokensNotInAnswer(
    const ChatOptions& options) const {
  std::vector<std::string> out = {tokens_.bos, tokens_.user, tokens_.assistant,
                                  tokens_.think_begin};
  if (!AnswerOpensInReasoning(options)) out.push_back(tokens_.think_end);
  return out;
}

ChatOutputOptions DeepSeekV4ChatFormat::AnswerOptions(const ChatOptions& options,
                                                      bool parse_tools) const {
  ChatOutputOptions out;
  out.thinking = AnswerOpensInReasoning(options);
  out.tools = parse_tools;
  out.think_end = tokens_.think_end;
  out.dsml = tokens_.dsml;
  return out;
}

bool AnswerOpensInReasoning(const ChatOptions& options) {
  return options.thinking && options.continuation != ChatContinuation::kContent;
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
  tokens.dsml_is_token = tokenizer.added_vocabulary().TokenToId(tokens.dsml).has_value();
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
