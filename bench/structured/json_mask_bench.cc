// The cost of response_format's token mask per sampled token: RequestSampler::Next on the bundled
// model's vocabulary (models/kjv-v4-tiny, 4099 ids) with random logits at temperature 1, each
// choice generating until its JSON is complete or max_tokens (256), then starting over.
//
//   Sample/schema:-1: no response_format (the baseline sampler step).
//   Sample/schema:i: schema i of tests/structured/schemas.json; the mask's cache is per request,
//   so a new request every 256 tokens keeps cold walks in the figure.
//   Mask/schema:i: the mask alone, GrammarConstraint::FillMask + Accept of a random allowed token,
//   same restarts: what response_format adds to a decode step.
//   MaskWide/properties:n: as Mask, for an object of n optional properties.
//   ToolCalls: as Sample, with tool_choice "required" over two functions (ToolCallSpec) instead
//   of a schema: compare with Sample/schema:-1. ToolCallsMask: as Mask, for that grammar.
// Per-token figures; TPOT comparisons in docs/perf.md ("Constrained decoding").
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "nlohmann/json.hpp"
#include "serving/sampler.h"
#include "structured/token_vocabulary.h"
#include "structured/tool_call_grammar.h"
#include "text/tokenizer.h"

namespace pdserve::serving {
namespace {

constexpr int32_t kEos = 1;
constexpr int32_t kMaxTokens = 256;

const std::shared_ptr<const structured::TokenVocabulary>& Vocabulary() {
  static const auto* vocabulary = new std::shared_ptr<const structured::TokenVocabulary>(
      *structured::TokenVocabulary::FromTokenizer(**text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL)));
  return *vocabulary;
}

std::string Schema(int64_t index) {
  if (index < 0) return "";
  std::ifstream in(PDSERVE_JSON_SCHEMAS);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::ordered_json::parse(text.str())[static_cast<size_t>(index)]["schema"].dump();
}

// tool_choice "required" over two functions: strings, an enum, numbers, an array, a nested object.
std::string ToolCallSpec() {
  return structured::ToolCallGrammar::Spec("｜DSML｜", /*parallel=*/true,
                                           nlohmann::ordered_json::parse(R"([
        {"name": "get_weather", "parameters": {"type": "object", "properties": {
          "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
          "days": {"type": "integer"}}, "required": ["city", "unit"]}},
        {"name": "search", "parameters": {"type": "object", "properties": {
          "query": {"type": "string"}, "limit": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}},
          "filter": {"type": "object", "properties": {"from": {"type": "number"}}}},
          "required": ["query"]}}])")
                                               .get<std::vector<nlohmann::ordered_json>>());
}

// RequestSampler::Next with `params` on random logits, a new request whenever one finishes.
void RunSampler(benchmark::State& state, SamplingParams params) {
  params.temperature = 1.0;
  params.max_tokens = kMaxTokens;
  const int32_t eos[] = {kEos};
  const int64_t vocab = Vocabulary()->size();
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<std::vector<float>> logits(64, std::vector<float>(static_cast<size_t>(vocab)));
  for (auto& row : logits) {
    for (float& z : row) z = normal(rng);
  }
  int64_t request = 0;
  auto make = [&] {
    return *RequestSampler::Create(params, absl::StrCat(request++), eos, std::vector<int32_t>{5},
                                   vocab, Vocabulary());
  };
  RequestSampler sampler = make();
  size_t row = 0;
  for (auto _ : state) {
    if (sampler.finished(0)) sampler = make();
    auto step = sampler.Next(0, logits[row++ % logits.size()]);
    benchmark::DoNotOptimize(step);
  }
}

void Sample(benchmark::State& state) {
  SamplingParams params;
  params.json_schema = Schema(state.range(0));
  RunSampler(state, params);
}

void ToolCalls(benchmark::State& state) {
  SamplingParams params;
  params.tool_call_grammar = ToolCallSpec();
  RunSampler(state, params);
}
BENCHMARK(ToolCalls)->Unit(benchmark::kMicrosecond);
BENCHMARK(Sample)->DenseRange(-1, 19)->ArgName("schema")->Unit(benchmark::kMicrosecond);

// GrammarConstraint::FillMask + Accept of a random allowed token, a new constraint (cold cache)
// from `make` every kMaxTokens tokens or when the output is complete.
template <typename Make>
void RunMask(benchmark::State& state, Make make) {
  const int32_t eos[] = {kEos};
  const int64_t vocab = Vocabulary()->size();
  std::mt19937 rng(1);
  std::shared_ptr<structured::GrammarConstraint> constraint;
  std::optional<structured::GrammarMatcher> matcher;
  int64_t step = kMaxTokens;
  std::vector<uint64_t> mask;
  std::vector<int32_t> allowed;
  for (auto _ : state) {
    if (step == kMaxTokens || allowed.empty()) {
      constraint = make();
      matcher = constraint->Start();
      step = 0;
    }
    benchmark::DoNotOptimize(constraint->FillMask(*matcher, kMaxTokens - step, eos, vocab, &mask));
    state.PauseTiming();
    allowed.clear();
    for (int32_t t = 0; t < vocab; ++t) {
      if (((mask[t / 64] >> (t % 64)) & 1) && t != kEos) allowed.push_back(t);
    }
    const int32_t token = allowed.empty() ? kEos : allowed[rng() % allowed.size()];
    state.ResumeTiming();
    if (token != kEos) constraint->Accept(*matcher, token);
    ++step;
  }
}

void Mask(benchmark::State& state) {
  const std::string schema = Schema(state.range(0));
  RunMask(state,
          [&] { return *structured::GrammarConstraint::ForJsonSchema(schema, Vocabulary()); });
}
BENCHMARK(Mask)->DenseRange(0, 19)->ArgName("schema")->Unit(benchmark::kMicrosecond);

// An object of `properties` optional free-form properties ({"p0": {}, ...}): the mask's work at a
// key grows with its object's properties (a schema may declare structured::kMaxProperties).
void MaskWide(benchmark::State& state) {
  nlohmann::ordered_json properties = nlohmann::ordered_json::object();
  for (int64_t i = 0; i < state.range(0); ++i) {
    properties[absl::StrCat("p", i)] = nlohmann::ordered_json::object();
  }
  const std::string schema =
      nlohmann::ordered_json{{"type", "object"}, {"properties", properties}}.dump();
  RunMask(state,
          [&] { return *structured::GrammarConstraint::ForJsonSchema(schema, Vocabulary()); });
}
BENCHMARK(MaskWide)
    ->Arg(100)
    ->Arg(1000)
    ->Arg(5000)
    ->ArgName("properties")
    ->Unit(benchmark::kMicrosecond);

void ToolCallsMask(benchmark::State& state) {
  const std::string spec = ToolCallSpec();
  RunMask(state, [&] { return *structured::GrammarConstraint::ForToolCalls(spec, Vocabulary()); });
}
BENCHMARK(ToolCallsMask)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace pdserve::serving
