// The coherence harness behind `pdserve check`: N prompts x K samples at the deployment's own
// sampling settings, plus one greedy control (temperature 0) per prompt, each judged for the
// silent failure modes of docs/guards.md: one n-gram repeated until the token limit, empty or
// whitespace-only content, low diversity.
//
// Per sample it measures content length (UTF-8 bytes), the longest back-to-back repeat of an
// n-gram (guards::DegenerationDetector, n = 1..max_ngram), distinct-2 (distinct token bigrams /
// bigrams; 1 when there are fewer than 2 tokens) and empty / whitespace-only. The token
// sequence is the server's own tokens when it returns logprobs (one entry per generated token;
// equal token strings count as one id), else "words": maximal runs of letters, digits and
// non-ASCII bytes, each other visible character on its own (so "<div><div>" is 6 tokens).
// Each sample's report says which tokenization it used. A repeat is reported only from two
// back-to-back copies up; a sample whose request failed has nothing measured (null in the JSON,
// "-" in the table, where each column is over the prompt's measured samples).
//
// Thread-safety: RunCheck blocks its caller; the rest are pure functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "guards/degeneration_detector.h"
#include "loadgen/dataset.h"
#include "loadgen/stats.h"
#include "loadgen/stream_client.h"
#include "nlohmann/json.hpp"

namespace pdserve::loadgen {

struct CheckThresholds {
  int64_t min_content_bytes = 1;  // shorter content fails (empty always fails)
  int max_ngram = 32;             // repeats are looked for with periods 1..max_ngram tokens
  int max_repeats = 8;            // a run of >= this many copies of one n-gram ...
  int min_span_tokens = 24;       // ... covering >= this many tokens fails
  double min_distinct2 = 0.2;
  double max_failing_fraction = 0;  // of a prompt's sampled (non-greedy) samples
  bool greedy_must_pass = false;    // whether a failing greedy control fails the prompt
};

// Overrides fields of `*t` from a JSON object with the same key names (a prompt line's
// "thresholds"). Errors: InvalidArgument naming an unknown key or a value of the wrong type.
absl::Status ApplyThresholdOverrides(const nlohmann::json& overrides, CheckThresholds* t);

struct SampleCheck {
  bool greedy = false;
  std::string request_error;  // error kind when the request itself failed
  // The OpenAI error body's "error.code" and "error.message" of a failed request, if it had one.
  std::string request_error_code;
  std::string request_error_message;
  std::string tokenization;  // "logprobs" or "words"
  int64_t content_bytes = 0;
  int64_t tokens = 0;
  guards::RepeatRun max_repeat;
  double distinct2 = 1;
  bool empty = false;
  bool whitespace_only = false;
  bool pass = false;
  std::vector<std::string> reasons;  // why it failed
  std::string text;
};

// Judges one finished sample. `expect`: a substring the content must contain (case-sensitive).
SampleCheck AnalyzeSample(const RequestSample& sample, const CheckThresholds& thresholds,
                          const std::optional<std::string>& expect);

struct PromptCheck {
  std::string id;
  std::vector<SampleCheck> samples;  // the K sampled ones
  std::optional<SampleCheck> greedy;
  bool pass = false;
  std::vector<std::string> reasons;
};

struct CheckReport {
  std::vector<PromptCheck> prompts;
  bool pass = false;
};

struct CheckOptions {
  EndpointUrl url;
  Api api = Api::kChat;
  std::string model;
  int samples = 4;
  bool greedy_control = true;
  std::optional<double> temperature;  // unset: the server's defaults (generation_config.json)
  int64_t default_max_tokens = 256;
  bool logprobs = true;
  int64_t concurrency = 8;
  double request_timeout_s = 300;
  std::optional<uint64_t> seed;  // sample k of a prompt uses seed + k
  CheckThresholds thresholds;
};

// Sends every prompt's samples and greedy control, then judges them. Prompt lines may carry
// "thresholds" (overrides) and "expect" (a required substring) in PromptItem::extra. With
// Api::kCompletions the prompts must be raw text ("prompt" lines): /v1/completions applies no
// chat template, so chat ("messages") lines are refused rather than flattened.
// Errors: InvalidArgument for bad options or overrides, or chat prompts with kCompletions;
// Unavailable when the host does not resolve. Failed requests are failing samples, not errors.
absl::StatusOr<CheckReport> RunCheck(const std::vector<PromptItem>& prompts,
                                     const CheckOptions& options);

// Judges already collected samples: `samples[i]` are prompt i's K sampled results and
// `greedy[i]` its greedy control, if any. Errors as ApplyThresholdOverrides.
absl::StatusOr<CheckReport> JudgePrompts(const std::vector<PromptItem>& prompts,
                                         const std::vector<std::vector<RequestSample>>& samples,
                                         const std::vector<std::optional<RequestSample>>& greedy,
                                         const CheckThresholds& defaults);

nlohmann::json ToJson(const CheckReport& report);
std::string ToTable(const CheckReport& report);

// One line naming the prompts the server refused as longer than the model's context (a 400
// context_length_exceeded on any of their requests) with the server's first such message, or
// "" when there were none. Such a prompt set cannot be judged: `pdserve check` prints the line
// before its report and exits 2.
std::string ContextLengthSummary(const CheckReport& report);

}  // namespace pdserve::loadgen
