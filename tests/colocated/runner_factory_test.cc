// ColocatedService with a RunnerFactory (what `pdserve serve --backend cuda` passes), on a fake
// runner: the canary is no longer refused, the factory's RunnerOptions say whether canary choices
// will come (RunnerOptions::canary, the CUDA runner's recompute slot) and with which tolerance,
// and a picked request's choices reach the runner marked as canary choices.
#include <memory>
#include <variant>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "colocated/service.h"
#include "gtest/gtest.h"

namespace pdserve::colocated {
namespace {

// Registers sequences and computes nothing (no token is ever delivered).
class FakeRunner : public runtime::SequenceRunner {
 public:
  absl::Status Add(serving::RequestId, runtime::SequenceSetup setup) override {
    absl::MutexLock lock(&mu_);
    canary_flags_.push_back(setup.canary);
    ++sequences_;
    return absl::OkStatus();
  }
  void Remove(serving::RequestId) override {
    absl::MutexLock lock(&mu_);
    --sequences_;
  }
  int64_t num_sequences() const override {
    absl::MutexLock lock(&mu_);
    return sequences_;
  }
  runtime::GuardCounts guard_counts() const override { return {}; }
  absl::StatusOr<serving::StepOutcome> Run(const serving::StepPlan&) override {
    absl::SleepFor(absl::Milliseconds(1));
    return serving::StepOutcome{};
  }
  // The canary flags of the sequences added so far, once there are `n` (empty after 10 s).
  std::vector<bool> WaitForAdds(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return canary_flags_.size() >= n; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10))) return {};
    return canary_flags_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<bool> canary_flags_ ABSL_GUARDED_BY(mu_);
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
};

class NullSink : public frontend::GenerationSink {
 public:
  void OnDelta(frontend::ChoiceDelta) override {}
  void OnComplete(frontend::Usage) override {}
  void OnError(frontend::ApiError) override {}
};

struct Made {
  std::unique_ptr<ColocatedService> service;
  FakeRunner* runner = nullptr;  // owned by the service
  runtime::RunnerContext context;
};

Made Make(int64_t canary_every, double tolerance = 0) {
  Made made;
  ServiceOptions options;
  options.model_dir = PDSERVE_BUNDLED_MODEL;
  options.max_batch = 4;
  options.token_budget = 64;
  options.canary_every = canary_every;
  options.runner.canary_tolerance = tolerance;
  options.runner_factory = [&made](const runtime::RunnerContext& context)
      -> absl::StatusOr<std::unique_ptr<runtime::SequenceRunner>> {
    made.context = context;
    auto runner = std::make_unique<FakeRunner>();
    made.runner = runner.get();
    return std::unique_ptr<runtime::SequenceRunner>(std::move(runner));
  };
  absl::StatusOr<std::unique_ptr<ColocatedService>> service = ColocatedService::Create(options);
  EXPECT_TRUE(service.ok()) << service.status();
  if (service.ok()) made.service = std::move(*service);
  return made;
}

TEST(ServiceRunnerFactoryTest, CanaryIsAcceptedAndReachesTheRunnerOptions) {
  Made off = Make(0);
  ASSERT_NE(off.service, nullptr);
  EXPECT_FALSE(off.context.options.canary);
  EXPECT_EQ(off.context.slots, 4);
  Made on = Make(3, 0.02);
  ASSERT_NE(on.service, nullptr);
  EXPECT_TRUE(on.context.options.canary);
  EXPECT_DOUBLE_EQ(on.context.options.canary_tolerance, 0.02);
}

TEST(ServiceRunnerFactoryTest, PickedRequestsReachTheRunnerAsCanaryChoices) {
  for (int64_t every : {0, 1}) {
    Made made = Make(every);
    ASSERT_NE(made.service, nullptr);
    frontend::ApiRequest req;
    req.model = "kjv-v4-tiny";
    req.prompt_text = "In the beginning";
    req.max_tokens = 4;
    req.n = 2;
    frontend::StartResult started = made.service->Start(req, std::make_shared<NullSink>());
    ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
    EXPECT_EQ(made.runner->WaitForAdds(2), std::vector<bool>(2, every == 1)) << "every " << every;
  }
}

}  // namespace
}  // namespace pdserve::colocated
