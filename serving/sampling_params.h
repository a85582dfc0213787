// Per-request sampling parameters (OpenAI / vLLM request fields) and their validation.
//
// Semantics follow the OpenAI API where it defines them (presence / frequency penalties,
// logit_bias, seed, n, logprobs) and Hugging Face transformers' logits processors otherwise
// (repetition penalty, top-k, top-p, min-p); serving/sampler.h gives the exact order they apply in.
// A plain value type; safe to copy and share read-only across threads.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "serving/generation_config.h"

namespace pdserve::serving {

// Used when neither the request nor generation_config.json gives a temperature.
inline constexpr double kDefaultTemperature = 0.6;
// OpenAI's limit on `top_logprobs`.
inline constexpr int32_t kMaxTopLogprobs = 20;
// Temperatures below this sample greedily: vLLM's epsilon, and far enough from 0 that z / T
// cannot overflow for finite fp32 logits.
inline constexpr double kGreedyTemperature = 1e-5;
// Upper bound on `n`; each choice is a full sequence with its own state pages.
inline constexpr int32_t kMaxChoices = 128;

struct SamplingParams {
  double temperature = kDefaultTemperature;  // >= 0; below kGreedyTemperature: greedy
  double top_p = 1.0;                        // in (0, 1]; 1 keeps every token
  int32_t top_k = 0;                         // >= 0, or -1; 0 and -1 keep every token
  double min_p = 0.0;                        // in [0, 1]; relative to the most likely token
  double repetition_penalty = 1.0;           // > 0; 1 is off; over prompt and generated tokens
  double presence_penalty = 0.0;             // in [-2, 2]; over generated tokens
  double frequency_penalty = 0.0;            // in [-2, 2]; over generated tokens
  std::map<int32_t, double> logit_bias;      // token id -> additive bias in [-100, 100]
  std::optional<uint64_t> seed;              // absent: derived from the request id
  std::vector<int32_t> stop_token_ids;       // end a choice like EOS (returned, with kStop)
  int32_t max_tokens = 16;                   // >= 1 generated tokens per choice
  int32_t min_tokens = 0;                    // in [0, max_tokens]; EOS and stop ids masked before
  int32_t n = 1;                             // independent choices, in [1, kMaxChoices]
  std::optional<int32_t> logprobs;  // absent: none; k in [0, 20]: chosen token + k most likely
  // The model's EOS ids are ordinary tokens (not end ids, not masked by min_tokens);
  // stop_token_ids still end a choice. RequestSampler::Create drops the EOS ids it is given.
  bool ignore_eos = false;
  // response_format json_object / json_schema: the JSON Schema the output must satisfy (compact
  // JSON text; structured::kJsonObjectSchema for json_object), enforced by a token mask per step
  // (structured/json_constraint.h). Empty: unconstrained.
  std::string json_schema;
  // tool_choice "required" / a named function: the answer is a DSML tool-call block of these
  // tools (structured::ToolCallGrammar::Spec text), enforced like json_schema. Empty:
  // unconstrained. At most one of json_schema and tool_call_grammar is set.
  std::string tool_call_grammar;

  // The defaults a model asks for: temperature / top_p / top_k from `config` where present.
  static SamplingParams FromGenerationConfig(const GenerationConfig& config);
};

// OK when every field is in range for a model with `vocab_size` tokens; otherwise InvalidArgument
// naming the field, the allowed range and the offending value (for example
// "top_p must be in (0, 1], got 0"); the message starts with the field's name, which is the
// OpenAI request parameter's (the HTTP front reports it as the error's param). NaN and infinities
// are rejected for every real field, and so is a real value that float32 (what worker.v1 carries)
// cannot hold: every one must be 0 or of magnitude in [kMinFloat32, kMaxFloat32]. Below it, e.g.
// top_p 1e-46, the value would reach a worker as 0 ("off" for top_p and repetition_penalty) while
// the colocated server applied it. json_schema and tool_call_grammar must nest at most
// kMaxJsonDepth JSON levels (common/json_depth.h); with either, min_tokens, ignore_eos and
// stop_token_ids must be unset (the grammar's own end ends the choice).
absl::Status ValidateSamplingParams(const SamplingParams& params, int64_t vocab_size);

// The magnitudes a real sampling value may take besides 0: those of the normal float32 numbers.
inline constexpr double kMinFloat32 = std::numeric_limits<float>::min();  // 1.17549435e-38
inline constexpr double kMaxFloat32 = std::numeric_limits<float>::max();  // 3.40282347e+38

// Rounds every real field (temperature, top_p, min_p, the penalties, logit_bias) to the nearest
// float32, the precision worker.v1 carries them in, so a request samples with exactly the same
// values through the router as colocated. REQUIRES: ValidateSamplingParams(params) is OK (then no
// value rounds to 0 or to infinity).
void RoundToFloat32(SamplingParams& params);

// The seed that keys this request's random stream: `params.seed` when given (so two requests with
// the same seed and prompt agree, as OpenAI documents), else xxh3-64 of `request_id` (so requests
// without a seed draw independent streams, identical on every worker that sees the same id).
uint64_t EffectiveSeed(const SamplingParams& params, std::string_view request_id);

}  // namespace pdserve::serving
