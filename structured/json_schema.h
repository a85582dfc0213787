// A JSON Schema compiled into the grammar that constrained decoding enforces (response_format
// json_object / json_schema; docs/structured-output.md).
//
// Supported keywords: type (object, array, string, number, integer, boolean, null, or a list),
// properties, required, additionalProperties (false, true or a schema), items, minItems, maxItems,
// enum, const, anyOf, and $ref into the schema itself ("#/$defs/Name", any JSON pointer; the
// target compiles in place of the reference; recursive references are refused); $defs and
// definitions hold what $ref names; annotations (title, description, default, examples, $schema,
// $id, $comment, deprecated, readOnly, writeOnly, and keys starting "x-") are ignored. Every other
// keyword is refused with InvalidArgument naming it, because the output could not be guaranteed
// to validate.
//
// What is generated is a subset of what the schema accepts, always valid against it: an object
// with declared properties emits them in declaration order (optional ones may be left out) and
// no others; additional properties are generated only for objects that declare none.
//
// Thread-safety: immutable after Compile; share freely.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::structured {

// Bits of SchemaNode::types.
enum JsonType : uint8_t {
  kTypeObject = 1,
  kTypeArray = 2,
  kTypeString = 4,
  kTypeNumber = 8,
  kTypeInteger = 16,
  kTypeBoolean = 32,
  kTypeNull = 64,
  kTypeAny = 127,
};

// Schemas nested deeper than this (objects and arrays inside each other) are refused; free-form
// values (json_object, {}) are generated at most this deep.
inline constexpr int kMaxNesting = 24;
// minItems / maxItems above this are refused.
inline constexpr int64_t kMaxItemsLimit = 1 << 16;
// Properties a schema may declare in all (every object's, each '$ref' target counted where it
// compiles), as OpenAI's Structured Outputs allow (5,000). The automaton's work at a key is linear
// in its object's properties, so more are refused rather than slowing every token.
inline constexpr size_t kMaxProperties = 5000;

struct SchemaNode;

struct SchemaProperty {
  std::string name;
  std::string key;  // the name as a JSON string, quotes included: the bytes the output holds
  const SchemaNode* value = nullptr;
  bool required = false;
};

// One schema (after anyOf: one alternative). Costs are in bytes of output.
struct SchemaNode {
  uint8_t types = kTypeAny;
  // enum / const: the values as compact JSON, sorted and unique; non-empty: only these match.
  std::vector<std::string> literals;
  std::vector<SchemaProperty> properties;
  const SchemaNode* additional = nullptr;  // value schema of other keys; null: none generated
  const SchemaNode* items = nullptr;       // never null for a node that allows arrays
  int64_t min_items = 0;
  int64_t max_items = kMaxItemsLimit;
  std::vector<const SchemaNode*> any_of;  // non-empty: the value matches one of these instead
  // The shortest value this node accepts.
  int64_t min_bytes = 0;
  // Objects with properties: tail[i] is the shortest way to close the object once properties
  // [0, i) are decided (every later required one, each with its comma, then '}'), size n + 1;
  // via_key[j] the shortest close that emits property j next (key, ':', value, tail[j + 1]).
  std::vector<int64_t> tail;
  std::vector<int64_t> via_key;
  // Size n: last_candidate[i] is the last property that may come next once [0, i) are decided
  // (the first required one at or after i, which later ones would skip, else n - 1), and
  // key_start_cost[i] the shortest close from there: the least via_key[j] for j in
  // [i, last_candidate[i]]. Precomputed so that a step or a cost at a key is not linear in n.
  std::vector<uint32_t> last_candidate;
  std::vector<int64_t> key_start_cost;
};

class JsonSchema {
 public:
  // Compiles `schema` (a JSON Schema object or boolean true; an ordered_json, whose objects keep
  // their keys' order: the order properties are generated in). Errors: InvalidArgument naming
  // the unsupported keyword or bad value and where it is (a JSON pointer, "#/properties/a").
  static absl::StatusOr<std::shared_ptr<const JsonSchema>> Compile(
      const nlohmann::ordered_json& schema);
  // As Compile, from the schema's JSON text (properties in the order the text gives them).
  static absl::StatusOr<std::shared_ptr<const JsonSchema>> Parse(std::string_view text);

  const SchemaNode& root() const { return *root_; }
  // Free-form values; json_object is an object of them.
  const SchemaNode& any() const { return *any_; }
  // Literal nodes of the keywords true / false and null.
  const SchemaNode& boolean() const { return *boolean_; }
  const SchemaNode& null() const { return *null_; }

 private:
  JsonSchema() = default;
  class Compiler;

  std::deque<SchemaNode> nodes_;
  const SchemaNode* root_ = nullptr;
  const SchemaNode* any_ = nullptr;
  const SchemaNode* boolean_ = nullptr;
  const SchemaNode* null_ = nullptr;
};

// The schema of response_format json_object: any JSON object.
inline constexpr std::string_view kJsonObjectSchema = R"({"type":"object"})";

}  // namespace pdserve::structured
