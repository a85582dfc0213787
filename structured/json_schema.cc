#include "structured/json_schema.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "common/ordered_json.h"
#include "common/status.h"

namespace pdserve::structured {
namespace {

using json = nlohmann::ordered_json;

constexpr int64_t kCostCap = int64_t{1} << 40;
// Nodes that resolving '$ref's may create in all. A definition compiles once per nesting depth it
// is used at, so expansion is bounded by (kMaxNesting + 1) times the schema; this caps it lower.
constexpr size_t kMaxRefNodes = size_t{1} << 16;

int64_t Add(int64_t a, int64_t b) { return std::min(kCostCap, a + b); }
int64_t Mul(int64_t a, int64_t b) {
  return b == 0 ? 0 : (a > kCostCap / b ? kCostCap : std::min(kCostCap, a * b));
}

bool IsAnnotation(const std::string& key) {
  static const std::set<std::string> kAnnotations = {
      "title", "description", "default",    "examples", "$schema",
      "$id",   "$comment",    "deprecated", "readOnly", "writeOnly"};
  return kAnnotations.count(key) > 0 || key.rfind("x-", 0) == 0;
}

// Containers of definitions: skipped where they stand, read through '$ref'.
bool IsDefinitions(const std::string& key) { return key == "$defs" || key == "definitions"; }

absl::Status Refuse(const std::string& path, std::string what) {
  return absl::InvalidArgumentError(absl::StrCat(what, " (at ", path, ")"));
}

absl::StatusOr<uint8_t> TypeBit(const json& name, const std::string& path) {
  static const std::pair<const char*, uint8_t> kNames[] = {
      {"object", kTypeObject}, {"array", kTypeArray},     {"string", kTypeString},
      {"number", kTypeNumber}, {"integer", kTypeInteger}, {"boolean", kTypeBoolean},
      {"null", kTypeNull}};
  if (name.is_string()) {
    for (const auto& [n, bit] : kNames) {
      if (name.get<std::string>() == n) return bit;
    }
  }
  return Refuse(path, absl::StrCat("'type' ", name.dump(), " is not a JSON Schema type"));
}

// The types a literal value has, as JsonType bits (an integral float is an integer too).
uint8_t TypesOf(const json& v) {
  switch (v.type()) {
    case json::value_t::object:
      return kTypeObject;
    case json::value_t::array:
      return kTypeArray;
    case json::value_t::string:
      return kTypeString;
    case json::value_t::boolean:
      return kTypeBoolean;
    case json::value_t::null:
      return kTypeNull;
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return kTypeNumber | kTypeInteger;
    case json::value_t::number_float: {
      const double d = v.get<double>();
      return d == static_cast<double>(static_cast<int64_t>(d)) ? kTypeNumber | kTypeInteger
                                                               : kTypeNumber;
    }
    default:
      return 0;
  }
}

}  // namespace

class JsonSchema::Compiler {
 public:
  explicit Compiler(JsonSchema* out) : out_(out) {}

  absl::Status Run(const json& schema) {
    root_ = &schema;
    SchemaNode& any = New();
    any.types = kTypeAny;
    any.additional = &any;
    any.items = &any;
    any.min_bytes = 1;
    any.tail = {1};
    out_->any_ = &any;
    SchemaNode& boolean = New();
    boolean.literals = {"false", "true"};
    boolean.min_bytes = 4;
    out_->boolean_ = &boolean;
    SchemaNode& null = New();
    null.literals = {"null"};
    null.min_bytes = 4;
    out_->null_ = &null;
    PDSERVE_ASSIGN_OR_RETURN(out_->root_, Node(schema, "#", 0));
    return absl::OkStatus();
  }

 private:
  SchemaNode& New() { return out_->nodes_.emplace_back(); }

  absl::StatusOr<const SchemaNode*> Node(const json& schema, const std::string& path, int depth) {
    if (depth > kMaxNesting) {
      return Refuse(path, absl::StrCat("the schema nests deeper than ", kMaxNesting, " levels"));
    }
    if (schema.is_boolean()) {
      if (schema.get<bool>()) return out_->any_;
      return Refuse(path, "the schema false accepts nothing");
    }
    if (!schema.is_object()) return Refuse(path, "a schema must be an object or a boolean");
    for (auto it = schema.begin(); it != schema.end(); ++it) {
      static const std::set<std::string> kSupported = {
          "type",  "properties", "required", "additionalProperties",
          "items", "minItems",   "maxItems", "enum",
          "const", "anyOf",      "$ref"};
      if (!kSupported.count(it.key()) && !IsAnnotation(it.key()) && !IsDefinitions(it.key())) {
        return Refuse(path, absl::StrCat("keyword '", it.key(), "' is not supported"));
      }
    }
    if (schema.contains("$ref")) return Ref(schema, path, depth);
    if (schema.contains("anyOf")) return AnyOf(schema, path, depth);
    SchemaNode& node = New();
    PDSERVE_RETURN_IF_ERROR(Types(schema, path, node));
    PDSERVE_RETURN_IF_ERROR(Literals(schema, path, node));
    if (!node.literals.empty()) {
      node.min_bytes = kCostCap;
      for (const std::string& l : node.literals) {
        node.min_bytes = std::min<int64_t>(node.min_bytes, static_cast<int64_t>(l.size()));
      }
      return &node;
    }
    if (node.types & kTypeObject) PDSERVE_RETURN_IF_ERROR(Object(schema, path, depth, node));
    if (node.types & kTypeArray) PDSERVE_RETURN_IF_ERROR(Array(schema, path, depth, node));
    node.min_bytes = MinBytes(node);
    return &node;
  }

  // A '$ref' to a schema of this document (a JSON pointer after '#': "#/$defs/Name", what
  // pydantic writes for nested models and enums). The target compiles in place of the reference,
  // at the reference's depth, once per (target, depth). A target that refers back to itself
  // (a recursive schema) is refused: its documents have no depth bound.
  absl::StatusOr<const SchemaNode*> Ref(const json& schema, const std::string& path, int depth) {
    for (auto it = schema.begin(); it != schema.end(); ++it) {
      if (it.key() != "$ref" && !IsAnnotation(it.key()) && !IsDefinitions(it.key())) {
        return Refuse(path,
                      absl::StrCat("keyword '", it.key(), "' next to '$ref' is not supported"));
      }
    }
    const json& ref = schema["$ref"];
    if (!ref.is_string() || ref.get<std::string>().rfind('#', 0) != 0) {
      return Refuse(path, "'$ref' must be a reference into this schema (\"#/$defs/...\")");
    }
    const std::string target_path = ref.get<std::string>();
    PDSERVE_ASSIGN_OR_RETURN(const json* target, Resolve(target_path, path));
    if (auto hit = compiled_refs_.find({target, depth}); hit != compiled_refs_.end()) {
      return hit->second;
    }
    if (!resolving_.insert(target).second) {
      return Refuse(path, absl::StrCat("'$ref' \"", target_path,
                                       "\" refers back into itself; recursive schemas are not "
                                       "supported"));
    }
    const size_t before = out_->nodes_.size();
    absl::StatusOr<const SchemaNode*> node = Node(*target, target_path, depth);
    resolving_.erase(target);
    if (!node.ok()) return node;
    if (resolving_.empty()) ref_nodes_ += out_->nodes_.size() - before;  // outermost only
    if (ref_nodes_ > kMaxRefNodes) {
      return Refuse(path, absl::StrCat("resolving '$ref's expands the schema beyond ", kMaxRefNodes,
                                       " subschemas"));
    }
    compiled_refs_[{target, depth}] = *node;
    return node;
  }

  // The value at JSON pointer `pointer` ("#/a/b~1c/0", RFC 6901 after the '#') in the schema.
  absl::StatusOr<const json*> Resolve(const std::string& pointer, const std::string& path) const {
    const json* at = root_;
    size_t pos = 1;
    while (pos < pointer.size()) {
      if (pointer[pos] != '/') break;
      const size_t end = std::min(pointer.find('/', pos + 1), pointer.size());
      std::string token;
      for (size_t i = pos + 1; i < end; ++i) {
        if (pointer[i] == '~' && i + 1 < end && (pointer[i + 1] == '0' || pointer[i + 1] == '1')) {
          token.push_back(pointer[++i] == '0' ? '~' : '/');
        } else {
          token.push_back(pointer[i]);
        }
      }
      pos = end;
      if (at->is_object() && at->contains(token)) {
        at = &(*at)[token];
      } else if (at->is_array() && !token.empty() &&
                 token.find_first_not_of("0123456789") == std::string::npos && token.size() < 10 &&
                 std::stoul(token) < at->size()) {
        at = &(*at)[std::stoul(token)];
      } else {
        at = nullptr;
        break;
      }
    }
    if (at == nullptr || pos < pointer.size()) {
      return Refuse(path, absl::StrCat("'$ref' \"", pointer, "\" names nothing in the schema"));
    }
    return at;
  }

  absl::StatusOr<const SchemaNode*> AnyOf(const json& schema, const std::string& path, int depth) {
    for (auto it = schema.begin(); it != schema.end(); ++it) {
      if (it.key() != "anyOf" && !IsAnnotation(it.key()) && !IsDefinitions(it.key())) {
        return Refuse(path, absl::StrCat("keyword '", it.key(),
                                         "' next to 'anyOf' is not supported (move it into "
                                         "each alternative)"));
      }
    }
    const json& list = schema["anyOf"];
    if (!list.is_array() || list.empty()) {
      return Refuse(path, "'anyOf' must be a non-empty array of schemas");
    }
    SchemaNode& node = New();
    node.min_bytes = kCostCap;
    for (size_t i = 0; i < list.size(); ++i) {
      PDSERVE_ASSIGN_OR_RETURN(const SchemaNode* alt,
                               Node(list[i], absl::StrCat(path, "/anyOf/", i), depth));
      // Kept flat and without repeats: an alternative that is an anyOf contributes its own
      // alternatives. The automaton then starts each distinct alternative once, where anyOfs
      // nested through shared '$ref's would start 2^depth of them.
      for (const SchemaNode* leaf :
           alt->any_of.empty() ? std::vector<const SchemaNode*>{alt} : alt->any_of) {
        if (std::find(node.any_of.begin(), node.any_of.end(), leaf) == node.any_of.end()) {
          node.any_of.push_back(leaf);
        }
      }
      node.min_bytes = std::min(node.min_bytes, alt->min_bytes);
    }
    return &node;
  }

  absl::Status Types(const json& schema, const std::string& path, SchemaNode& node) {
    auto it = schema.find("type");
    if (it == schema.end()) return absl::OkStatus();
    node.types = 0;
    if (it->is_array()) {
      for (const json& name : *it) {
        PDSERVE_ASSIGN_OR_RETURN(uint8_t bit, TypeBit(name, path));
        node.types |= bit;
      }
      if (node.types == 0) return Refuse(path, "'type' must name at least one type");
    } else {
      PDSERVE_ASSIGN_OR_RETURN(node.types, TypeBit(*it, path));
    }
    if (node.types & kTypeNumber) node.types |= kTypeInteger;
    return absl::OkStatus();
  }

  // enum and const, filtered by type: the node's literals.
  absl::Status Literals(const json& schema, const std::string& path, SchemaNode& node) {
    const bool has_enum = schema.contains("enum");
    const bool has_const = schema.contains("const");
    if (!has_enum && !has_const) return absl::OkStatus();
    std::vector<json> values;
    if (has_enum) {
      const json& e = schema["enum"];
      if (!e.is_array() || e.empty()) return Refuse(path, "'enum' must be a non-empty array");
      values.assign(e.begin(), e.end());
    }
    if (has_const) {
      const json& c = schema["const"];
      if (has_enum) {
        const bool listed = std::find(values.begin(), values.end(), c) != values.end();
        values.clear();
        if (listed) values.push_back(c);
      } else {
        values.push_back(c);
      }
    }
    std::set<std::string> literals;
    for (const json& v : values) {
      if (TypesOf(v) & node.types) literals.insert(v.dump());
    }
    if (literals.empty()) {
      return Refuse(path, "no value of 'enum' / 'const' has the schema's 'type'");
    }
    node.literals.assign(literals.begin(), literals.end());
    return absl::OkStatus();
  }

  absl::Status Object(const json& schema, const std::string& path, int depth, SchemaNode& node) {
    std::set<std::string> required;
    if (auto it = schema.find("required"); it != schema.end()) {
      if (!it->is_array()) return Refuse(path, "'required' must be an array of strings");
      for (const json& name : *it) {
        if (!name.is_string()) return Refuse(path, "'required' must be an array of strings");
        required.insert(name.get<std::string>());
      }
    }
    if (auto it = schema.find("properties"); it != schema.end()) {
      if (!it->is_object()) return Refuse(path, "'properties' must be an object");
      for (auto p = it->begin(); p != it->end(); ++p) {
        if (++properties_ > kMaxProperties) {
          return Refuse(path, absl::StrCat("the schema declares more than ", kMaxProperties,
                                           " properties in all"));
        }
        SchemaProperty property;
        property.name = p.key();
        property.key = json(p.key()).dump();
        property.required = required.erase(p.key()) > 0;
        PDSERVE_ASSIGN_OR_RETURN(property.value,
                                 Node(*p, absl::StrCat(path, "/properties/", p.key()), depth + 1));
        node.properties.push_back(std::move(property));
      }
    }
    if (!required.empty()) {
      return Refuse(
          path, absl::StrCat("required property '", *required.begin(), "' is not in 'properties'"));
    }
    node.additional = out_->any_;
    if (auto it = schema.find("additionalProperties"); it != schema.end()) {
      if (it->is_boolean() && !it->get<bool>()) {
        node.additional = nullptr;
      } else {
        PDSERVE_ASSIGN_OR_RETURN(node.additional,
                                 Node(*it, absl::StrCat(path, "/additionalProperties"), depth + 1));
      }
    }
    ObjectCosts(node);
    return absl::OkStatus();
  }

  absl::Status Array(const json& schema, const std::string& path, int depth, SchemaNode& node) {
    node.items = out_->any_;
    bool no_items = false;  // 'items': false
    if (auto it = schema.find("items"); it != schema.end()) {
      if (it->is_boolean() && !it->get<bool>()) {
        no_items = true;
        node.max_items = 0;
      } else if (it->is_array()) {
        return Refuse(path, "'items' as an array (tuple validation) is not supported");
      } else {
        PDSERVE_ASSIGN_OR_RETURN(node.items, Node(*it, absl::StrCat(path, "/items"), depth + 1));
      }
    }
    for (const char* key : {"minItems", "maxItems"}) {
      auto it = schema.find(key);
      if (it == schema.end()) continue;
      if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
          it->get<int64_t>() > kMaxItemsLimit) {
        return Refuse(path,
                      absl::StrCat("'", key, "' must be an integer in [0, ", kMaxItemsLimit, "]"));
      }
      if (std::string(key) == "minItems") {
        node.min_items = it->get<int64_t>();
      } else {
        node.max_items = std::min(node.max_items, it->get<int64_t>());
      }
    }
    // An array of at least one item whose items must match false accepts nothing (the schema
    // false is refused wherever it stands, above); minItems was clamped to 0 here before, and the
    // answer, an empty array, then broke the schema.
    if (no_items && node.min_items > 0) {
      return Refuse(path,
                    absl::StrCat("'items' false allows only the empty array, but 'minItems' is ",
                                 node.min_items, ": the schema accepts nothing"));
    }
    if (node.min_items > node.max_items) {
      return Refuse(path, "'minItems' is larger than 'maxItems'");
    }
    return absl::OkStatus();
  }

  static void ObjectCosts(SchemaNode& node) {
    const size_t n = node.properties.size();
    node.tail.assign(n + 1, 1);
    node.via_key.assign(n, 0);
    node.last_candidate.assign(n, 0);
    node.key_start_cost.assign(n, 0);
    for (size_t j = n; j-- > 0;) {
      const SchemaProperty& p = node.properties[j];
      node.via_key[j] =
          Add(Add(static_cast<int64_t>(p.key.size()) + 1, p.value->min_bytes), node.tail[j + 1]);
      node.tail[j] = p.required ? Add(1, node.via_key[j]) : node.tail[j + 1];
      const bool stop = p.required || j + 1 == n;  // no candidate after j
      node.last_candidate[j] = stop ? static_cast<uint32_t>(j) : node.last_candidate[j + 1];
      node.key_start_cost[j] =
          stop ? node.via_key[j] : std::min(node.via_key[j], node.key_start_cost[j + 1]);
    }
  }

  static int64_t MinBytes(const SchemaNode& node) {
    int64_t best = kCostCap;
    if (node.types & (kTypeNumber | kTypeInteger)) best = 1;
    if (node.types & kTypeString) best = std::min<int64_t>(best, 2);
    if (node.types & (kTypeBoolean | kTypeNull)) best = std::min<int64_t>(best, 4);
    if (node.types & kTypeObject) {
      const bool any_required = node.tail.size() > 1 && node.tail[0] > 1;
      best = std::min(best, any_required ? Add(node.tail[0], 0) : 2);
    }
    if (node.types & kTypeArray) {
      const int64_t m = node.items->min_bytes;
      best = std::min(
          best, node.min_items == 0 ? 2 : Add(Add(1, Mul(node.min_items, m)), node.min_items));
    }
    return best;
  }

  JsonSchema* out_;
  const json* root_ = nullptr;  // the schema being compiled: what '$ref' pointers resolve in
  std::map<std::pair<const json*, int>, const SchemaNode*> compiled_refs_;
  std::set<const json*> resolving_;  // '$ref' targets being compiled (a cycle returns to one)
  size_t ref_nodes_ = 0;             // nodes made by compiling '$ref' targets
  size_t properties_ = 0;            // properties compiled so far (kMaxProperties)
};

absl::StatusOr<std::shared_ptr<const JsonSchema>> JsonSchema::Compile(const json& schema) {
  std::shared_ptr<JsonSchema> out(new JsonSchema());
  Compiler compiler(out.get());
  PDSERVE_RETURN_IF_ERROR(compiler.Run(schema));
  return std::shared_ptr<const JsonSchema>(std::move(out));
}

absl::StatusOr<std::shared_ptr<const JsonSchema>> JsonSchema::Parse(std::string_view text) {
  PDSERVE_RETURN_IF_ERROR(CheckJsonDepth(text, "the schema"));
  const json schema = ParseOrderedJson(text);
  if (schema.is_discarded()) return absl::InvalidArgumentError("the schema is not valid JSON");
  return Compile(schema);
}

}  // namespace pdserve::structured
