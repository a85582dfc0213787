// Per-token sampler cost on DeepSeek-V4's vocabulary and the scheduler's per-step overhead.
// Run: build/bench/serving/serving_bench; results in docs/perf.md.
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "benchmark/benchmark.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/scheduler.h"

namespace pdserve::serving {
namespace {

constexpr int kVocab = 129280;  // DeepSeek-V4 vocab_size

// A Zipf-like distribution over a fixed permutation of the vocabulary, like a language model's.
std::vector<float> ZipfLogits() {
  std::vector<float> logits(kVocab);
  for (int t = 0; t < kVocab; ++t) {
    const int64_t rank = (static_cast<int64_t>(t) * 7919) % kVocab;
    logits[t] = static_cast<float>(8.0 - 2.5 * std::log1p(static_cast<double>(rank)));
  }
  return logits;
}

void SampleWith(benchmark::State& state, const SamplingParams& params) {
  const std::vector<float> logits = ZipfLogits();
  const std::vector<int32_t> prompt(1000, 17);
  const TokenHistory history(prompt);
  uint32_t position = 0;
  for (auto _ : state) {
    auto sampled = SampleToken(logits, params, {}, history, {1, 0, position++});
    benchmark::DoNotOptimize(sampled);
  }
}

void BM_SampleGreedy(benchmark::State& state) {
  SamplingParams params;
  params.temperature = 0;
  SampleWith(state, params);
}
BENCHMARK(BM_SampleGreedy);

void BM_SampleTemperature(benchmark::State& state) {
  SamplingParams params;
  params.temperature = 0.6;
  SampleWith(state, params);
}
BENCHMARK(BM_SampleTemperature);

void BM_SampleTopP(benchmark::State& state) {
  SamplingParams params;
  params.temperature = 0.6;
  params.top_p = 0.95;
  SampleWith(state, params);
}
BENCHMARK(BM_SampleTopP);

void BM_SampleTopKPenaltiesLogprobs(benchmark::State& state) {
  SamplingParams params;
  params.temperature = 1.0;
  params.top_k = 50;
  params.repetition_penalty = 1.1;
  params.frequency_penalty = 0.5;
  params.logprobs = 20;
  SampleWith(state, params);
}
BENCHMARK(BM_SampleTopKPenaltiesLogprobs);

// BuildStep + CompleteStep with `range(0)` decoding sequences.
void BM_SchedulerDecodeStep(benchmark::State& state) {
  const int64_t sequences = state.range(0);
  PagePoolOptions pool_options;
  pool_options.kinds = {{"state", sequences, 16, 4}};
  auto pool = std::move(PagePool::Create(pool_options)).value();
  SystemClock clock;
  SchedulerOptions options;
  options.max_running = sequences;
  options.token_budget = 2 * sequences + 1;
  auto scheduler =
      std::move(Scheduler::Create(
                    options, pool.get(), [](int64_t) { return PageDemand{1}; }, &clock, nullptr))
          .value();
  for (int64_t id = 0; id < sequences; ++id) {
    if (!scheduler->Submit({static_cast<RequestId>(id), 1, int64_t{1} << 40}).ok()) return;
  }
  for (auto _ : state) {
    auto plan = scheduler->BuildStep();
    auto finished = scheduler->CompleteStep({});
    benchmark::DoNotOptimize(finished);
  }
}
BENCHMARK(BM_SchedulerDecodeStep)->Arg(1)->Arg(16)->Arg(64)->Arg(256);

}  // namespace
}  // namespace pdserve::serving
