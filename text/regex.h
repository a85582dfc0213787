// A compiled PCRE2 regular expression (UTF + UCP, JIT-compiled) with Oniguruma-compatible syntax.
//
// Hugging Face `tokenizers` runs Split patterns with Oniguruma; PCRE2 differs in two places that
// tokenizer.json patterns use, so Compile() rewrites them: `\s`/`\S` also cover U+0085 (NEL),
// which Oniguruma counts as white space and PCRE2's UCP \s does not, and `\uXXXX` escapes become
// `\x{XXXX}`. The cross-check tests (tests/text) prove equality on DeepSeek's patterns.
//
// Thread-safety: a Regex is immutable after Compile(); FindAll may run concurrently (match data
// and JIT stack are per thread).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::text {

class Regex {
 public:
  // A byte range [begin, end) of the subject.
  struct Match {
    size_t begin;
    size_t end;
  };

  // Compiles `pattern` (Oniguruma syntax as found in tokenizer.json). `literal` compiles the
  // pattern as a plain string. Errors: InvalidArgument with PCRE2's message and offset.
  static absl::StatusOr<Regex> Compile(std::string_view pattern, bool literal = false);

  // Appends every non-empty, non-overlapping match in `subject`, left to right.
  // REQUIRES: `subject` is valid UTF-8 (not re-checked, for speed). Errors: ResourceExhausted
  // when PCRE2 fails (match or stack limit) rather than silently leaving text unmatched.
  absl::Status FindAll(std::string_view subject, std::vector<Match>* matches) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct CodeDeleter {
    void operator()(void* code) const;
  };
  Regex(std::string pattern, std::shared_ptr<void> code)
      : pattern_(std::move(pattern)), code_(std::move(code)) {}

  std::string pattern_;
  std::shared_ptr<void> code_;  // pcre2_code_8, shared so Regex is copyable.
};

// Rewrites the Oniguruma-only constructs described above into PCRE2 syntax. Exposed for tests.
// Errors: Unimplemented for `\S` inside a character class.
absl::StatusOr<std::string> OnigurumaToPcre2(std::string_view pattern);

}  // namespace pdserve::text
