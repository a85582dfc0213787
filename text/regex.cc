#include "text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "absl/strings/str_cat.h"

namespace pdserve::text {
namespace {

// Per-thread match state: PCRE2 match data (one pair is enough: only the whole match is used)
// and a JIT stack large enough for long white-space runs in `\s+(?!\S)`.
struct ThreadMatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);

  ThreadMatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~ThreadMatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& MatchState() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

void Regex::CodeDeleter::operator()(void* code) const {
  pcre2_code_free(static_cast<pcre2_code*>(code));
}

absl::StatusOr<std::string> OnigurumaToPcre2(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 's') {
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      } else if (e == 'S') {
        if (in_class) {
          return absl::UnimplementedError(absl::StrCat(
              "regex: \\S inside a character class is not supported: ", std::string(pattern)));
        }
        out += "[^\\s\\x{85}]";
      } else if (e == 'u' && i + 5 < pattern.size()) {
        out += absl::StrCat("\\x{", std::string(pattern.substr(i + 2, 4)), "}");
        i += 4;
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

absl::StatusOr<Regex> Regex::Compile(std::string_view pattern, bool literal) {
  std::string translated(pattern);
  if (!literal) {
    auto rewritten = OnigurumaToPcre2(pattern);
    if (!rewritten.ok()) return rewritten.status();
    translated = *std::move(rewritten);
  }
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  // PCRE2_LITERAL admits no UCP (it has no character classes to apply it to).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                   translated.size(), options, &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return absl::InvalidArgumentError(absl::StrCat("regex '", std::string(pattern), "' at offset ",
                                                   error_offset, ": ",
                                                   reinterpret_cast<const char*>(message)));
  }
  // Without JIT (unsupported CPU) pcre2_match falls back to the interpreter with equal results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return Regex(std::string(pattern), std::shared_ptr<void>(code, CodeDeleter()));
}

absl::Status Regex::FindAll(std::string_view subject, std::vector<Match>* matches) const {
  ThreadMatchState& state = MatchState();
  auto* code = static_cast<const pcre2_code*>(code_.get());
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t start = 0;
  while (start < subject.size()) {
    const int rc = pcre2_match(code, data, subject.size(), start, PCRE2_NO_UTF_CHECK, state.data,
                               state.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      return absl::ResourceExhaustedError(
          absl::StrCat("regex '", pattern_, "': ", reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (end > begin) {
      matches->push_back({begin, end});
      start = end;
    } else {
      // Empty match: step over one whole UTF-8 character.
      start = begin + 1;
      while (start < subject.size() && (static_cast<uint8_t>(subject[start]) & 0xC0) == 0x80) {
        ++start;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::text
