// Constrained decoding: the token mask of one decode step under a byte grammar
// (structured/byte_grammar.h): response_format json_object / json_schema and tool_choice
// "required" / a named function (docs/structured-output.md).
//
// Per step, the allowed tokens are those whose bytes the grammar accepts from the choice's state,
// found in one pass over the vocabulary trie; the end ids (EOS, stop ids) are allowed exactly
// when the output is complete. The output is kept closable
// within max_tokens: a token is allowed only if the shortest completion after it (in bytes, each
// byte a single-byte token of the vocabulary) fits in the tokens left after it; once the budget
// binds, the choice is steered along its shortest completion.
//
// The accepted tokens of a state (with each one's shortest completion) are cached per state, so
// a long string costs one trie walk, not one per token.
//
// Thread-safety: GrammarConstraint is shared by a request's choices; FillMask and Accept may be
// called concurrently (the cache has its own mutex). A GrammarMatcher belongs to one choice.
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
#include "structured/byte_grammar.h"
#include "structured/token_vocabulary.h"

namespace pdserve::structured {

class GrammarConstraint {
 public:
  GrammarConstraint(std::shared_ptr<const ByteGrammar> grammar,
                    std::shared_ptr<const TokenVocabulary> vocabulary)
      : grammar_(std::move(grammar)), vocabulary_(std::move(vocabulary)) {}
  // The constraint of response_format: `schema_text` is a JSON Schema (kJsonObjectSchema for
  // json_object). Errors: InvalidArgument from JsonSchema::Parse.
  static absl::StatusOr<std::shared_ptr<GrammarConstraint>> ForJsonSchema(
      std::string_view schema_text, std::shared_ptr<const TokenVocabulary> vocabulary);
  // The constraint of tool_choice "required" / a named function: `spec_text` as
  // ToolCallGrammar::Parse reads it. Errors: InvalidArgument from it.
  static absl::StatusOr<std::shared_ptr<GrammarConstraint>> ForToolCalls(
      std::string_view spec_text, std::shared_ptr<const TokenVocabulary> vocabulary);

  // A matcher at the start of the output.
  GrammarMatcher Start() const { return GrammarMatcher(grammar_); }

  // Sets `allowed` to the bitset of the tokens the next step may take (bit t of word t / 64),
  // over [0, vocab_size) words-rounded; `remaining`: tokens the choice may still generate, this
  // one included (>= 1). Errors: FailedPrecondition when no token continues the output (a
  // vocabulary without the bytes it needs).
  absl::Status FillMask(const GrammarMatcher& matcher, int64_t remaining,
                        std::span<const int32_t> end_ids, int64_t vocab_size,
                        std::vector<uint64_t>* allowed);

  // Advances `matcher` by `token`'s bytes; false (matcher unchanged) when the grammar refuses
  // them or the token has none (special tokens).
  bool Accept(GrammarMatcher& matcher, int32_t token) const;

  const TokenVocabulary& vocabulary() const { return *vocabulary_; }

 private:
  // The tokens one state accepts, ordered by the shortest completion after each.
  struct Accepted {
    std::vector<int32_t> tokens;
    std::vector<int64_t> min_after;  // nondecreasing
    std::vector<uint64_t> bits;      // all of `tokens`
  };
  std::shared_ptr<const Accepted> Lookup(const MatcherState& state);
  std::shared_ptr<const Accepted> Walk(const MatcherState& state) const;

  std::shared_ptr<const ByteGrammar> grammar_;
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const Accepted>> cache_ ABSL_GUARDED_BY(mu_);
  int64_t cached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::structured
