#include "serving/sampling_params.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "xxhash.h"

namespace pdserve::serving {
namespace {

constexpr int64_t kVocab = 100;

struct InvalidCase {
  std::string name;
  std::function<void(SamplingParams&)> mutate;
  std::string message;
};

// Names the case in test output (and ctest names) instead of dumping its bytes.
void PrintTo(const InvalidCase& c, std::ostream* os) { *os << c.name; }

class InvalidSamplingParamsTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(InvalidSamplingParamsTest, IsInvalidArgumentWithPreciseMessage) {
  SamplingParams params;
  GetParam().mutate(params);
  const absl::Status status = ValidateSamplingParams(params, kVocab);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), GetParam().message);
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();

INSTANTIATE_TEST_SUITE_P(
    AllFields, InvalidSamplingParamsTest,
    ::testing::Values(
        InvalidCase{"NegativeTemperature", [](auto& p) { p.temperature = -0.5; },
                    "temperature must be >= 0 and finite, got -0.5"},
        InvalidCase{"NaNTemperature", [](auto& p) { p.temperature = kNaN; },
                    "temperature must be >= 0 and finite, got nan"},
        InvalidCase{"ZeroTopP", [](auto& p) { p.top_p = 0; }, "top_p must be in (0, 1], got 0"},
        InvalidCase{"TopPAboveOne", [](auto& p) { p.top_p = 1.5; },
                    "top_p must be in (0, 1], got 1.5"},
        InvalidCase{"TopKBelowMinusOne", [](auto& p) { p.top_k = -2; },
                    "top_k must be >= 0 (0 or -1: off), got -2"},
        InvalidCase{"MinPAboveOne", [](auto& p) { p.min_p = 1.25; },
                    "min_p must be in [0, 1], got 1.25"},
        InvalidCase{"ZeroRepetitionPenalty", [](auto& p) { p.repetition_penalty = 0; },
                    "repetition_penalty must be > 0 and finite, got 0"},
        InvalidCase{"PresencePenaltyAboveTwo", [](auto& p) { p.presence_penalty = 2.5; },
                    "presence_penalty must be in [-2, 2], got 2.5"},
        InvalidCase{"FrequencyPenaltyBelowMinusTwo", [](auto& p) { p.frequency_penalty = -3; },
                    "frequency_penalty must be in [-2, 2], got -3"},
        InvalidCase{"LogitBiasOutOfRange", [](auto& p) { p.logit_bias[5] = 101; },
                    "logit_bias[5] must be in [-100, 100], got 101"},
        InvalidCase{"LogitBiasTokenOutsideVocab", [](auto& p) { p.logit_bias[100] = 1; },
                    "logit_bias holds token id 100 outside the vocabulary [0, 100)"},
        InvalidCase{"NegativeStopToken",
                    [](auto& p) {
                      p.stop_token_ids = {3, -1};
                    },
                    "stop_token_ids holds token id -1 outside the vocabulary [0, 100)"},
        InvalidCase{"ZeroMaxTokens", [](auto& p) { p.max_tokens = 0; },
                    "max_tokens must be >= 1, got 0"},
        InvalidCase{"MinTokensAboveMaxTokens",
                    [](auto& p) {
                      p.max_tokens = 4;
                      p.min_tokens = 5;
                    },
                    "min_tokens must be in [0, max_tokens = 4], got 5"},
        // Integers are written whole (a double's 6 digits gave "got 2.14748e+09").
        InvalidCase{"LargeMinTokensAboveMaxTokens",
                    [](auto& p) {
                      p.max_tokens = 5;
                      p.min_tokens = 2147483647;
                    },
                    "min_tokens must be in [0, max_tokens = 5], got 2147483647"},
        InvalidCase{"ZeroChoices", [](auto& p) { p.n = 0; }, "n must be in [1, 128], got 0"},
        // The workers take these texts from their RPCs; the grammars parse them (worker/wire.cc).
        InvalidCase{"DeepJsonSchema",
                    [](auto& p) {
                      p.json_schema = R"({"a":)" + std::string(100000, '[') +
                                      std::string(100000, ']') + R"(,"b":1,"c":2})";
                    },
                    "json_schema nests deeper than 256 JSON levels"},
        InvalidCase{"DeepToolCallGrammar",
                    [](auto& p) {
                      p.tool_call_grammar = R"({"a":)" + std::string(100000, '[') +
                                            std::string(100000, ']') + R"(,"b":1,"c":2})";
                    },
                    "tool_call_grammar nests deeper than 256 JSON levels"},
        // A stop token ends the choice wherever the grammar is, cutting the document short.
        InvalidCase{"StopTokenIdsWithResponseFormat",
                    [](auto& p) {
                      p.json_schema = R"({"type":"integer"})";
                      p.stop_token_ids = {85};
                    },
                    "stop_token_ids must be empty with response_format: the end of the JSON ends "
                    "the choice"},
        InvalidCase{"StopTokenIdsWithForcedToolCalls",
                    [](auto& p) {
                      p.tool_call_grammar = R"({"dsml":"x","tools":[{"name":"f"}]})";
                      p.stop_token_ids = {85};
                    },
                    "stop_token_ids must be empty with tool_choice \"required\" or a named "
                    "function: the end of the tool-call block ends the choice"},
        InvalidCase{"TooManyTopLogprobs", [](auto& p) { p.logprobs = 21; },
                    "logprobs must be in [0, 20], got 21"},
        // Values float32 (worker.v1) cannot hold: 0 ("off") or infinity on the wire.
        InvalidCase{"TopPBelowFloat32", [](auto& p) { p.top_p = 1e-46; },
                    "top_p 1e-46 cannot be carried as a float32 (the workers' sampling values): a "
                    "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"},
        InvalidCase{"RepetitionPenaltyBelowFloat32", [](auto& p) { p.repetition_penalty = 1e-46; },
                    "repetition_penalty 1e-46 cannot be carried as a float32 (the workers' "
                    "sampling values): a "
                    "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"},
        InvalidCase{"SubnormalMinP", [](auto& p) { p.min_p = 1e-40; },
                    "min_p 1e-40 cannot be carried as a float32 (the workers' sampling values): a "
                    "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"},
        InvalidCase{
            "TemperatureAboveFloat32", [](auto& p) { p.temperature = 1e39; },
            "temperature 1e+39 cannot be carried as a float32 (the workers' sampling values): a "
            "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"},
        InvalidCase{"TinyPresencePenalty", [](auto& p) { p.presence_penalty = -1e-300; },
                    "presence_penalty -1e-300 cannot be carried as a float32 (the workers' "
                    "sampling values): a "
                    "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"},
        InvalidCase{
            "TinyLogitBias", [](auto& p) { p.logit_bias[3] = 1e-45; },
            "logit_bias[3] 1e-45 cannot be carried as a float32 (the workers' sampling values): a "
            "nonzero value must have a magnitude from 1.17549e-38 to 3.40282e+38"}),
    [](const ::testing::TestParamInfo<InvalidCase>& param_info) { return param_info.param.name; });

TEST(SamplingParamsTest, BoundaryValuesAreValid) {
  SamplingParams params;
  params.temperature = 0;
  params.top_p = 1;
  params.top_k = -1;
  params.min_p = 1;
  params.presence_penalty = -2;
  params.frequency_penalty = 2;
  params.logit_bias = {{0, -100}, {99, 100}};
  params.stop_token_ids = {0, 99};
  params.min_tokens = params.max_tokens;
  params.n = kMaxChoices;
  params.logprobs = kMaxTopLogprobs;
  EXPECT_TRUE(ValidateSamplingParams(params, kVocab).ok());
}

TEST(SamplingParamsTest, SmallestNormalFloat32IsValid) {
  SamplingParams params;
  params.top_p = kMinFloat32;
  params.repetition_penalty = kMinFloat32;
  params.min_p = kMinFloat32;
  params.temperature = kMaxFloat32;
  params.logit_bias = {{1, -kMinFloat32}};
  EXPECT_TRUE(ValidateSamplingParams(params, kVocab).ok());
}

TEST(SamplingParamsTest, RoundToFloat32GivesTheWorkersValues) {
  SamplingParams params;
  params.temperature = 0.7;
  params.top_p = 2e-38;
  params.min_p = 0.05;
  params.repetition_penalty = 1.1;
  params.presence_penalty = -0.3;
  params.frequency_penalty = 0.1;
  params.logit_bias = {{4, 0.123456789}};
  RoundToFloat32(params);
  EXPECT_EQ(params.temperature, static_cast<double>(0.7f));
  EXPECT_NE(params.temperature, 0.7);
  EXPECT_EQ(params.top_p, static_cast<double>(2e-38f));
  EXPECT_GT(params.top_p, 0.0);
  EXPECT_EQ(params.min_p, static_cast<double>(0.05f));
  EXPECT_EQ(params.repetition_penalty, static_cast<double>(1.1f));
  EXPECT_EQ(params.presence_penalty, static_cast<double>(-0.3f));
  EXPECT_EQ(params.frequency_penalty, static_cast<double>(0.1f));
  EXPECT_EQ(params.logit_bias[4], static_cast<double>(0.123456789f));
  EXPECT_TRUE(ValidateSamplingParams(params, kVocab).ok());
}

TEST(SamplingParamsTest, DefaultsComeFromGenerationConfigElseTemperature06) {
  EXPECT_EQ(SamplingParams::FromGenerationConfig({}).temperature, 0.6);
  GenerationConfig config;
  config.temperature = 1.0;
  config.top_p = 0.95;
  config.top_k = 40;
  const SamplingParams params = SamplingParams::FromGenerationConfig(config);
  EXPECT_EQ(params.temperature, 1.0);
  EXPECT_EQ(params.top_p, 0.95);
  EXPECT_EQ(params.top_k, 40);
}

TEST(SamplingParamsTest, EffectiveSeedIsGivenSeedElseHashOfRequestId) {
  SamplingParams params;
  EXPECT_EQ(EffectiveSeed(params, "req-1"), XXH3_64bits("req-1", 5));
  EXPECT_NE(EffectiveSeed(params, "req-1"), EffectiveSeed(params, "req-2"));
  params.seed = 42;
  EXPECT_EQ(EffectiveSeed(params, "req-1"), 42u);
  EXPECT_EQ(EffectiveSeed(params, "req-2"), 42u);
}

}  // namespace
}  // namespace pdserve::serving
