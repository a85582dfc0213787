#include "common/json_depth.h"

#include "absl/strings/str_cat.h"

namespace pdserve {

bool JsonNestsDeeperThan(std::string_view text, int limit) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped byte (a '"' or a '\\') neither ends the string nor escapes another
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > limit) return true;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return false;
}

absl::Status CheckJsonDepth(std::string_view text, absl::string_view what) {
  if (!JsonNestsDeeperThan(text, kMaxJsonDepth)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " nests deeper than ", kMaxJsonDepth, " JSON levels"));
}

}  // namespace pdserve
