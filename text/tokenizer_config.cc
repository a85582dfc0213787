#include "text/tokenizer_config.h"

#include <cerrno>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/regular_file.h"
#include "common/status.h"

namespace pdserve::text {
namespace {

using nlohmann::json;

std::optional<std::string> TokenName(const json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  const json& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  return value.at("content").get<std::string>();
}

std::optional<bool> OptionalBool(const json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::nullopt;
  return config[key].get<bool>();
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  PDSERVE_RETURN_IF_ERROR(common::CheckRegularFile(path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) return common::OpenError(path.string(), errno);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat("cannot read ", path.string()));
  return buffer.str();
}

absl::StatusOr<TokenizerConfig> TokenizerConfig::Parse(std::string_view json_text) {
  TokenizerConfig config;
  try {
    const json parsed = json::parse(json_text);
    config.bos_token = TokenName(parsed, "bos_token");
    config.eos_token = TokenName(parsed, "eos_token");
    config.add_bos_token = OptionalBool(parsed, "add_bos_token");
    config.add_eos_token = OptionalBool(parsed, "add_eos_token");
    if (parsed.contains("chat_template") && !parsed["chat_template"].is_null()) {
      const json& tmpl = parsed["chat_template"];
      config.chat_template = tmpl.is_string() ? tmpl.get<std::string>() : tmpl.dump();
    }
    if (parsed.contains("pdserve_chat_format")) {
      config.pdserve_chat_format = parsed["pdserve_chat_format"];
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: ", e.what()));
  }
  return config;
}

absl::StatusOr<TokenizerConfig> TokenizerConfig::Load(const std::filesystem::path& path) {
  if (!std::filesystem::exists(path)) return TokenizerConfig{};
  auto text = ReadFile(path);
  if (!text.ok()) return text.status();
  return Parse(*text);
}

}  // namespace pdserve::text
