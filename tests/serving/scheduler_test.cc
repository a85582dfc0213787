#include "serving/scheduler.h"

#include <algorithm>
#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::serving {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr int64_t kTokensPerPage = 16;

class FakeClock final : public Clock {
 public:
  absl::Time Now() const override { return now_; }
  void Advance(absl::Duration d) { now_ += d; }

 private:
  absl::Time now_ = absl::UnixEpoch();
};

// Keeps released tables until the test lets them go, like the PD transfer fence.
class HoldingFence final : public ReleaseFence {
 public:
  explicit HoldingFence(PagePool* pool) : pool_(pool) {}
  absl::Status Release(PageTable table) override {
    held_.push_back(std::move(table));
    return absl::OkStatus();
  }
  absl::Status FreeAll() {
    for (const PageTable& table : held_) {
      if (absl::Status status = pool_->Free(table); !status.ok()) return status;
    }
    held_.clear();
    return absl::OkStatus();
  }
  const std::vector<PageTable>& held() const { return held_; }

 private:
  PagePool* pool_;
  std::vector<PageTable> held_;
};

class SchedulerTest : public ::testing::Test {
 protected:
  // One page kind of kTokensPerPage rows; a sequence of T tokens needs ceil(T / 16) pages.
  void Init(int64_t pages, SchedulerOptions options, ReleaseFence* fence = nullptr) {
    PagePoolOptions pool_options;
    pool_options.kinds = {{"state", pages, kTokensPerPage, 4}};
    pool_ = std::move(PagePool::Create(pool_options)).value();
    auto scheduler = Scheduler::Create(
        options, pool_.get(),
        [](int64_t tokens) { return PageDemand{(tokens + kTokensPerPage - 1) / kTokensPerPage}; },
        &clock_, fence);
    ASSERT_TRUE(scheduler.ok()) << scheduler.status();
    scheduler_ = std::move(scheduler).value();
  }

  static SchedulerOptions Options(int64_t budget, int64_t max_running,
                                  AdmissionPolicy policy = AdmissionPolicy::kWait) {
    SchedulerOptions options;
    options.token_budget = budget;
    options.max_running = max_running;
    options.policy = policy;
    return options;
  }

  StepPlan Build() {
    auto plan = scheduler_->BuildStep();
    EXPECT_TRUE(plan.ok()) << plan.status();
    return plan.ok() ? *plan : StepPlan{};
  }

  std::vector<RequestId> Complete(std::vector<RequestId> stopped = {}) {
    auto finished = scheduler_->CompleteStep({std::move(stopped)});
    EXPECT_TRUE(finished.ok()) << finished.status();
    return finished.ok() ? *finished : std::vector<RequestId>{};
  }

  FakeClock clock_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<Scheduler> scheduler_;
};

std::vector<RequestId> DecodeIds(const StepPlan& plan) {
  std::vector<RequestId> ids;
  for (const DecodeSlot& slot : plan.decode) ids.push_back(slot.id);
  return ids;
}

TEST_F(SchedulerTest, CreateRejectsBudgetNotAboveMaxRunning) {
  PagePoolOptions pool_options;
  pool_options.kinds = {{"state", 4, 16, 4}};
  auto pool = std::move(PagePool::Create(pool_options)).value();
  auto demand = [](int64_t) { return PageDemand{1}; };
  auto scheduler = Scheduler::Create(Options(8, 8), pool.get(), demand, &clock_, nullptr);
  EXPECT_EQ(scheduler.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(scheduler.status().message(), "token_budget (8) must exceed max_running (8)");
}

TEST_F(SchedulerTest, ChunkedPrefillThenOneDecodeTokenPerStep) {
  Init(8, Options(8, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 20, 3}).ok());
  // Prompt of 20 under a budget of 8: chunks 8, 8, 4; the last one samples the first token.
  StepPlan plan = Build();
  ASSERT_EQ(plan.prefill.size(), 1u);
  EXPECT_EQ(plan.prefill[0].start, 0);
  EXPECT_EQ(plan.prefill[0].length, 8);
  EXPECT_FALSE(plan.prefill[0].completes_prompt);
  Complete();
  plan = Build();
  EXPECT_EQ(plan.prefill[0].start, 8);
  EXPECT_EQ(plan.prefill[0].length, 8);
  Complete();
  plan = Build();
  EXPECT_EQ(plan.prefill[0].start, 16);
  EXPECT_EQ(plan.prefill[0].length, 4);
  EXPECT_TRUE(plan.prefill[0].completes_prompt);
  EXPECT_THAT(Complete(), IsEmpty());
  EXPECT_EQ(scheduler_->Find(1)->phase, SequencePhase::kDecode);
  EXPECT_EQ(scheduler_->Find(1)->generated, 1);
  // Two decode steps (inputs at positions 20 and 21) bring it to max_tokens = 3.
  plan = Build();
  EXPECT_TRUE(plan.prefill.empty());
  ASSERT_EQ(plan.decode.size(), 1u);
  EXPECT_EQ(plan.decode[0].position, 20);
  EXPECT_THAT(Complete(), IsEmpty());
  plan = Build();
  EXPECT_EQ(plan.decode[0].position, 21);
  EXPECT_THAT(Complete(), ElementsAre(1u));
  EXPECT_FALSE(scheduler_->Find(1).has_value());
  EXPECT_EQ(pool_->pages_free(0), 8);
}

TEST_F(SchedulerTest, DecodesInterleaveWithPrefillUnderTheBudget) {
  Init(64, Options(10, 8));
  ASSERT_TRUE(scheduler_->Submit({1, 4, 50}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 4, 50}).ok());
  Build();
  Complete();  // both prefilled (4 + 4 <= 10)
  ASSERT_TRUE(scheduler_->Submit({3, 30, 5}).ok());
  const StepPlan plan = Build();
  EXPECT_THAT(DecodeIds(plan), ElementsAre(1u, 2u));
  ASSERT_EQ(plan.prefill.size(), 1u);
  EXPECT_EQ(plan.prefill[0].id, 3u);
  EXPECT_EQ(plan.prefill[0].length, 8);  // budget 10 - 2 decode tokens
  EXPECT_EQ(plan.tokens(), 10);
}

TEST_F(SchedulerTest, EveryStepRespectsBudgetAndDecodesEachRunningSequenceOnce) {
  Init(40, Options(16, 6));
  RequestId next_id = 0;
  for (int step = 0; step < 200; ++step) {
    if (step % 3 == 0) {
      ASSERT_TRUE(scheduler_
                      ->Submit({next_id, static_cast<int64_t>(1 + (next_id * 7) % 29),
                                static_cast<int64_t>(1 + (next_id * 5) % 11)})
                      .ok());
      ++next_id;
    }
    const StepPlan plan = Build();
    EXPECT_LE(plan.tokens(), 16);
    std::vector<RequestId> ids = DecodeIds(plan);
    for (const PrefillChunk& chunk : plan.prefill) ids.push_back(chunk.id);
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << "a sequence twice";
    EXPECT_EQ(static_cast<int64_t>(plan.decode.size()), scheduler_->num_decoding());
    EXPECT_LE(scheduler_->num_running(), 6);
    Complete();
  }
  EXPECT_GT(next_id, 60u);
}

TEST_F(SchedulerTest, ExhaustedPoolMakesSequencesWait) {
  Init(4, Options(64, 8));
  ASSERT_TRUE(scheduler_->Submit({1, 40, 8}).ok());  // 48 tokens: 3 pages
  ASSERT_TRUE(scheduler_->Submit({2, 20, 8}).ok());  // 28 tokens: 2 pages, only 1 left
  EXPECT_EQ(scheduler_->num_running(), 1);
  EXPECT_EQ(scheduler_->num_waiting(), 1);
  EXPECT_EQ(scheduler_->Find(2)->phase, SequencePhase::kWaiting);
  const StepPlan plan = Build();
  ASSERT_EQ(plan.prefill.size(), 1u);
  EXPECT_EQ(plan.prefill[0].id, 1u);
  EXPECT_EQ(pool_->pages_used(0), 3);
}

TEST_F(SchedulerTest, RejectPolicyRefusesWithUnavailable) {
  Init(4, Options(64, 8, AdmissionPolicy::kReject));
  ASSERT_TRUE(scheduler_->Submit({1, 40, 8}).ok());
  const absl::Status status = scheduler_->Submit({2, 20, 8});
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(scheduler_->num_waiting(), 0);
  EXPECT_FALSE(scheduler_->Find(2).has_value());
  EXPECT_EQ(pool_->pages_used(0), 3);
}

TEST_F(SchedulerTest, MaxRunningLimitsAdmission) {
  Init(64, Options(64, 2, AdmissionPolicy::kReject));
  ASSERT_TRUE(scheduler_->Submit({1, 4, 4}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 4, 4}).ok());
  EXPECT_EQ(scheduler_->Submit({3, 4, 4}).code(), absl::StatusCode::kUnavailable);
}

TEST_F(SchedulerTest, SequenceLargerThanThePoolIsInvalidArgument) {
  Init(4, Options(64, 8));
  const absl::Status status = scheduler_->Submit({1, 60, 10});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(),
            "sequence 1 of 70 tokens needs 5 pages of kind 'state'; the pool has 4");
}

TEST_F(SchedulerTest, WaitingSequenceIsAdmittedWhenPagesAreFreed) {
  Init(4, Options(64, 8));
  ASSERT_TRUE(scheduler_->Submit({1, 40, 1}).ok());  // 3 pages, finishes after its prefill
  ASSERT_TRUE(scheduler_->Submit({2, 20, 8}).ok());  // 2 pages: waits
  Build();
  EXPECT_THAT(Complete(), ElementsAre(1u));
  EXPECT_EQ(scheduler_->num_waiting(), 1);
  const StepPlan plan = Build();
  ASSERT_EQ(plan.prefill.size(), 1u);
  EXPECT_EQ(plan.prefill[0].id, 2u);
  EXPECT_EQ(scheduler_->num_waiting(), 0);
  EXPECT_EQ(pool_->pages_used(0), 2);
}

TEST_F(SchedulerTest, AdmissionIsFifoEvenWhenALaterSequenceWouldFit) {
  Init(4, Options(64, 8));
  ASSERT_TRUE(scheduler_->Submit({1, 40, 8}).ok());  // 3 pages
  ASSERT_TRUE(scheduler_->Submit({2, 40, 8}).ok());  // 3 pages: waits
  ASSERT_TRUE(scheduler_->Submit({3, 8, 8}).ok());   // 1 page would fit, but 2 is ahead
  Build();
  EXPECT_EQ(scheduler_->Find(3)->phase, SequencePhase::kWaiting);
  Complete();
  ASSERT_TRUE(scheduler_->Cancel(1).ok());
  Build();
  EXPECT_EQ(scheduler_->Find(2)->phase, SequencePhase::kPrefill);
  EXPECT_EQ(scheduler_->Find(3)->phase, SequencePhase::kPrefill);
}

TEST_F(SchedulerTest, PrefillBudgetGoesToTheOldestAdmissionFirst) {
  Init(64, Options(10, 8));
  ASSERT_TRUE(scheduler_->Submit({1, 7, 4}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 7, 4}).ok());
  const StepPlan plan = Build();
  ASSERT_EQ(plan.prefill.size(), 2u);
  EXPECT_EQ(plan.prefill[0].id, 1u);
  EXPECT_EQ(plan.prefill[0].length, 7);
  EXPECT_EQ(plan.prefill[1].id, 2u);
  EXPECT_EQ(plan.prefill[1].length, 3);
}

TEST_F(SchedulerTest, CancelMidPrefillFreesPagesAtOnce) {
  Init(8, Options(8, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 40, 8}).ok());
  Build();
  Complete();
  EXPECT_EQ(scheduler_->Find(1)->prefilled, 8);
  EXPECT_EQ(pool_->pages_used(0), 3);
  ASSERT_TRUE(scheduler_->Cancel(1).ok());
  EXPECT_EQ(pool_->pages_used(0), 0);
  EXPECT_FALSE(scheduler_->Find(1).has_value());
  EXPECT_TRUE(Build().empty());
}

TEST_F(SchedulerTest, CancelMidDecodeFreesPagesAtOnce) {
  Init(8, Options(64, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 8, 30}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 8, 30}).ok());
  Build();
  Complete();
  Build();
  Complete();
  EXPECT_EQ(scheduler_->Find(1)->generated, 2);
  ASSERT_TRUE(scheduler_->Cancel(1).ok());
  EXPECT_EQ(pool_->pages_used(0), 3);  // sequence 2's 3 pages stay
  EXPECT_THAT(DecodeIds(Build()), ElementsAre(2u));
}

TEST_F(SchedulerTest, CancelDuringTheStepInFlightFreesWhenTheStepCompletes) {
  Init(8, Options(64, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 8, 30}).ok());
  Build();
  ASSERT_TRUE(scheduler_->Cancel(1).ok());
  EXPECT_EQ(pool_->pages_used(0), 3) << "the engine may still write these pages";
  EXPECT_FALSE(scheduler_->Find(1).has_value());
  EXPECT_EQ(scheduler_->Cancel(1).code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Complete(), IsEmpty());
  EXPECT_EQ(pool_->pages_used(0), 0);
}

TEST_F(SchedulerTest, CancelWaitingSequenceNeedsNoPages) {
  Init(2, Options(64, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 20, 4}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 20, 4}).ok());
  ASSERT_TRUE(scheduler_->Cancel(2).ok());
  EXPECT_EQ(scheduler_->num_waiting(), 0);
  EXPECT_EQ(pool_->pages_used(0), 2);
  EXPECT_EQ(scheduler_->Cancel(99).code(), absl::StatusCode::kNotFound);
}

TEST_F(SchedulerTest, StoppedSequenceFinishesBeforeMaxTokens) {
  Init(8, Options(64, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 8, 30}).ok());
  Build();
  EXPECT_THAT(Complete({1}), ElementsAre(1u));
  EXPECT_EQ(pool_->pages_used(0), 0);
}

TEST_F(SchedulerTest, OutcomeNamingAnUnsampledSequenceIsRejected) {
  Init(8, Options(8, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 20, 4}).ok());
  Build();  // a partial prefill chunk samples nothing
  auto finished = scheduler_->CompleteStep({{1}});
  EXPECT_EQ(finished.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(finished.status().message(), "step 1 sampled no token for sequence 1");
  EXPECT_EQ(scheduler_->BuildStep().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Complete(), IsEmpty());
  EXPECT_EQ(scheduler_->CompleteStep({}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(SchedulerTest, WaitingLongerThanMaxQueueTimeExpires) {
  SchedulerOptions options = Options(64, 4);
  options.max_queue_time = absl::Seconds(5);
  Init(2, options);
  ASSERT_TRUE(scheduler_->Submit({1, 20, 4}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 20, 4}).ok());
  clock_.Advance(absl::Seconds(4));
  EXPECT_THAT(Build().expired, IsEmpty());
  Complete();
  clock_.Advance(absl::Seconds(1));
  EXPECT_THAT(Build().expired, ElementsAre(2u));
  EXPECT_FALSE(scheduler_->Find(2).has_value());
  EXPECT_TRUE(scheduler_->Find(1).has_value()) << "running sequences never expire";
}

TEST_F(SchedulerTest, ReleaseFenceHoldsPagesUntilItFreesThem) {
  HoldingFence* fence = nullptr;
  PagePoolOptions pool_options;
  pool_options.kinds = {{"state", 2, kTokensPerPage, 4}};
  pool_ = std::move(PagePool::Create(pool_options)).value();
  auto holding = std::make_unique<HoldingFence>(pool_.get());
  fence = holding.get();
  scheduler_ = std::move(Scheduler::Create(
                             Options(64, 4), pool_.get(), [](int64_t) { return PageDemand{2}; },
                             &clock_, fence))
                   .value();
  ASSERT_TRUE(scheduler_->Submit({1, 8, 8}).ok());
  ASSERT_TRUE(scheduler_->Submit({2, 8, 8}).ok());
  ASSERT_TRUE(scheduler_->Cancel(1).ok());
  ASSERT_EQ(fence->held().size(), 1u);
  EXPECT_EQ(fence->held()[0].owner, 1u);
  EXPECT_EQ(pool_->pages_used(0), 2) << "pages stay owned until the fence frees them";
  EXPECT_TRUE(Build().empty());
  Complete();
  ASSERT_TRUE(fence->FreeAll().ok());
  EXPECT_EQ(Build().prefill.size(), 1u);
}

TEST_F(SchedulerTest, ConcurrentSubmitAndCancelWithAStepLoopLeaveNoPagesBehind) {
  Init(32, Options(64, 16));
  std::vector<std::thread> clients;
  for (RequestId client = 0; client < 3; ++client) {
    clients.emplace_back([this, client] {
      for (RequestId i = 0; i < 200; ++i) {
        const RequestId id = client * 1000 + i;
        if (!scheduler_->Submit({id, 20, 4}).ok()) continue;
        if (i % 3 == 0) scheduler_->Cancel(id).IgnoreError();  // may have finished already
      }
    });
  }
  for (int step = 0;
       step < 2000 && (step < 50 || scheduler_->num_running() > 0 || scheduler_->num_waiting() > 0);
       ++step) {
    const StepPlan plan = Build();
    EXPECT_LE(plan.tokens(), 64);
    Complete();
  }
  for (auto& client : clients) client.join();
  while (scheduler_->num_running() > 0 || scheduler_->num_waiting() > 0) {
    Build();
    Complete();
  }
  EXPECT_EQ(pool_->pages_used(0), 0);
  EXPECT_EQ(pool_->num_owners(), 0);
}

class ScriptedRunner final : public StepRunner {
 public:
  absl::StatusOr<StepOutcome> Run(const StepPlan& plan) override {
    plans.push_back(plan);
    if (fail) return absl::InternalError("engine failed");
    return StepOutcome{};
  }
  std::vector<StepPlan> plans;
  bool fail = false;
};

TEST_F(SchedulerTest, StepRunsThePlanAndAbortsOnRunnerError) {
  Init(8, Options(8, 4));
  ASSERT_TRUE(scheduler_->Submit({1, 12, 2}).ok());
  ScriptedRunner runner;
  runner.fail = true;
  EXPECT_EQ(scheduler_->Step(runner).status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(scheduler_->Find(1)->prefilled, 0) << "a failed step records no progress";
  runner.fail = false;
  auto result = scheduler_->Step(runner);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->plan.prefill[0].length, 8);
  EXPECT_EQ(scheduler_->Find(1)->prefilled, 8);
  EXPECT_EQ(runner.plans.size(), 2u);
}

}  // namespace
}  // namespace pdserve::serving
