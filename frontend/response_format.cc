#include "frontend/response_format.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/ordered_json.h"
#include "structured/json_schema.h"

namespace pdserve::frontend {
namespace {

using json = nlohmann::json;

constexpr const char* kParam = "response_format";

ApiError Refuse(std::string message) { return InvalidRequest(std::move(message), kParam); }

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  }
  return true;
}

std::variant<std::string, ApiError> ReadJsonSchema(const json& value, std::string_view body) {
  auto spec = value.find("json_schema");
  if (spec == value.end() || !spec->is_object()) {
    return Refuse("'response_format' of type json_schema needs a 'json_schema' object");
  }
  for (auto it = spec->begin(); it != spec->end(); ++it) {
    if (it.key() != "name" && it.key() != "schema" && it.key() != "strict" &&
        it.key() != "description") {
      return Refuse(
          absl::StrCat("'response_format.json_schema' has an unknown field '", it.key(), "'"));
    }
  }
  auto name = spec->find("name");
  if (name == spec->end() || !name->is_string() || !ValidName(name->get<std::string>())) {
    return Refuse(
        "'response_format.json_schema.name' must be a string of 1 to 64 letters, digits, '_' or "
        "'-'");
  }
  if (auto strict = spec->find("strict");
      strict != spec->end() && !strict->is_boolean() && !strict->is_null()) {
    return Refuse("'response_format.json_schema.strict' must be a boolean");
  }
  // Without a schema any JSON value will do. The body parsed before (its depth checked by
  // ParseRequest), so it parses again (keeping the client's key order); the subtree is moved out,
  // never copied.
  nlohmann::ordered_json schema = nlohmann::ordered_json::object();
  if (spec->contains("schema")) {
    nlohmann::ordered_json doc = ParseOrderedJson(body);
    schema = std::move(doc["response_format"]["json_schema"]["schema"]);
  }
  absl::StatusOr<std::shared_ptr<const structured::JsonSchema>> compiled =
      structured::JsonSchema::Compile(schema);
  if (!compiled.ok()) {
    return Refuse(
        absl::StrCat("'response_format.json_schema.schema': ", compiled.status().message()));
  }
  return schema.dump();
}

}  // namespace

std::variant<std::string, ApiError> ReadResponseFormat(const json& value, std::string_view body) {
  if (!value.is_object() || !value.contains("type") || !value["type"].is_string()) {
    return Refuse("'response_format' must be an object with a string 'type'");
  }
  const std::string type = value["type"].get<std::string>();
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (it.key() != "type" && !(type == "json_schema" && it.key() == "json_schema")) {
      return Refuse(absl::StrCat("'response_format' of type ", type, " has an unknown field '",
                                 it.key(), "'"));
    }
  }
  if (type == "text") return std::string();
  if (type == "json_object") return std::string(structured::kJsonObjectSchema);
  if (type == "json_schema") return ReadJsonSchema(value, body);
  return Refuse(absl::StrCat(
      "'response_format.type' must be text, json_object or json_schema, got '", type, "'"));
}

}  // namespace pdserve::frontend
