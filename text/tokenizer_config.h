// tokenizer_config.json: the special-token names and chat-format markers of a model directory.
//
// Thread-safety: a plain value.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::text {

struct TokenizerConfig {
  std::optional<std::string> bos_token;  // "bos_token": string or {"content": ...}
  std::optional<std::string> eos_token;
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  std::optional<std::string> chat_template;  // Jinja source (a list of named templates: its JSON)
  nlohmann::json pdserve_chat_format;        // our marker: null, "name" or {"name", "tokens"}

  // Parses the JSON text of tokenizer_config.json. Errors: InvalidArgument on malformed JSON or
  // fields of the wrong type.
  static absl::StatusOr<TokenizerConfig> Parse(std::string_view json_text);
  // Reads `path`; a missing file yields an empty config. Errors: as Parse, or NotFound/Internal
  // when the file exists but cannot be read.
  static absl::StatusOr<TokenizerConfig> Load(const std::filesystem::path& path);
};

// Reads a whole file. Errors: NotFound, or Internal on read failure.
absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path);

}  // namespace pdserve::text
