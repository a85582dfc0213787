// A byte-level grammar that constrained decoding enforces (structured/grammar_constraint.h): the
// JSON automaton of a response_format schema (structured/json_matcher.h) or the DSML tool-call
// block of tool_choice "required" / a named function (structured/tool_call_grammar.h).
//
// A state is a set of stacks of frames (a grammar may be nondeterministic: a stack per live
// reading, at most kMaxStacks, duplicates merged). Every stack in a state is a prefix of some
// output the grammar accepts, so dropping stacks (the cap) never leads to a dead end; the JSON
// automaton drops the costliest to complete, so its shortest completion stays reachable.
//
// Thread-safety: a ByteGrammar is immutable; share freely. A GrammarMatcher is a value; the
// grammar it points to is kept alive by it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace pdserve::structured {

struct SchemaNode;

inline constexpr size_t kMaxStacks = 16;

// One frame of a stack: for JSON, one value being read. Plain bytes (no padding), so states
// compare and hash as bytes.
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

// A UTF-8 lead byte of a multi-byte sequence (RFC 3629: no overlong forms, no surrogates, at
// most U+10FFFF): sets the continuation bytes it needs (1..3) and the range [lo, hi] of the
// first one (the others are 0x80..0xBF); false for any other byte.
bool Utf8Lead(uint8_t byte, uint32_t* more, uint32_t* lo, uint32_t* hi);

// Drops stacks equal to an earlier one.
void DeduplicateStacks(MatcherState* state);

class ByteGrammar {
 public:
  virtual ~ByteGrammar() = default;
  // The state before the output's first byte.
  virtual MatcherState Start() const = 0;
  // Steps `in` by `byte` into `out` (cleared first); false when no stack accepts the byte.
  virtual bool Step(const MatcherState& in, uint8_t byte, MatcherState* out) const = 0;
  // The fewest bytes that complete the output from `state` (0: it is complete).
  virtual int64_t MinCompletionBytes(const MatcherState& state) const = 0;
};

class GrammarMatcher {
 public:
  // A matcher at the start of `grammar`'s output.
  explicit GrammarMatcher(std::shared_ptr<const ByteGrammar> grammar);

  // Reads `byte`; false (and the state unchanged) when the output cannot continue with it.
  bool Advance(uint8_t byte);
  // Reads every byte of `bytes`; false (and the state unchanged) when one is refused.
  bool Advance(std::string_view bytes);
  // The bytes read form a whole output: only its end may follow (a number may still grow).
  bool Complete() const { return MinCompletionBytes() == 0; }
  int64_t MinCompletionBytes() const { return grammar_->MinCompletionBytes(state_); }

  const MatcherState& state() const { return state_; }
  const ByteGrammar& grammar() const { return *grammar_; }

 private:
  std::shared_ptr<const ByteGrammar> grammar_;
  MatcherState state_;
  MatcherState next_;
};

}  // namespace pdserve::structured
