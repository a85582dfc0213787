// Throughput of the colocated serving path on the bundled model (models/kjv-v4-tiny), CPU:
// the scheduler, the engine step runner and the paged state, without HTTP or tokenization.
//
//   Decode/B/T: B sequences decoding together on T runner threads; one iteration is one
//   scheduler step (B tokens).
//   Prefill/N: one N-token prompt from admission to its first token (N tokens).
//   DecodeJson/B/mask: as Decode/B/1, each sequence under response_format (mask 1: the "event"
//   schema of tests/structured/schemas.json, EOS ends a sequence once its JSON is complete) or
//   not (mask 0: EOS ends it too); same prompts. The difference of the two is the mask's cost
//   per token (docs/perf.md, "Constrained decoding").
// Sampling at temperature 0.6 / top_p 0.95 (the model's generation_config); EOS ignored so every
// sequence runs to max_tokens. Results: docs/perf.md.
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "common/clock.h"
#include "engine/model.h"
#include "nlohmann/json.hpp"
#include "runtime/step_runner.h"
#include "common/clock.h"
#include "structured/token_vocabulary.h"
#include "text/tokenizer.h"

namespace pdserve::runtime {
namespace {

const engine::Model& BundledModel() {
  static const engine::Model* model =
      new engine::Model(*engine::Model::Load(PDSERVE_BUNDLED_MODEL));
  return *model;
}

const std::shared_ptr<const structured::TokenVocabulary>& Vocabulary() {
  static const auto* vocabulary = new std::shared_ptr<const structured::TokenVocabulary>(
      *structured::TokenVocabulary::FromTokenizer(**text::Tokenizer::Load(PDSERVE_BUNDLED_MODEL)));
  return *vocabulary;
}

// The "event" schema of tests/structured/schemas.json (strings, an enum, an array, anyOf).
std::string EventSchema() {
  std::ifstream in(PDSERVE_JSON_SCHEMAS);
  std::stringstream text;
  text << in.rdbuf();
  for (const auto& entry : nlohmann::ordered_json::parse(text.str())) {
    if (entry["name"] == "event") return entry["schema"].dump();
  }
  return "";
}

class Server {
 public:
  Server(int64_t max_running, int threads)
      : layout_(*LayoutForModel(BundledModel().config())),
        pool_(*serving::PagePool::Create(layout_.PoolOptions(
            max_running, max_running * BundledModel().config().max_position_embeddings))) {
    serving::SchedulerOptions options;
    options.token_budget = 512;
    options.max_running = max_running;
    scheduler_ = *serving::Scheduler::Create(
        options, pool_.get(), [this](int64_t total) { return layout_.Demand(total); }, &clock_,
        nullptr);
    RunnerOptions runner_options;
    runner_options.threads = threads;
    runner_ =
        std::make_unique<EngineStepRunner>(BundledModel(), layout_, pool_.get(), runner_options);
  }

  // `json_schema`: the request's response_format schema (empty: none); with `end` true the
  // bundled model's EOS ends a sequence (it is not passed otherwise).
  void Submit(int64_t prompt_length, int32_t max_tokens, const std::string& json_schema = "",
              bool end = false) {
    serving::SamplingParams params;
    params.json_schema = json_schema;
    params.temperature = 0.6;
    params.top_p = 0.95;
    params.max_tokens = max_tokens;
    params.seed = next_;
    std::vector<int32_t> prompt;
    for (int64_t t = 0; t < prompt_length; ++t) prompt.push_back(static_cast<int32_t>(100 + t));
    std::vector<int32_t> eos;
    if (end) {
      for (int64_t id : BundledModel().config().eos_token_ids)
        eos.push_back(static_cast<int32_t>(id));
    }
    auto context = std::make_shared<RequestContext>(
        *serving::RequestSampler::Create(params, absl::StrCat(next_), eos, prompt,
                                         BundledModel().config().vocab_size, Vocabulary()));
    const serving::RequestId id = next_++;
    (void)runner_->Add(id, {context, 0, prompt, max_tokens});
    (void)scheduler_->Submit({id, prompt_length, max_tokens});
  }
  void Step() {
    auto result = scheduler_->Step(*runner_);
    for (serving::RequestId id : result->finished) runner_->Remove(id);
  }
  bool Busy() const { return scheduler_->num_running() + scheduler_->num_waiting() > 0; }
  int64_t decoding() const { return scheduler_->num_decoding(); }

 private:
  serving::StateLayout layout_;
  SystemClock clock_;
  std::unique_ptr<serving::PagePool> pool_;
  std::unique_ptr<serving::Scheduler> scheduler_;
  std::unique_ptr<EngineStepRunner> runner_;
  serving::RequestId next_ = 1;
};

// One scheduler step per iteration with `batch` sequences decoding. When fewer decode, the rest
// drain and `batch` new 64-token prompts (Server::Submit's `json_schema` and `end`) are admitted
// and prefilled, untimed.
void TimeDecodeSteps(benchmark::State& state, Server& server, int64_t batch,
                     const std::string& json_schema, bool end) {
  int64_t tokens = 0;
  for (auto _ : state) {
    if (server.decoding() < batch) {
      state.PauseTiming();
      while (server.Busy()) server.Step();
      for (int64_t b = 0; b < batch; ++b) server.Submit(64, 256, json_schema, end);
      while (server.decoding() < batch) server.Step();  // prefill every prompt
      state.ResumeTiming();
    }
    tokens += server.decoding();
    server.Step();
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens), benchmark::Counter::kIsRate);
}

void Decode(benchmark::State& state) {
  Server server(state.range(0), static_cast<int>(state.range(1)));
  TimeDecodeSteps(state, server, state.range(0), "", false);
}
BENCHMARK(Decode)
    ->ArgsProduct({{1, 4, 16, 64}, {1, 2}})
    ->ArgNames({"batch", "threads"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void DecodeJson(benchmark::State& state) {
  Server server(state.range(0), 1);
  TimeDecodeSteps(state, server, state.range(0), state.range(1) ? EventSchema() : "", true);
}
BENCHMARK(DecodeJson)
    ->ArgsProduct({{1, 4}, {0, 1}})
    ->ArgNames({"batch", "mask"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void Prefill(benchmark::State& state) {
  const int64_t length = state.range(0);
  Server server(1, 1);
  for (auto _ : state) {
    server.Submit(length, 1);
    while (server.Busy()) server.Step();
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(length * state.iterations()),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK(Prefill)->Arg(128)->Arg(448)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace pdserve::runtime

BENCHMARK_MAIN();
