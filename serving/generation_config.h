// Sampling defaults a model ships in `<model_dir>/generation_config.json` (Hugging Face format).
//
// Keys read: `temperature`, `top_p`, `top_k`, `do_sample` (false means greedy, as in transformers'
// GenerationConfig) and `eos_token_id` (an integer or a list of integers). Other keys are ignored.
// Immutable after loading; safe to share across threads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::serving {

struct GenerationConfig {
  std::optional<double> temperature;  // absent: the serving default (kDefaultTemperature)
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::vector<int32_t> eos_token_ids;  // may be empty; the model config's eos ids then apply

  // Reads `<model_dir>/generation_config.json`. A missing file is not an error: it yields an empty
  // config. Errors: InvalidArgument naming the file and key for malformed JSON, a non-object
  // document, wrong value types or negative token ids.
  static absl::StatusOr<GenerationConfig> Load(const std::string& model_dir);
  // Same, from JSON text; `source` names the origin in error messages.
  static absl::StatusOr<GenerationConfig> Parse(const std::string& json_text,
                                                const std::string& source);
};

}  // namespace pdserve::serving
