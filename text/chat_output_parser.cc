#include "text/chat_output_parser.h"

#include <algorithm>
#include <initializer_list>
#include <optional>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "text/python_json.h"

namespace pdserve::text {
namespace {

enum class Parse { kNeedMore, kMalformed, kDone };

// The length of the longest end of `text` that is a proper beginning of `marker`: text that may
// still become the marker.
size_t HeldBack(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

bool IsPrefixOf(std::string_view text, std::string_view whole) {
  return text.size() < whole.size() && whole.substr(0, text.size()) == text;
}

// The first of `stops` in `text` from `pos` on: {which, where}, or nullopt when none occurs.
std::optional<std::pair<std::string_view, size_t>> ReadUntil(
    std::string_view text, size_t pos, std::initializer_list<std::string_view> stops) {
  std::optional<std::pair<std::string_view, size_t>> first;
  for (std::string_view stop : stops) {
    const size_t at = text.find(stop, pos);
    if (at != std::string_view::npos && (!first || at < first->second)) first = {stop, at};
  }
  return first;
}

// The DSML tags of one dialect (the marker is a token string such as "｜DSML｜").
struct Tags {
  explicit Tags(const std::string& dsml)
      : invoke_open(absl::StrCat("<", dsml, "invoke")),
        invoke_close(absl::StrCat("</", dsml, "invoke")),
        parameter_open(absl::StrCat("<", dsml, "parameter")),
        parameter_close(absl::StrCat("/", dsml, "parameter")),
        block_close(absl::StrCat("</", dsml, "tool_calls>")) {}
  std::string invoke_open, invoke_close, parameter_open, parameter_close, block_close;
};

// ` name="NAME">\n` (one more "\n" when the invoke has no parameters), leading whitespace allowed.
std::optional<std::string> InvokeName(std::string_view head) {
  const size_t start = head.find_first_not_of(" \t\r\n\f\v");
  if (start == std::string_view::npos || head.substr(start, 6) != "name=\"") return std::nullopt;
  head.remove_prefix(start + 6);
  for (std::string_view end : {"\">\n\n", "\">\n"}) {
    if (head.size() >= end.size() && head.ends_with(end)) {
      return std::string(head.substr(0, head.size() - end.size()));
    }
  }
  return std::nullopt;
}

// ` name="K" string="true|false">VALUE<`: {name, is_string, value}.
struct Parameter {
  std::string name;
  bool is_string = false;
  std::string value;
};
std::optional<Parameter> ParseParameter(std::string_view body) {
  if (!body.starts_with(" name=\"") || !body.ends_with("<")) return std::nullopt;
  body.remove_prefix(7);
  body.remove_suffix(1);
  for (size_t at = body.find("\" string=\""); at != std::string_view::npos;
       at = body.find("\" string=\"", at + 1)) {
    const std::string_view rest = body.substr(at + 10);
    for (const bool is_string : {true, false}) {
      const std::string_view flag = is_string ? "true\">" : "false\">";
      if (rest.starts_with(flag)) {
        return Parameter{std::string(body.substr(0, at)), is_string,
                         std::string(rest.substr(flag.size()))};
      }
    }
  }
  return std::nullopt;
}

// One invoke at the start of `text` (which begins with tags.invoke_open), through the ">\n" after
// its closing tag. The arguments are built as decode_dsml_to_arguments does.
Parse ParseInvoke(std::string_view text, const Tags& tags, ParsedToolCall* call, size_t* used) {
  size_t pos = tags.invoke_open.size();
  auto stop = ReadUntil(text, pos, {tags.parameter_open, tags.invoke_close});
  if (!stop) return Parse::kNeedMore;
  std::optional<std::string> name = InvokeName(text.substr(pos, stop->second - pos));
  if (!name) return Parse::kMalformed;
  std::vector<std::string> names;
  std::string arguments = "{";
  while (stop->first == tags.parameter_open) {
    pos = stop->second + stop->first.size();
    auto close = ReadUntil(text, pos, {tags.parameter_close});
    if (!close) return Parse::kNeedMore;
    std::optional<Parameter> p = ParseParameter(text.substr(pos, close->second - pos));
    if (!p || std::find(names.begin(), names.end(), p->name) != names.end()) {
      return Parse::kMalformed;
    }
    // nlohmann's accept() stops at a NUL byte ("0\0x" passes): NULs are refused first.
    if (!p->is_string &&
        (p->value.find('\0') != std::string::npos || !nlohmann::json::accept(p->value))) {
      return Parse::kMalformed;
    }
    absl::StrAppend(&arguments, names.empty() ? "" : ", ", PythonJsonString(p->name), ": ",
                    p->is_string ? PythonJsonString(p->value) : p->value);
    names.push_back(p->name);
    pos = close->second + close->first.size();
    stop = ReadUntil(text, pos, {tags.parameter_open, tags.invoke_close});
    if (!stop) return Parse::kNeedMore;
    if (text.substr(pos, stop->second - pos) != ">\n") return Parse::kMalformed;
  }
  pos = stop->second + stop->first.size();
  const std::string_view tail = text.substr(pos, 2);
  if (tail != ">\n") return IsPrefixOf(tail, ">\n") ? Parse::kNeedMore : Parse::kMalformed;
  call->name = std::move(*name);
  call->arguments = arguments + "}";
  *used = pos + 2;
  return Parse::kDone;
}

}  // namespace

ChatOutputParser::ChatOutputParser(ChatOutputOptions options)
    : options_(std::move(options)),
      block_start_(absl::StrCat("\n\n<", options_.dsml, "tool_calls")),
      state_(options_.thinking ? State::kReasoning : State::kContent) {}

ChatOutputPiece ChatOutputParser::Add(std::string_view text) {
  ChatOutputPiece piece;
  pending_.append(text);
  // Inside a tool-call block only a '>' or a newline can complete a tag: skip the re-parse of a
  // long argument value on every other piece.
  if (state_ == State::kToolBlock && text.find_first_of(">\n") == std::string_view::npos) {
    return piece;
  }
  Drain(/*at_end=*/false, piece);
  return piece;
}

ChatOutputPiece ChatOutputParser::Finish() {
  ChatOutputPiece piece;
  Drain(/*at_end=*/true, piece);
  return piece;
}

void ChatOutputParser::Drain(bool at_end, ChatOutputPiece& piece) {
  while (true) {
    if (state_ == State::kToolBlock) {
      if (!StepToolBlock(at_end, piece)) return;
      continue;
    }
    const bool reasoning = state_ == State::kReasoning;
    if (!reasoning && (!options_.tools || tools_off_)) {
      piece.content += pending_;
      pending_.clear();
      return;
    }
    const std::string& marker = reasoning ? options_.think_end : block_start_;
    std::string& out = reasoning ? piece.reasoning : piece.content;
    const size_t at = pending_.find(marker);
    if (at == std::string::npos) {
      const size_t release = pending_.size() - (at_end ? 0 : HeldBack(pending_, marker));
      out.append(pending_, 0, release);
      pending_.erase(0, release);
      return;
    }
    out.append(pending_, 0, at);
    pending_.erase(0, at + marker.size());
    if (reasoning) {
      state_ = State::kContent;
    } else {
      state_ = State::kToolBlock;
      block_raw_ = marker;
      block_header_read_ = false;
    }
  }
}

bool ChatOutputParser::StepToolBlock(bool at_end, ChatOutputPiece& piece) {
  const Tags tags(options_.dsml);
  if (!block_header_read_) {
    if (pending_.starts_with(">\n")) {
      pending_.erase(0, 2);
      block_raw_ += ">\n";
      block_header_read_ = true;
      return true;
    }
    if (!at_end && IsPrefixOf(pending_, ">\n")) return false;
    Malformed(piece);
    return true;
  }
  if (pending_.starts_with(tags.block_close)) {
    // The block is whole: its calls count, all of them together.
    pending_.erase(0, tags.block_close.size());
    for (ParsedToolCall& call : block_calls_) piece.tool_calls.push_back(std::move(call));
    block_calls_.clear();
    block_raw_.clear();
    state_ = State::kContent;
    return true;
  }
  if (pending_.starts_with(tags.invoke_open)) {
    ParsedToolCall call;
    size_t used = 0;
    switch (ParseInvoke(pending_, tags, &call, &used)) {
      case Parse::kDone:
        block_calls_.push_back(std::move(call));
        block_raw_.append(pending_, 0, used);
        pending_.erase(0, used);
        return true;
      case Parse::kNeedMore:
        if (!at_end) return false;
        break;
      case Parse::kMalformed:
        break;
    }
    Malformed(piece);
    return true;
  }
  if (!at_end &&
      (IsPrefixOf(pending_, tags.block_close) || IsPrefixOf(pending_, tags.invoke_open))) {
    return false;
  }
  Malformed(piece);
  return true;
}

void ChatOutputParser::Malformed(ChatOutputPiece& piece) {
  piece.content += block_raw_;
  piece.content += pending_;
  block_calls_.clear();
  block_raw_.clear();
  pending_.clear();
  state_ = State::kContent;
  // The rest of the answer is content too: how much of it had arrived when the block went wrong
  // depends on how the text was split, and the result must not.
  tools_off_ = true;
}

}  // namespace pdserve::text
