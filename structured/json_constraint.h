// Constrained decoding of JSON: the token mask of one decode step (response_format json_object /
// json_schema; docs/structured-output.md).
//
// Per step, the allowed tokens are those whose bytes the automaton (structured/json_matcher.h)
// accepts from the choice's state, found in one pass over the vocabulary trie; the end ids
// (EOS, stop ids) are allowed exactly when the document is complete. The output is kept closable
// within max_tokens: a token is allowed only if the shortest completion after it (in bytes, each
// byte a single-byte token of the vocabulary) fits in the tokens left after it; once the budget
// binds, the choice is steered along its shortest completion.
//
// The accepted tokens of a state (with each one's shortest completion) are cached per state, so
// a long string costs one trie walk, not one per token.
//
// Thread-safety: JsonConstraint is shared by a request's choices; FillMask and Accept may be
// called concurrently (the cache has its own mutex). A JsonMatcher belongs to one choice.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "structured/json_matcher.h"
#include "structured/json_schema.h"
#include "structured/token_vocabulary.h"

namespace pdserve::structured {

class JsonConstraint {
 public:
  // Compiles `schema_text` (a JSON Schema; kJsonObjectSchema for json_object). Errors:
  // InvalidArgument from JsonSchema::Parse.
  static absl::StatusOr<std::shared_ptr<JsonConstraint>> Create(
      std::string_view schema_text, std::shared_ptr<const TokenVocabulary> vocabulary);

  // A matcher at the start of the document.
  JsonMatcher Start() const { return JsonMatcher(schema_); }

  // Sets `allowed` to the bitset of the tokens the next step may take (bit t of word t / 64),
  // over [0, vocab_size) words-rounded; `remaining`: tokens the choice may still generate, this
  // one included (>= 1). Errors: FailedPrecondition when no token continues the document (a
  // vocabulary without the bytes it needs).
  absl::Status FillMask(const JsonMatcher& matcher, int64_t remaining,
                        std::span<const int32_t> end_ids, int64_t vocab_size,
                        std::vector<uint64_t>* allowed);

  // Advances `matcher` by `token`'s bytes; false (matcher unchanged) when the automaton refuses
  // them or the token has none (special tokens).
  bool Accept(JsonMatcher& matcher, int32_t token) const;

  const TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  // The tokens one state accepts, ordered by the shortest completion after each.
  struct Accepted {
    std::vector<int32_t> tokens;
    std::vector<int64_t> min_after;  // nondecreasing
    std::vector<uint64_t> bits;      // all of `tokens`
  };
  JsonConstraint(std::shared_ptr<const JsonSchema> schema,
                 std::shared_ptr<const TokenVocabulary> vocabulary)
      : schema_(std::move(schema)), vocabulary_(std::move(vocabulary)) {}
  std::shared_ptr<const Accepted> Lookup(const MatcherState& state);
  std::shared_ptr<const Accepted> Walk(const MatcherState& state) const;

  std::shared_ptr<const JsonSchema> schema_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Accepted>> cache_ ABSL_GUARDED_BY(mu_);
  int64_t cached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::structured
