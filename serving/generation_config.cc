#include "serving/generation_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace pdserve::serving {
namespace {

using nlohmann::json;

absl::Status KeyError(const std::string& source, const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": key '", key, "' ", what));
}

absl::StatusOr<std::optional<double>> OptionalNumber(const json& doc, const std::string& key,
                                                     const std::string& source) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return std::optional<double>();
  if (!it->is_number()) return KeyError(source, key, "must be a number");
  return std::optional<double>(it->get<double>());
}

absl::StatusOr<int32_t> TokenId(const json& value, const std::string& source) {
  if (!value.is_number_integer()) return KeyError(source, "eos_token_id", "must hold integers");
  const int64_t id = value.get<int64_t>();
  if (id < 0 || id > INT32_MAX) {
    return KeyError(source, "eos_token_id", absl::StrCat("holds out-of-range token id ", id));
  }
  return static_cast<int32_t>(id);
}

}  // namespace

absl::StatusOr<GenerationConfig> GenerationConfig::Parse(const std::string& json_text,
                                                         const std::string& source) {
  json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return absl::InvalidArgumentError(source + ": malformed JSON");
  if (!doc.is_object()) return absl::InvalidArgumentError(source + ": document is not an object");

  GenerationConfig config;
  PDSERVE_ASSIGN_OR_RETURN(config.temperature, OptionalNumber(doc, "temperature", source));
  PDSERVE_ASSIGN_OR_RETURN(config.top_p, OptionalNumber(doc, "top_p", source));
  if (auto it = doc.find("top_k"); it != doc.end() && !it->is_null()) {
    if (!it->is_number_integer()) return KeyError(source, "top_k", "must be an integer");
    config.top_k = it->get<int64_t>();
  }
  if (auto it = doc.find("do_sample"); it != doc.end() && !it->is_null()) {
    if (!it->is_boolean()) return KeyError(source, "do_sample", "must be a boolean");
    if (!it->get<bool>()) config.temperature = 0.0;
  }
  if (auto it = doc.find("eos_token_id"); it != doc.end() && !it->is_null()) {
    if (it->is_array()) {
      for (const json& value : *it) {
        PDSERVE_ASSIGN_OR_RETURN(int32_t id, TokenId(value, source));
        config.eos_token_ids.push_back(id);
      }
    } else {
      PDSERVE_ASSIGN_OR_RETURN(int32_t id, TokenId(*it, source));
      config.eos_token_ids.push_back(id);
    }
  }
  return config;
}

absl::StatusOr<GenerationConfig> GenerationConfig::Load(const std::string& model_dir) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "generation_config.json";
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return GenerationConfig{};
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(path.string(), ": cannot be read"));
  std::stringstream text;
  text << in.rdbuf();
  return Parse(text.str(), path.string());
}

}  // namespace pdserve::serving
