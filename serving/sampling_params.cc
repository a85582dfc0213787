#include "serving/sampling_params.h"

#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/json_depth.h"
#include "xxhash.h"

namespace pdserve::serving {
namespace {

// `value` keeps its type: integers are written whole (a double would print 2147483647 as
// 2.14748e+09).
template <typename T>
absl::Status RangeError(absl::string_view field, absl::string_view range, T value) {
  return absl::InvalidArgumentError(absl::StrCat(field, " must be ", range, ", got ", value));
}

// 0 or a normal float32 in magnitude (see ValidateSamplingParams).
absl::Status CheckFloat32(absl::string_view field, double value) {
  const double magnitude = std::abs(value);
  if (value == 0.0 || (magnitude >= kMinFloat32 && magnitude <= kMaxFloat32)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", value,
                   " cannot be carried as a float32 (the workers' sampling values): a "
                   "nonzero value must have a magnitude from ",
                   kMinFloat32, " to ", kMaxFloat32));
}

double Float32(double value) { return static_cast<double>(static_cast<float>(value)); }

absl::Status CheckTokenId(absl::string_view field, int32_t id, int64_t vocab_size) {
  if (id < 0 || id >= vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " holds token id ", id, " outside the vocabulary [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

SamplingParams SamplingParams::FromGenerationConfig(const GenerationConfig& config) {
  SamplingParams params;
  if (config.temperature) params.temperature = *config.temperature;
  if (config.top_p) params.top_p = *config.top_p;
  if (config.top_k) params.top_k = static_cast<int32_t>(*config.top_k);
  return params;
}

absl::Status ValidateSamplingParams(const SamplingParams& params, int64_t vocab_size) {
  // Comparisons are written so that NaN fails them.
  if (!(params.temperature >= 0.0) || std::isinf(params.temperature)) {
    return RangeError("temperature", ">= 0 and finite", params.temperature);
  }
  if (!(params.top_p > 0.0 && params.top_p <= 1.0)) {
    return RangeError("top_p", "in (0, 1]", params.top_p);
  }
  if (params.top_k < -1) return RangeError("top_k", ">= 0 (0 or -1: off)", params.top_k);
  if (!(params.min_p >= 0.0 && params.min_p <= 1.0)) {
    return RangeError("min_p", "in [0, 1]", params.min_p);
  }
  if (!(params.repetition_penalty > 0.0) || std::isinf(params.repetition_penalty)) {
    return RangeError("repetition_penalty", "> 0 and finite", params.repetition_penalty);
  }
  if (!(params.presence_penalty >= -2.0 && params.presence_penalty <= 2.0)) {
    return RangeError("presence_penalty", "in [-2, 2]", params.presence_penalty);
  }
  if (!(params.frequency_penalty >= -2.0 && params.frequency_penalty <= 2.0)) {
    return RangeError("frequency_penalty", "in [-2, 2]", params.frequency_penalty);
  }
  for (const auto& [token, bias] : params.logit_bias) {
    if (auto status = CheckTokenId("logit_bias", token, vocab_size); !status.ok()) return status;
    if (!(bias >= -100.0 && bias <= 100.0)) {
      return RangeError(absl::StrCat("logit_bias[", token, "]"), "in [-100, 100]", bias);
    }
  }
  for (int32_t token : params.stop_token_ids) {
    if (auto status = CheckTokenId("stop_token_ids", token, vocab_size); !status.ok()) {
      return status;
    }
  }
  if (params.max_tokens < 1) return RangeError("max_tokens", ">= 1", params.max_tokens);
  if (params.min_tokens < 0 || params.min_tokens > params.max_tokens) {
    return RangeError("min_tokens", absl::StrCat("in [0, max_tokens = ", params.max_tokens, "]"),
                      params.min_tokens);
  }
  if (params.n < 1 || params.n > kMaxChoices) {
    return RangeError("n", absl::StrCat("in [1, ", kMaxChoices, "]"), params.n);
  }
  if (params.logprobs && (*params.logprobs < 0 || *params.logprobs > kMaxTopLogprobs)) {
    return RangeError("logprobs", absl::StrCat("in [0, ", kMaxTopLogprobs, "]"), *params.logprobs);
  }
  // The workers take both texts from their RPCs; the grammars parse them (common/json_depth.h).
  if (auto status = CheckJsonDepth(params.json_schema, "json_schema"); !status.ok()) return status;
  if (auto status = CheckJsonDepth(params.tool_call_grammar, "tool_call_grammar"); !status.ok()) {
    return status;
  }
  if (!params.json_schema.empty() && params.min_tokens > 0) {
    return absl::InvalidArgumentError(
        "min_tokens must be 0 with response_format: the end of the JSON ends the choice");
  }
  if (!params.json_schema.empty() && params.ignore_eos) {
    return absl::InvalidArgumentError(
        "ignore_eos must be false with response_format: the end of the JSON ends the choice");
  }
  if (!params.tool_call_grammar.empty() && params.min_tokens > 0) {
    return absl::InvalidArgumentError(
        "min_tokens must be 0 with tool_choice \"required\" or a named function: the end of the "
        "tool-call block ends the choice");
  }
  if (!params.tool_call_grammar.empty() && params.ignore_eos) {
    return absl::InvalidArgumentError(
        "ignore_eos must be false with tool_choice \"required\" or a named function: the end of "
        "the tool-call block ends the choice");
  }
  // A stop token would end the choice wherever the grammar stands, cutting the document or the
  // block short under finish_reason "stop" (found by a breaker, 2026-12-04); stop strings are
  // refused the same way by the fronts (frontend/api_request.cc).
  if (!params.json_schema.empty() && !params.stop_token_ids.empty()) {
    return absl::InvalidArgumentError(
        "stop_token_ids must be empty with response_format: the end of the JSON ends the choice");
  }
  if (!params.tool_call_grammar.empty() && !params.stop_token_ids.empty()) {
    return absl::InvalidArgumentError(
        "stop_token_ids must be empty with tool_choice \"required\" or a named function: the end "
        "of the tool-call block ends the choice");
  }
  if (!params.tool_call_grammar.empty() && !params.json_schema.empty()) {
    return absl::InvalidArgumentError(
        "response_format json cannot be combined with tool_choice \"required\" or a named "
        "function");
  }
  for (const auto& [field, value] :
       {std::pair<absl::string_view, double>{"temperature", params.temperature},
        {"top_p", params.top_p},
        {"min_p", params.min_p},
        {"repetition_penalty", params.repetition_penalty},
        {"presence_penalty", params.presence_penalty},
        {"frequency_penalty", params.frequency_penalty}}) {
    if (auto status = CheckFloat32(field, value); !status.ok()) return status;
  }
  for (const auto& [token, bias] : params.logit_bias) {
    if (auto status = CheckFloat32(absl::StrCat("logit_bias[", token, "]"), bias); !status.ok()) {
      return status;
    }
  }
  return absl::OkStatus();
}

void RoundToFloat32(SamplingParams& params) {
  // One loop over the fields, not six assignments: GCC 12.2's SLP vectorizer at -O2 drops the
  // round trip of temperature and top_p when they are written field by field (measured; the
  // test RoundToFloat32GivesTheWorkersValues catches it).
  for (double* value :
       {&params.temperature, &params.top_p, &params.min_p, &params.repetition_penalty,
        &params.presence_penalty, &params.frequency_penalty}) {
    *value = Float32(*value);
  }
  for (auto& [token, bias] : params.logit_bias) bias = Float32(bias);
}

uint64_t EffectiveSeed(const SamplingParams& params, std::string_view request_id) {
  if (params.seed) return *params.seed;
  return XXH3_64bits(request_id.data(), request_id.size());
}

}  // namespace pdserve::serving
