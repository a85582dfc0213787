// Fuzzes ChatOutputParser with untrusted answer text. Input: one options byte (bit 0 thinking,
// bit 1 tools, bit 2 unused, bits 3..7 where to cut), then the text.
// Properties: whatever the cut (whole, two pieces, byte by byte), the joined reasoning, content
// and tool calls are the same; every tool call's arguments is a JSON object; without tools and
// thinking the content is the text itself.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "nlohmann/json.hpp"
#include "text/chat_output_parser.h"

namespace {

using pdserve::text::ChatOutputOptions;
using pdserve::text::ChatOutputParser;
using pdserve::text::ChatOutputPiece;

void Check(bool ok) {
  if (!ok) std::abort();
}

struct Joined {
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;
  bool operator==(const Joined&) const = default;
  void Take(const ChatOutputPiece& p) {
    reasoning += p.reasoning;
    content += p.content;
    for (const auto& c : p.tool_calls) calls.emplace_back(c.name, c.arguments);
  }
};

Joined Parse(const ChatOutputOptions& options, const std::vector<std::string_view>& pieces) {
  ChatOutputParser parser(options);
  Joined out;
  for (std::string_view p : pieces) out.Take(parser.Add(p));
  out.Take(parser.Finish());
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  ChatOutputOptions options;
  options.thinking = flags & 1;
  options.tools = flags & 2;
  const Joined whole = Parse(options, {text});
  const size_t cut = text.empty() ? 0 : (flags >> 3) * 37 % (text.size() + 1);
  Check(Parse(options, {text.substr(0, cut), text.substr(cut)}) == whole);
  std::vector<std::string_view> bytes;
  for (size_t i = 0; i < text.size(); ++i) bytes.push_back(text.substr(i, 1));
  Check(Parse(options, bytes) == whole);
  for (const auto& [name, arguments] : whole.calls) {
    const nlohmann::json args = nlohmann::json::parse(arguments, nullptr, false);
    Check(!args.is_discarded() && args.is_object());
  }
  if (!options.thinking && !options.tools) {
    Check(whole.content == text && whole.reasoning.empty());
  }
  return 0;
}
