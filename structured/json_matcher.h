// The byte-level pushdown automaton of a compiled JSON Schema (structured/json_schema.h): which
// bytes may come next, and how short the rest of the document can be.
//
// A state is a set of stacks (structured/byte_grammar.h; anyOf makes the automaton
// nondeterministic). A stack holds one frame per value being read: the document, objects, arrays,
// strings, numbers and literals (enum / const / true / false / null).
//
// Bounded by construction: at most kMaxWhitespace whitespace bytes in a row between tokens of
// the document, none before or after it (JsonGrammar; a value embedded in another grammar may
// have up to kMaxWhitespace before it); numbers of at most kMaxIntegerDigits / kMaxFractionDigits /
// kMaxExponentDigits digits; strings of valid UTF-8 with JSON's escapes (\uD800-\uDFFF refused);
// free-form values nested at most kMaxNesting deep.
//
// Thread-safety: JsonGrammar is immutable; share freely.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "absl/status/statusor.h"
#include "structured/byte_grammar.h"
#include "structured/json_schema.h"

namespace pdserve::structured {

inline constexpr int kMaxWhitespace = 4;
inline constexpr uint32_t kMaxIntegerDigits = 16;
inline constexpr uint32_t kMaxFractionDigits = 16;
// Two exponent digits keep every number finite as a double (at most 10^(16 + 99)).
inline constexpr uint32_t kMaxExponentDigits = 2;

// Steps `in` by `byte` into `out` (cleared first); false when no stack accepts the byte.
bool StepState(const JsonSchema& schema, const MatcherState& in, uint8_t byte, MatcherState* out);
// The fewest bytes that complete the document from `state` (0: it is complete).
int64_t MinCompletionBytes(const MatcherState& state);

// For grammars that embed JSON values (structured/tool_call_grammar.h): a stack is `below` (frames
// of the embedding grammar, copied unchanged) followed by a JSON stack whose bottom is a document
// frame.
//
// The document frame of a value of `node` before its first byte.
Frame JsonDocumentFrame(const SchemaNode& node);
// What a stack of a state costs to complete, in bytes (a grammar's own measure).
using StackCostFn = std::function<int64_t(std::span<const Frame>)>;
// Steps the JSON stack `stack` by `byte`, appending each stack it becomes, `below` under it, to
// `out` (not deduplicated; at most kMaxStacks in all, those that `stack_cost` finds cheapest, so
// that the shortest completion stays reachable). `schema`: the schema `stack`'s nodes belong to.
void StepJsonStack(const JsonSchema& schema, std::span<const Frame> below,
                   std::span<const Frame> stack, uint8_t byte, MatcherState* out,
                   const StackCostFn& stack_cost);
// The fewest bytes that complete the value of the JSON stack `stack` (0: it is complete).
int64_t JsonStackCompletionBytes(std::span<const Frame> stack);

// The grammar of the documents `schema` accepts.
class JsonGrammar : public ByteGrammar {
 public:
  explicit JsonGrammar(std::shared_ptr<const JsonSchema> schema) : schema_(std::move(schema)) {}
  // Compiles `schema_text` (JsonSchema::Parse; its errors).
  static absl::StatusOr<std::shared_ptr<const JsonGrammar>> Parse(std::string_view schema_text);

  MatcherState Start() const override;
  bool Step(const MatcherState& in, uint8_t byte, MatcherState* out) const override {
    return StepState(*schema_, in, byte, out);
  }
  int64_t MinCompletionBytes(const MatcherState& state) const override {
    return structured::MinCompletionBytes(state);
  }
  const JsonSchema& schema() const { return *schema_; }

 private:
  std::shared_ptr<const JsonSchema> schema_;
};

// A matcher at the start of a document of `schema`.
inline GrammarMatcher StartJson(std::shared_ptr<const JsonSchema> schema) {
  return GrammarMatcher(std::make_shared<JsonGrammar>(std::move(schema)));
}

}  // namespace pdserve::structured
