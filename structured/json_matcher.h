// The byte-level pushdown automaton of a compiled JSON Schema (structured/json_schema.h): which
// bytes may come next, and how short the rest of the document can be.
//
// A state is a set of stacks (anyOf makes the automaton nondeterministic; a stack per live
// reading, at most kMaxStacks, duplicates merged). A stack holds one frame per value being read:
// the document, objects, arrays, strings, numbers and literals (enum / const / true / false /
// null). Every stack in a state is a prefix of some document the schema accepts, so dropping
// stacks (the cap) never leads to a dead end.
//
// Bounded by construction: at most kMaxWhitespace whitespace bytes in a row between tokens of
// the document, none after it; numbers of at most kMaxIntegerDigits / kMaxFractionDigits /
// kMaxExponentDigits digits; strings of valid UTF-8 with JSON's escapes (\uD800-\uDFFF refused);
// free-form values nested at most kMaxNesting deep.
//
// Thread-safety: a JsonMatcher is a value; the schema it points to must outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "structured/json_schema.h"

namespace pdserve::structured {

inline constexpr int kMaxWhitespace = 4;
inline constexpr uint32_t kMaxIntegerDigits = 16;
inline constexpr uint32_t kMaxFractionDigits = 16;
// Two exponent digits keep every number finite as a double (at most 10^(16 + 99)).
inline constexpr uint32_t kMaxExponentDigits = 2;
inline constexpr size_t kMaxStacks = 16;

// One value being read. Plain bytes (no padding), so states compare and hash as bytes.
struct Frame {
  const SchemaNode* node = nullptr;
  uint32_t index = 0;  // object: next property; array: items begun; literal / key: position ...
  uint32_t a = 0;      // per kind: key candidate, literal range start, UTF-8 bounds ...
  uint32_t b = 0;
  uint8_t kind = 0;
  uint8_t phase = 0;
  uint8_t ws = 0;  // whitespace bytes read in a row at this frame
  uint8_t pad = 0;
};
static_assert(sizeof(Frame) == 24, "Frame must have no padding");

struct MatcherState {
  std::vector<Frame> frames;   // the stacks, bottom first, one after the other
  std::vector<uint16_t> ends;  // end offset of each stack in `frames`

  void Clear() {
    frames.clear();
    ends.clear();
  }
  bool empty() const { return ends.empty(); }
  // The state as bytes (a cache key).
  std::string Key() const;
};

// Steps `in` by `byte` into `out` (cleared first); false when no stack accepts the byte.
bool StepState(const JsonSchema& schema, const MatcherState& in, uint8_t byte, MatcherState* out);
// The fewest bytes that complete the document from `state` (0: it is complete).
int64_t MinCompletionBytes(const MatcherState& state);

class JsonMatcher {
 public:
  // The state before the document's first byte.
  explicit JsonMatcher(std::shared_ptr<const JsonSchema> schema);

  // Reads `byte`; false (and the state unchanged) when the document cannot continue with it.
  bool Advance(uint8_t byte);
  // Reads every byte of `bytes`; false (and the state unchanged) when one is refused.
  bool Advance(std::string_view bytes);
  // The bytes read form a whole document: only its end may follow (numbers may still grow).
  bool Complete() const { return MinCompletionBytes() == 0; }
  int64_t MinCompletionBytes() const { return structured::MinCompletionBytes(state_); }

  const MatcherState& state() const { return state_; }
  const JsonSchema& schema() const { return *schema_; }

 private:
  std::shared_ptr<const JsonSchema> schema_;
  MatcherState state_;
  MatcherState next_;
};

}  // namespace pdserve::structured
