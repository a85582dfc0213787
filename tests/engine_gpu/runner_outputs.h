// Shared by the GPU runner and GPU prefill tests (tests/engine_gpu): requests, their per-choice
// tokens, decode of prompt states handed over in pages as the decode worker drives it
// (RunTransferred), and the token comparison the GPU tests allow (ExpectSameTokens).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/config.h"
#include "engine/state.h"
#include "runtime/paged_state.h"
#include "runtime/step_runner.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/state_layout.h"

namespace pdserve::runtime {

struct RequestSpec {
  std::vector<int32_t> prompt;
  serving::SamplingParams params;
  int arrival_step = 0;
};

struct ChoiceOutput {
  std::vector<int32_t> tokens;
  std::string finish_reason;
  std::string error;  // on_error's status (only where errors_expected)
};
using Outputs = std::vector<std::vector<ChoiceOutput>>;

// The request's sampler and callbacks; tokens go to `out` (one entry per choice), an error to its
// choice's `error` (a test failure unless errors_expected).
inline std::shared_ptr<RequestContext> MakeContext(const engine::ModelConfig& config, size_t index,
                                                   const RequestSpec& spec,
                                                   std::vector<ChoiceOutput>* out,
                                                   bool errors_expected = false) {
  out->resize(static_cast<size_t>(spec.params.n));
  std::vector<int32_t> eos;
  for (int64_t id : config.eos_token_ids) eos.push_back(static_cast<int32_t>(id));
  auto sampler = serving::RequestSampler::Create(spec.params, absl::StrCat("req-", index), eos,
                                                 spec.prompt, config.vocab_size);
  EXPECT_TRUE(sampler.ok()) << sampler.status();
  if (!sampler.ok()) return nullptr;
  auto context = std::make_shared<RequestContext>(std::move(*sampler));
  context->on_token = [out](const TokenEvent& event) {
    ChoiceOutput& c = (*out)[static_cast<size_t>(event.choice)];
    c.tokens.push_back(event.sampled.token);
    c.finish_reason = event.finish_reason;
    return false;
  };
  context->on_error = [out, errors_expected](int32_t choice, const absl::Status& status) {
    if (!errors_expected) ADD_FAILURE() << status;
    (*out)[static_cast<size_t>(choice)].error = status.ToString();
  };
  return context;
}

template <typename Runner>
using MakeRunner =
    std::function<std::unique_ptr<Runner>(const serving::StateLayout&, serving::PagePool*)>;

// The decode worker's early import of sequence `id` (its state already in its pages): begun,
// every layer reported (the last first), verified, waited for and taken, as
// decode/early_import.cc does before it Adds the sequence.
inline void ImportEarly(EarlyImporter& importer, serving::RequestId id, int64_t prompt,
                        int64_t total, int64_t layers) {
  ASSERT_TRUE(importer.Begin(id, prompt, total).ok());
  for (int64_t layer = layers - 1; layer >= 0; --layer) importer.LayerArrived(id, layer);
  importer.Verified(id);
  absl::StatusOr<bool> ready = false;
  while (ready.ok() && !*ready) ready = importer.Ready(id);
  ASSERT_TRUE(ready.ok()) << ready.status();
  ASSERT_TRUE(importer.Take(id).ok());
}

// PD decode as the decode worker drives it (its own decode-only plans, no scheduler): each
// request's prompt state (`states[i]`, the CPU engine's) written into its pages, its first token
// `first[i]` recorded, then decode steps of every unfinished sequence until all are done. With
// `early_import`, each state goes into its slot through the runner's early importer
// (ImportEarly) before the sequence is added.
template <typename Runner>
Outputs RunTransferred(const engine::ModelConfig& config, const std::vector<RequestSpec>& specs,
                       const std::vector<engine::ModelState>& states,
                       const std::vector<int32_t>& first, const MakeRunner<Runner>& make,
                       bool early_import = false) {
  const serving::StateLayout layout = *LayoutForModel(config);
  const auto n = static_cast<int64_t>(specs.size());
  auto pool = *serving::PagePool::Create(layout.PoolOptions(n, n * config.max_position_embeddings));
  std::unique_ptr<Runner> runner = make(layout, pool.get());
  std::deque<std::vector<ChoiceOutput>> outputs(specs.size());
  std::vector<int64_t> generated(specs.size(), 1);
  std::vector<bool> done(specs.size(), false);
  for (size_t i = 0; i < specs.size(); ++i) {
    const RequestSpec& spec = specs[i];
    auto context = MakeContext(config, i, spec, &outputs[i]);
    EXPECT_NE(context, nullptr);
    if (context == nullptr) return {};
    {
      absl::MutexLock lock(&context->mu);
      EXPECT_TRUE(context->sampler.Record(0, first[i]).ok());
    }
    outputs[i][0].tokens.push_back(first[i]);
    const auto id = static_cast<serving::RequestId>(i + 1);
    SequenceSetup setup{context, 0, spec.prompt, spec.params.max_tokens};
    setup.first_token = first[i];
    const int64_t total = static_cast<int64_t>(spec.prompt.size()) + spec.params.max_tokens;
    auto table = pool->Allocate(id, layout.Demand(total));
    EXPECT_TRUE(table.ok()) << table.status();
    auto pages = MapPages(*pool, *table);
    EXPECT_TRUE(pages.ok()) << pages.status();
    EXPECT_TRUE(PagedState(config, layout, total).Store(states[i], 0, *pages).ok());
    if (early_import) {
      EXPECT_NE(runner->early_importer(), nullptr);
      if (runner->early_importer() == nullptr) return {};
      ImportEarly(*runner->early_importer(), id, static_cast<int64_t>(spec.prompt.size()), total,
                  config.num_hidden_layers);
    }
    EXPECT_TRUE(runner->Add(id, setup).ok());
    done[i] = spec.params.max_tokens == 1;
  }
  for (uint64_t step = 1;; ++step) {
    serving::StepPlan plan;
    plan.step = step;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (done[i]) continue;
      const auto position = static_cast<int64_t>(specs[i].prompt.size()) + generated[i] - 1;
      plan.decode.push_back({static_cast<serving::RequestId>(i + 1), position});
    }
    if (plan.decode.empty()) break;
    auto outcome = runner->Run(plan);
    EXPECT_TRUE(outcome.ok());
    if (!outcome.ok()) break;
    for (const serving::DecodeSlot& d : plan.decode) {
      const size_t i = d.id - 1;
      ++generated[i];
      const bool stopped = std::find(outcome->stopped.begin(), outcome->stopped.end(), d.id) !=
                           outcome->stopped.end();
      done[i] = stopped || generated[i] == specs[i].params.max_tokens;
    }
  }
  return {outputs.begin(), outputs.end()};
}

// The early import while other sequences decode, as a decode worker sees it: requests
// [0, started) are imported and added before the first step; each later request is begun before
// the first step and gets one layer reported per step (the last layer first), is verified after
// its last layer, and is added at the first step boundary at which its import is ready. Then
// decode steps of every added, unfinished sequence until all are done (steps wait, without a
// plan, while only imports remain). REQUIRES: `runner` has an early importer.
template <typename Runner>
Outputs RunStaggeredEarlyImports(const engine::ModelConfig& config,
                                 const std::vector<RequestSpec>& specs,
                                 const std::vector<engine::ModelState>& states,
                                 const std::vector<int32_t>& first, const MakeRunner<Runner>& make,
                                 size_t started) {
  const serving::StateLayout layout = *LayoutForModel(config);
  const auto n = static_cast<int64_t>(specs.size());
  auto pool = *serving::PagePool::Create(layout.PoolOptions(n, n * config.max_position_embeddings));
  std::unique_ptr<Runner> runner = make(layout, pool.get());
  EXPECT_NE(runner->early_importer(), nullptr);
  if (runner->early_importer() == nullptr) return {};
  EarlyImporter& importer = *runner->early_importer();
  const int64_t layers = config.num_hidden_layers;
  std::deque<std::vector<ChoiceOutput>> outputs(specs.size());
  std::vector<SequenceSetup> setups;
  std::vector<int64_t> generated(specs.size(), 1);
  std::vector<bool> added(specs.size(), false);
  std::vector<bool> done(specs.size(), false);
  std::vector<int64_t> next_layer(specs.size(), 0);
  for (size_t i = 0; i < specs.size(); ++i) {
    const RequestSpec& spec = specs[i];
    auto context = MakeContext(config, i, spec, &outputs[i]);
    EXPECT_NE(context, nullptr);
    if (context == nullptr) return {};
    {
      absl::MutexLock lock(&context->mu);
      EXPECT_TRUE(context->sampler.Record(0, first[i]).ok());
    }
    outputs[i][0].tokens.push_back(first[i]);
    const auto id = static_cast<serving::RequestId>(i + 1);
    setups.push_back({context, 0, spec.prompt, spec.params.max_tokens});
    setups.back().first_token = first[i];
    const auto prompt = static_cast<int64_t>(spec.prompt.size());
    const int64_t total = prompt + spec.params.max_tokens;
    auto table = pool->Allocate(id, layout.Demand(total));
    EXPECT_TRUE(table.ok()) << table.status();
    auto pages = MapPages(*pool, *table);
    EXPECT_TRUE(pages.ok()) << pages.status();
    EXPECT_TRUE(PagedState(config, layout, total).Store(states[i], 0, *pages).ok());
    done[i] = spec.params.max_tokens == 1;
    if (i < started) {
      ImportEarly(importer, id, prompt, total, layers);
      EXPECT_TRUE(runner->Add(id, setups[i]).ok());
      added[i] = true;
    } else {
      EXPECT_TRUE(importer.Begin(id, prompt, total).ok());
    }
  }
  for (uint64_t step = 1;; ++step) {
    for (size_t i = started; i < specs.size(); ++i) {
      const auto id = static_cast<serving::RequestId>(i + 1);
      if (added[i]) continue;
      if (next_layer[i] < layers) {
        importer.LayerArrived(id, layers - 1 - next_layer[i]++);
        if (next_layer[i] == layers) importer.Verified(id);
        continue;
      }
      const absl::StatusOr<bool> ready = importer.Ready(id);
      EXPECT_TRUE(ready.ok()) << ready.status();
      if (!ready.ok() || !*ready) continue;
      EXPECT_TRUE(importer.Take(id).ok());
      EXPECT_TRUE(runner->Add(id, setups[i]).ok());
      added[i] = true;
    }
    serving::StepPlan plan;
    plan.step = step;
    bool waiting = false;
    for (size_t i = 0; i < specs.size(); ++i) {
      waiting = waiting || !added[i];
      if (!added[i] || done[i]) continue;
      const auto position = static_cast<int64_t>(specs[i].prompt.size()) + generated[i] - 1;
      plan.decode.push_back({static_cast<serving::RequestId>(i + 1), position});
    }
    if (plan.decode.empty()) {
      if (!waiting) break;
      continue;  // only imports left: report their next layers / look again
    }
    auto outcome = runner->Run(plan);
    EXPECT_TRUE(outcome.ok());
    if (!outcome.ok()) break;
    for (const serving::DecodeSlot& d : plan.decode) {
      const size_t i = d.id - 1;
      ++generated[i];
      const bool stopped = std::find(outcome->stopped.begin(), outcome->stopped.end(), d.id) !=
                           outcome->stopped.end();
      done[i] = stopped || generated[i] == specs[i].params.max_tokens;
    }
  }
  return {outputs.begin(), outputs.end()};
}

// Every choice's tokens and finish equal the CPU runner's; with `max_diverged` > 0, up to that
// many choices may instead part from the CPU's at one sampled token and differ after it (the
// engines' logits differ by ~1e-3 relative, so a draw that lands within that of a boundary
// between two tokens' cumulative probabilities picks either; measured on the H200: 1 of 24
// seeded choices). A wrong key, slot or state diverges nearly every choice at its first tokens.
inline void ExpectSameTokens(const Outputs& gpu, const Outputs& cpu, int max_diverged = 0) {
  ASSERT_EQ(gpu.size(), cpu.size());
  int diverged = 0;
  for (size_t r = 0; r < gpu.size(); ++r) {
    ASSERT_EQ(gpu[r].size(), cpu[r].size());
    for (size_t c = 0; c < gpu[r].size(); ++c) {
      EXPECT_FALSE(gpu[r][c].tokens.empty());
      if (gpu[r][c].tokens == cpu[r][c].tokens) {
        EXPECT_EQ(gpu[r][c].finish_reason, cpu[r][c].finish_reason) << "request " << r;
        continue;
      }
      ++diverged;
      size_t at = 0;
      while (at < gpu[r][c].tokens.size() && at < cpu[r][c].tokens.size() &&
             gpu[r][c].tokens[at] == cpu[r][c].tokens[at]) {
        ++at;
      }
      std::printf("request %zu choice %zu: parts from the CPU runner at token %zu\n", r, c, at);
      if (max_diverged == 0) {
        EXPECT_EQ(gpu[r][c].tokens, cpu[r][c].tokens) << "request " << r << " choice " << c;
      }
    }
  }
  EXPECT_LE(diverged, max_diverged);
}

}  // namespace pdserve::runtime
