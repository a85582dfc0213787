// EngineStepRunner under the real scheduler: batch invariance (a request's tokens and logprobs
// are bit-identical alone, in a 64-request batch, and in a pool small enough that requests wait)
// and page accounting when requests are cancelled mid-prefill and mid-decode.
#include "runtime/step_runner.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "engine/model.h"
#include "gtest/gtest.h"

namespace pdserve::runtime {
namespace {

constexpr char kModelDir[] = PDSERVE_ENGINE_FIXTURES_DIR "/mixed_yarn_f32/model";
constexpr int64_t kVocab = 384;

struct RequestSpec {
  std::vector<int32_t> prompt;
  serving::SamplingParams params;
  int arrival_step = 0;
};

struct ChoiceOutput {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> logprob_bits;  // chosen token then its top alternatives, as raw bits
  std::string finish_reason;
  bool degenerate = false;  // as of the last token
};

uint32_t Bits(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

const engine::Model& SharedModel() {
  static const engine::Model* model = new engine::Model(*engine::Model::Load(kModelDir));
  return *model;
}

// A pool, a scheduler and a runner over the fixture model, stepped by hand.
class Harness {
 public:
  Harness(int64_t max_sequences, int64_t pool_tokens, int64_t token_budget,
          DegenerationAction degeneration = DegenerationAction::kFlag)
      : layout_(*LayoutForModel(SharedModel().config(), 4)) {
    pool_ = *serving::PagePool::Create(layout_.PoolOptions(max_sequences, pool_tokens));
    serving::SchedulerOptions options;
    options.token_budget = token_budget;
    options.max_running = std::min<int64_t>(64, token_budget - 1);
    scheduler_ = *serving::Scheduler::Create(
        options, pool_.get(), [this](int64_t total) { return layout_.Demand(total); }, &clock_,
        nullptr);
    RunnerOptions runner_options;
    runner_options.prefill_block = 8;
    runner_options.threads = 2;  // results must not depend on the threads either
    runner_options.degeneration = degeneration;
    runner_ =
        std::make_unique<EngineStepRunner>(SharedModel(), layout_, pool_.get(), runner_options);
  }

  // Submits request `index`; returns its sequence ids (one per choice).
  std::vector<serving::RequestId> Submit(int index, const RequestSpec& spec) {
    outputs_.resize(std::max<size_t>(outputs_.size(), index + 1));
    outputs_[index].resize(spec.params.n);
    auto sampler = serving::RequestSampler::Create(spec.params, absl::StrCat("req-", index),
                                                   std::vector<int32_t>{1}, spec.prompt, kVocab);
    EXPECT_TRUE(sampler.ok()) << sampler.status();
    auto context = std::make_shared<RequestContext>(std::move(*sampler));
    std::vector<ChoiceOutput>* out = &outputs_[index];
    context->on_token = [out](const TokenEvent& event) {
      ChoiceOutput& c = (*out)[event.choice];
      c.tokens.push_back(event.sampled.token);
      c.logprob_bits.push_back(Bits(event.sampled.logprob));
      for (const serving::TokenLogprob& top : event.sampled.top_logprobs) {
        c.logprob_bits.push_back(static_cast<uint32_t>(top.token));
        c.logprob_bits.push_back(Bits(top.logprob));
      }
      c.finish_reason = event.finish_reason;
      c.degenerate = event.degenerate;
      return false;
    };
    context->on_error = [](int32_t, const absl::Status& status) { ADD_FAILURE() << status; };
    std::vector<serving::RequestId> ids;
    for (int32_t c = 0; c < spec.params.n; ++c) {
      const serving::RequestId id = next_id_++;
      EXPECT_TRUE(runner_->Add(id, {context, c, spec.prompt, spec.params.max_tokens}).ok());
      EXPECT_TRUE(
          scheduler_->Submit({id, static_cast<int64_t>(spec.prompt.size()), spec.params.max_tokens})
              .ok());
      ids.push_back(id);
    }
    return ids;
  }

  void Step() {
    absl::StatusOr<serving::Scheduler::StepResult> result = scheduler_->Step(*runner_);
    ASSERT_TRUE(result.ok()) << result.status();
    for (serving::RequestId id : result->finished) runner_->Remove(id);
  }
  bool Busy() const { return scheduler_->num_waiting() + scheduler_->num_running() > 0; }
  void Cancel(serving::RequestId id) {
    ASSERT_TRUE(scheduler_->Cancel(id).ok());
    runner_->Remove(id);
  }
  bool PoolFullyFree() const {
    for (int32_t k = 0; k < pool_->num_kinds(); ++k) {
      if (pool_->pages_free(k) != pool_->pages_total(k)) return false;
    }
    return pool_->num_owners() == 0;
  }

  serving::Scheduler& scheduler() { return *scheduler_; }
  std::vector<std::vector<ChoiceOutput>> outputs() const {
    return {outputs_.begin(), outputs_.end()};
  }

 private:
  serving::StateLayout layout_;
  SystemClock clock_;
  std::unique_ptr<serving::PagePool> pool_;
  std::unique_ptr<serving::Scheduler> scheduler_;
  std::unique_ptr<EngineStepRunner> runner_;
  serving::RequestId next_id_ = 1;
  std::deque<std::vector<ChoiceOutput>> outputs_;  // grows without moving earlier requests'
};

// 64 requests: prompts of 1..30 tokens (the window is 8), six sampling set-ups, staggered
// arrivals, 3..8 new tokens (EOS may end a choice earlier).
std::vector<RequestSpec> MixedRequests() {
  std::vector<RequestSpec> specs;
  for (int i = 0; i < 64; ++i) {
    RequestSpec s;
    const int length = 1 + (i * 7) % 30;
    for (int t = 0; t < length; ++t) s.prompt.push_back(2 + (i * 31 + t * 17) % (kVocab - 2));
    serving::SamplingParams& p = s.params;
    p.max_tokens = 3 + i % 6;
    p.seed = 1000 + i;
    p.logprobs = 2;
    switch (i % 6) {
      case 0:
        p.top_p = 0.9;
        break;
      case 1:
        p.top_k = 20;
        break;
      case 2:
        p.min_p = 0.1;
        p.repetition_penalty = 1.2;
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.3;
        break;
      case 3:
        p.n = 2;
        p.temperature = 0.8;
        break;
      case 4:
        p.temperature = 0;
        break;
      case 5:
        p.temperature = 1.0;
        p.seed.reset();  // derived from the request id
        break;
    }
    s.arrival_step = i / 3;
    specs.push_back(std::move(s));
  }
  return specs;
}

std::vector<std::vector<ChoiceOutput>> RunBatch(const std::vector<RequestSpec>& specs,
                                                Harness& harness) {
  size_t next = 0;
  for (int step = 0; next < specs.size() || harness.Busy(); ++step) {
    while (next < specs.size() && specs[next].arrival_step <= step) {
      harness.Submit(static_cast<int>(next), specs[next]);
      ++next;
    }
    if (harness.Busy()) harness.Step();
  }
  EXPECT_TRUE(harness.PoolFullyFree());
  return harness.outputs();
}

std::vector<ChoiceOutput> RunAlone(const RequestSpec& spec, int index) {
  Harness harness(1, 64, 512);
  harness.Submit(index, spec);
  while (harness.Busy()) harness.Step();
  return harness.outputs()[index];
}

void ExpectMatchesAlone(const std::vector<RequestSpec>& specs,
                        const std::vector<std::vector<ChoiceOutput>>& batch) {
  ASSERT_EQ(batch.size(), specs.size());
  int finished_early = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::vector<ChoiceOutput> alone = RunAlone(specs[i], static_cast<int>(i));
    ASSERT_EQ(alone.size(), batch[i].size());
    for (size_t c = 0; c < alone.size(); ++c) {
      SCOPED_TRACE(absl::StrCat("request ", i, " choice ", c));
      ASSERT_FALSE(alone[c].tokens.empty());
      EXPECT_EQ(batch[i][c].tokens, alone[c].tokens);
      EXPECT_EQ(batch[i][c].logprob_bits, alone[c].logprob_bits);
      EXPECT_EQ(batch[i][c].finish_reason, alone[c].finish_reason);
      if (static_cast<int>(alone[c].tokens.size()) < specs[i].params.max_tokens) ++finished_early;
    }
  }
  // n = 2 choices differ somewhere (they are independent samples).
  EXPECT_NE(batch[3][0].tokens, batch[3][1].tokens);
  ::testing::Test::RecordProperty("finished_early", finished_early);
}

TEST(StepRunnerTest, BatchOf64MatchesEachRequestAlone) {
  const std::vector<RequestSpec> specs = MixedRequests();
  Harness harness(64, 64 * 64, 80);
  ExpectMatchesAlone(specs, RunBatch(specs, harness));
}

TEST(StepRunnerTest, SmallPoolWhereRequestsWaitMatchesEachRequestAlone) {
  const std::vector<RequestSpec> specs = MixedRequests();
  Harness harness(6, 120, 80);
  bool waited = false;
  size_t next = 0;
  for (int step = 0; next < specs.size() || harness.Busy(); ++step) {
    while (next < specs.size() && specs[next].arrival_step <= step) {
      harness.Submit(static_cast<int>(next), specs[next]);
      ++next;
    }
    waited = waited || harness.scheduler().num_waiting() > 0;
    if (harness.Busy()) harness.Step();
  }
  EXPECT_TRUE(waited);
  EXPECT_TRUE(harness.PoolFullyFree());
  ExpectMatchesAlone(specs, harness.outputs());
}

RequestSpec LongRequest() {
  RequestSpec spec;
  for (int t = 0; t < 30; ++t) spec.prompt.push_back(2 + t * 11 % 300);
  spec.params.max_tokens = 20;
  spec.params.seed = 5;
  spec.params.stop_token_ids = {};
  return spec;
}

TEST(StepRunnerTest, CancelMidPrefillFreesEveryPage) {
  Harness harness(4, 256, 10);
  const serving::RequestId id = harness.Submit(0, LongRequest())[0];
  harness.Step();
  ASSERT_EQ(harness.scheduler().Find(id)->phase, serving::SequencePhase::kPrefill);
  EXPECT_EQ(harness.scheduler().Find(id)->prefilled, 10);
  EXPECT_FALSE(harness.PoolFullyFree());
  harness.Cancel(id);
  EXPECT_TRUE(harness.PoolFullyFree());
  EXPECT_FALSE(harness.Busy());
}

TEST(StepRunnerTest, CancelMidDecodeFreesEveryPage) {
  Harness harness(4, 256, 64);
  RequestSpec spec = LongRequest();
  spec.params.temperature = 0;
  spec.params.min_tokens = 20;  // no early EOS
  const serving::RequestId id = harness.Submit(0, spec)[0];
  for (int i = 0; i < 4; ++i) harness.Step();
  ASSERT_EQ(harness.scheduler().Find(id)->phase, serving::SequencePhase::kDecode);
  EXPECT_EQ(harness.outputs()[0][0].tokens.size(), 4u);
  harness.Cancel(id);
  EXPECT_TRUE(harness.PoolFullyFree());
  EXPECT_FALSE(harness.Busy());
}

// A logit_bias of +100 on one token makes the output that token repeated: degenerate after the
// detector's default 24-token span.
RequestSpec RepeatingRequest() {
  RequestSpec spec;
  spec.prompt = {5, 6, 7};
  spec.params.max_tokens = 40;
  spec.params.seed = 9;
  spec.params.logit_bias = {{42, 100.0}};
  return spec;
}

TEST(StepRunnerTest, DegenerateChoiceIsFlaggedAndContinuesByDefault) {
  Harness harness(1, 64, 64);
  harness.Submit(0, RepeatingRequest());
  while (harness.Busy()) harness.Step();
  const ChoiceOutput out = harness.outputs()[0][0];
  EXPECT_EQ(out.tokens, std::vector<int32_t>(40, 42));
  EXPECT_TRUE(out.degenerate);
  EXPECT_EQ(out.finish_reason, "length");
}

TEST(StepRunnerTest, DegenerateChoiceStopsWhenConfigured) {
  Harness harness(1, 64, 64, DegenerationAction::kStop);
  harness.Submit(0, RepeatingRequest());
  while (harness.Busy()) harness.Step();
  const ChoiceOutput out = harness.outputs()[0][0];
  EXPECT_EQ(out.tokens.size(), 24u);
  EXPECT_EQ(out.finish_reason, "degenerate");
  EXPECT_TRUE(harness.PoolFullyFree());
}

}  // namespace
}  // namespace pdserve::runtime
