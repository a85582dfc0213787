// The grammar of a DeepSeek-V4 DSML tool-call block, for tool_choice "required" and a named
// function (docs/structured-output.md, "Tool calls"): the whole answer is
//
//   "\n\n<D tool_calls>\n" invoke ("\n" invoke)* "\n</D tool_calls>"        then EOS
//   invoke = <D invoke name="NAME">\n  param ("\n" param)*  \n</D invoke>   (D: the DSML marker,
//            "｜DSML｜", written without the space; no parameters: an empty line before the close)
//   param  = <D parameter name="K" string="true">RAW TEXT</D parameter>     string values
//          | <D parameter name="K" string="false">JSON VALUE</D parameter>  all others
//
// the layout of encode_arguments_to_dsml in DeepSeek's encoding_dsv4.py (the golden fixtures
// of tools/text_chat_golden.py). NAME is one of the grammar's functions; the parameters are the
// declared `properties` of that function's `parameters` schema, in declaration order, optional
// ones possibly left out, every required one present, no others. A property whose schema admits
// strings is written raw with string="true" (a string enum: exactly one of its values); one that
// admits anything else is written as a JSON value of its schema (structured/json_matcher.h) with
// string="false"; a property that admits both may take either. Neither raw text (valid UTF-8,
// no NUL) nor a JSON value (in its strings) holds the DSML marker's first character (U+FF5C for
// DeepSeek; JSON may escape it), which is what makes the closing tag unambiguous. With
// `parallel` false there is exactly one invoke.
//
// So every complete output parses (text/chat_output_parser.h) into tool calls whose arguments
// validate against their function's schema.
//
// Thread-safety: immutable after Parse; share freely.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "structured/byte_grammar.h"
#include "structured/json_schema.h"

namespace pdserve::structured {

// The most alternatives a tool-call grammar may hold in all. A function's point after its i-th
// parameter lists every parameter that may come next (up to the first required one), so n
// optional parameters make n(n + 1) / 2 alternatives: 1,000 of them 500,500. Specs past this are
// refused before they are built.
inline constexpr size_t kMaxToolCallAlternatives = size_t{1} << 18;

class ToolCallGrammar : public ByteGrammar {
 public:
  // The spec text Parse reads: compact JSON {"dsml": marker, "parallel": bool, "tools": [{"name",
  // "parameters"?}]}, from OpenAI `tools[i].function` objects (key order kept).
  static std::string Spec(std::string_view dsml, bool parallel,
                          std::span<const nlohmann::ordered_json> functions);
  // Compiles a spec. Errors: InvalidArgument naming the function and, for a schema it cannot
  // enforce, the keyword and where it is (JsonSchema::Compile's message); also for a function
  // or property name with '"' or the DSML marker, a duplicate function name, a `parameters`
  // that is not an object schema, and a string enum value holding the DSML marker; a spec that
  // needs more than kMaxToolCallAlternatives alternatives. Time: linear in the alternatives (and
  // their text), log-linear for the costs.
  static absl::StatusOr<std::shared_ptr<const ToolCallGrammar>> Parse(std::string_view spec_text);

  MatcherState Start() const override;
  bool Step(const MatcherState& in, uint8_t byte, MatcherState* out) const override;
  int64_t MinCompletionBytes(const MatcherState& state) const override;

 private:
  class Builder;
  // Where an alternative leads.
  enum class Next : uint8_t { kPoint, kRaw, kJson, kDone };
  struct Target {
    Next next = Next::kDone;
    uint32_t id = 0;  // the point or value
  };
  struct Alternative {
    std::string text;
    Target target;
    int64_t total = 0;  // bytes of text plus the shortest completion after it
  };
  // A place where one of several literal texts must come; sorted by text, prefix-free.
  struct Point {
    std::vector<Alternative> alternatives;
    int64_t cost = 0;  // the shortest completion from the point's start
  };
  // A parameter value: raw text up to the closing tag, or a JSON value then point `close`.
  struct Value {
    const JsonSchema* schema = nullptr;
    const SchemaNode* node = nullptr;  // JSON values
    uint32_t next = 0;                 // raw: the point after the closing tag; JSON: the close
  };

  ToolCallGrammar() = default;
  void StepAlternative(const Frame& w, uint8_t byte, MatcherState* out) const;
  void StepRaw(const Frame& w, uint8_t byte, MatcherState* out) const;
  void Enter(Target target, MatcherState* out) const;
  int64_t StackCost(std::span<const Frame> stack) const;

  std::vector<std::shared_ptr<const JsonSchema>> schemas_;  // one per function
  std::vector<Point> points_;
  std::vector<Value> values_;
  std::string tag_;        // "</" marker "parameter>": ends a raw value
  std::string forbidden_;  // the marker's first UTF-8 character: never in raw text
};

}  // namespace pdserve::structured
