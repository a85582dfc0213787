// ColocatedService on the bundled model: cancellation frees pages, stop strings end a choice with
// the stop text held back, context and pool limits map to their HTTP errors.
#include "colocated/service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "serving/state_layout.h"

namespace pdserve::colocated {
namespace {

class CollectingSink : public frontend::GenerationSink {
 public:
  void OnDelta(frontend::ChoiceDelta delta) override {
    absl::MutexLock lock(&mu_);
    text_ += delta.text;
    ++deltas_;
    kinds_.push_back(delta.degeneration_kind.value_or(""));
    if (delta.finish_reason) finish_ = *delta.finish_reason;
  }
  void OnComplete(frontend::Usage usage) override {
    absl::MutexLock lock(&mu_);
    usage_ = usage;
    done_.Notify();
  }
  void OnError(frontend::ApiError error) override {
    absl::MutexLock lock(&mu_);
    error_ = error.message;
    done_.Notify();
  }
  bool WaitDone() { return done_.WaitForNotificationWithTimeout(absl::Seconds(60)); }
  bool WaitDeltas(int n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return deltas_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(60));
  }
  std::string text() {
    absl::MutexLock lock(&mu_);
    return text_;
  }
  std::string finish() {
    absl::MutexLock lock(&mu_);
    return finish_;
  }
  frontend::Usage usage() {
    absl::MutexLock lock(&mu_);
    return usage_;
  }
  // Per delta: its degeneration_kind, or "".
  std::vector<std::string> kinds() {
    absl::MutexLock lock(&mu_);
    return kinds_;
  }

 private:
  absl::Mutex mu_;
  absl::Notification done_;
  std::string text_ ABSL_GUARDED_BY(mu_);
  std::string finish_ ABSL_GUARDED_BY(mu_);
  std::string error_ ABSL_GUARDED_BY(mu_);
  int deltas_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> kinds_ ABSL_GUARDED_BY(mu_);
  frontend::Usage usage_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<ColocatedService> NewService(ServiceOptions options = {}) {
  options.model_dir = PDSERVE_BUNDLED_MODEL;
  absl::StatusOr<std::unique_ptr<ColocatedService>> service = ColocatedService::Create(options);
  EXPECT_TRUE(service.ok()) << service.status();
  return std::move(*service);
}

frontend::ApiRequest Completion(std::string prompt, int64_t max_tokens) {
  frontend::ApiRequest req;
  req.model = "kjv-v4-tiny";
  req.prompt_text = std::move(prompt);
  req.max_tokens = max_tokens;
  req.temperature = 0;
  return req;
}

bool PoolFullyFree(const serving::PagePool& pool) {
  for (int32_t k = 0; k < pool.num_kinds(); ++k) {
    if (pool.pages_free(k) != pool.pages_total(k)) return false;
  }
  return true;
}

// Polls until the scheduler has let go of every sequence (the loop thread releases them).
bool WaitIdle(const ColocatedService& service) {
  for (int i = 0; i < 6000; ++i) {
    if (service.scheduler().num_running() == 0 && service.scheduler().num_waiting() == 0 &&
        service.active_sequences() == 0 && PoolFullyFree(service.pool())) {
      return true;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

TEST(ColocatedServiceTest, CancelMidDecodeFreesEveryPage) {
  auto service = NewService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion("And it came to pass", 400), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(sink->WaitDeltas(2));
  EXPECT_FALSE(PoolFullyFree(service->pool()));
  std::get<std::unique_ptr<frontend::Generation>>(started)->Cancel();
  EXPECT_TRUE(WaitIdle(*service));
  EXPECT_TRUE(sink->finish().empty());  // cancelled, not finished
}

// degeneration flag: the choice goes on, and every delta from the flagged token on carries the
// kind (the response's "degenerate" / "degeneration_kind").
TEST(ColocatedServiceTest, DegenerateChoiceIsFlaggedWithItsKindInTheDeltas) {
  std::unique_ptr<ColocatedService> service = NewService();
  frontend::ApiRequest req = Completion("And God said", 40);
  req.logit_bias = {{500, 100.0}};  // the same token every time: a repeat
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(req, sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(sink->WaitDone());
  EXPECT_EQ(sink->finish(), "length");
  EXPECT_EQ(sink->usage().completion_tokens, 40);
  const std::vector<std::string> kinds = sink->kinds();
  ASSERT_FALSE(kinds.empty());
  EXPECT_EQ(kinds.front(), "");       // not repetitive yet
  EXPECT_EQ(kinds.back(), "repeat");  // ... flagged before the end, and still flagged
  const size_t first = std::find(kinds.begin(), kinds.end(), "repeat") - kinds.begin();
  for (size_t i = first; i < kinds.size(); ++i) EXPECT_EQ(kinds[i], "repeat") << i;
}

TEST(ColocatedServiceTest, StopStringEndsTheChoiceBeforeIt) {
  auto service = NewService();
  auto plain = std::make_shared<CollectingSink>();
  auto g1 = service->Start(Completion("In the beginning", 40), plain);
  ASSERT_TRUE(plain->WaitDone());
  const std::string text = plain->text();
  ASSERT_GT(text.size(), 12u);
  const std::string stop = text.substr(8, 4);  // greedy, so the same text comes again
  frontend::ApiRequest req = Completion("In the beginning", 40);
  req.stop = {stop};
  auto stopped = std::make_shared<CollectingSink>();
  auto g2 = service->Start(req, stopped);
  ASSERT_TRUE(stopped->WaitDone());
  EXPECT_EQ(stopped->text(), text.substr(0, text.find(stop)));
  EXPECT_EQ(stopped->finish(), "stop");
  EXPECT_LT(stopped->usage().completion_tokens, plain->usage().completion_tokens);
  EXPECT_TRUE(WaitIdle(*service));
}

TEST(ColocatedServiceTest, ModelIsListedOnceAndItsPathStillAccepted) {
  auto service = NewService();
  EXPECT_EQ(service->ListedModelNames(), std::vector<std::string>{"kjv-v4-tiny"});
  EXPECT_EQ(service->ModelNames(),
            (std::vector<std::string>{"kjv-v4-tiny", PDSERVE_BUNDLED_MODEL}));
}

// docs/metrics.md, "Colocated server": the documented names, types and values.
TEST(ColocatedServiceTest, MetricsFollowTheContract) {
  auto service = NewService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::ApiRequest req = Completion("In the beginning", 12);
  req.ignore_eos = true;
  auto generation = service->Start(req, sink);
  ASSERT_TRUE(sink->WaitDone());
  ASSERT_EQ(sink->usage().completion_tokens, 12);
  ASSERT_TRUE(WaitIdle(*service));
  const std::string text = service->MetricsText();
  for (const char* line : {
           "# TYPE pdserve_build_info gauge\n",
           "pdserve_build_info{role=\"serve\",version=\"0.1.0\"} 1\n",
           "# TYPE pdserve_serve_generation_tokens_total counter\n",
           "pdserve_serve_generation_tokens_total 12\n",
           "# TYPE pdserve_serve_sequences_running gauge\n",
           "pdserve_serve_sequences_running 0\n",
           "pdserve_serve_sequences_waiting 0\n",
           "# TYPE pdserve_serve_degenerate_generations_total counter\n",
           "pdserve_serve_degenerate_generations_total{action=\"flag\",kind=\"repeat\"} 0\n",
           "pdserve_serve_pool_pages_used{kind=\"sliding\"} 0\n",
           "pdserve_serve_canary_checks_total 0\n",
           "pdserve_serve_canary_mismatches_total 0\n",
           "pdserve_serve_isolation_failures_total{kind=\"page_owner\"} 0\n",
       }) {
    EXPECT_NE(text.find(line), std::string::npos) << line << " not in\n" << text;
  }
  // Every page is free again: used 0 and free > 0 for each documented kind.
  for (const char* kind : {"sliding", "compressed", "indexer", "compressor"}) {
    const std::string used =
        std::string("pdserve_serve_pool_pages_used{kind=\"") + kind + "\"} 0\n";
    const std::string free = std::string("pdserve_serve_pool_pages_free{kind=\"") + kind + "\"} ";
    EXPECT_NE(text.find(used), std::string::npos) << kind;
    const size_t at = text.find(free);
    ASSERT_NE(at, std::string::npos) << kind;
    EXPECT_GT(std::stol(text.substr(at + free.size())), 0) << kind;
  }
  // No name outside the contract's scheme (the old undocumented ones are gone).
  for (const char* old : {"pdserve_generated_tokens ", "pdserve_sequences_", "pdserve_state_pages",
                          "pdserve_degenerate_choices", "pdserve_canary_", "pdserve_isolation_"}) {
    EXPECT_EQ(text.find(old), std::string::npos) << old;
  }
}

TEST(ColocatedServiceTest, PromptPlusMaxTokensOverTheContextIs400) {
  auto service = NewService();
  frontend::StartResult started =
      service->Start(Completion("In the beginning", 512), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(started));
  const frontend::ApiError& error = std::get<frontend::ApiError>(started);
  EXPECT_EQ(error.http_status, 400);
  EXPECT_EQ(error.code, "context_length_exceeded");
}

TEST(ColocatedServiceTest, FullPoolUnderRejectPolicyIs503) {
  ServiceOptions options;
  options.max_batch = 1;
  options.policy = serving::AdmissionPolicy::kReject;
  auto service = NewService(options);
  auto first =
      service->Start(Completion("In the beginning", 400), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(first));
  frontend::StartResult second =
      service->Start(Completion("And God said", 400), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(second));
  EXPECT_EQ(std::get<frontend::ApiError>(second).http_status, 503);
}

TEST(ColocatedServiceTest, MoreChoicesThanTheBatchUnderRejectPolicyIs400) {
  ServiceOptions options;
  options.max_batch = 2;
  options.policy = serving::AdmissionPolicy::kReject;
  auto service = NewService(options);
  frontend::ApiRequest req = Completion("In the beginning", 5);
  req.n = 3;  // can never run at once, even on an idle server: not a retryable 503
  frontend::StartResult started = service->Start(req, std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(started));
  EXPECT_EQ(std::get<frontend::ApiError>(started).http_status, 400);
  EXPECT_EQ(std::get<frontend::ApiError>(started).param, "n");
}

TEST(ColocatedServiceTest, FullWaitingQueueIs429) {
  ServiceOptions options;
  options.max_batch = 1;
  options.max_waiting = 1;
  auto service = NewService(options);
  auto running =
      service->Start(Completion("In the beginning", 400), std::make_shared<CollectingSink>());
  auto queued = service->Start(Completion("And God said", 400), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(running));
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(queued));
  frontend::StartResult third =
      service->Start(Completion("Blessed are", 400), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(third));
  EXPECT_EQ(std::get<frontend::ApiError>(third).http_status, 429);
}

TEST(ColocatedServiceTest, DeveloperRoleIsReadAsSystem) {
  auto service = NewService();
  frontend::ApiRequest req;
  req.endpoint = frontend::Endpoint::kChatCompletions;
  req.model = "kjv-v4-tiny";
  req.max_tokens = 4;
  req.temperature = 0;
  req.messages = {{"developer", "Be brief."}, {"user", "Who was Moses?"}};
  auto developer = std::make_shared<CollectingSink>();
  auto g1 = service->Start(req, developer);
  req.messages[0].role = "system";
  auto system = std::make_shared<CollectingSink>();
  auto g2 = service->Start(req, system);
  ASSERT_TRUE(developer->WaitDone());
  ASSERT_TRUE(system->WaitDone());
  EXPECT_EQ(developer->usage().prompt_tokens, system->usage().prompt_tokens);
  EXPECT_EQ(developer->text(), system->text());
}

// device_state_tokens 1 on 4 slots: each device pool is its 4 slack pages (one a slot), and a
// request of 4 + 400 tokens holds 2 pages of the rate-4 pool (101 entries), so two run at once
// although max_batch allows four. Admission counts the device pages, not the slots.
ServiceOptions SmallDeviceState(int64_t max_batch) {
  ServiceOptions options;
  options.max_batch = max_batch;
  options.device_state_tokens = 1;
  return options;
}

int32_t DeviceStateKind(const serving::PagePool& pool, int64_t rate) {
  for (int32_t k = 0; k < pool.num_kinds(); ++k) {
    if (pool.kind(k).name == "device_state_rate" + std::to_string(rate)) return k;
  }
  return -1;
}

TEST(ColocatedServiceTest, DeviceStateLedgerHasTheDevicePoolsPages) {
  auto service = NewService(SmallDeviceState(4));
  const int32_t rate4 = DeviceStateKind(service->pool(), 4);
  const int32_t rate32 = DeviceStateKind(service->pool(), 32);
  ASSERT_GE(rate4, 0);
  ASSERT_GE(rate32, 0);
  EXPECT_EQ(service->pool().pages_total(rate4), 4);
  EXPECT_EQ(service->pool().pages_total(rate32), 4);
  EXPECT_EQ(DeviceStateKind(NewService()->pool(), 4), -1);  // unset: no device kinds
  const auto by_label = serving::PoolPagesByLabel(service->pool());
  ASSERT_TRUE(by_label.contains("device"));
  EXPECT_EQ(by_label.at("device").free, 8);  // the metrics' kind="device"
}

TEST(ColocatedServiceTest, RequestThatDoesNotFitTheDevicePoolsNowWaitsAndMatchesAnUnboundedRun) {
  const std::vector<std::string> prompts = {"In the beginning", "And God said", "Blessed are"};
  auto run = [&](ServiceOptions options, int64_t* waiting_after_submit) {
    auto service = NewService(options);
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    std::vector<std::unique_ptr<frontend::Generation>> generations;
    for (const std::string& prompt : prompts) {
      sinks.push_back(std::make_shared<CollectingSink>());
      auto started = service->Start(Completion(prompt, 400), sinks.back());
      EXPECT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
      if (auto* g = std::get_if<std::unique_ptr<frontend::Generation>>(&started)) {
        generations.push_back(std::move(*g));
      }
    }
    *waiting_after_submit = service->scheduler().num_waiting();
    std::vector<std::string> texts;
    for (const auto& sink : sinks) {
      EXPECT_TRUE(sink->WaitDone());
      EXPECT_EQ(sink->finish(), "length");
      texts.push_back(sink->text());
    }
    EXPECT_TRUE(WaitIdle(*service));
    return texts;
  };
  int64_t waiting_small = 0;
  int64_t waiting_free = 0;
  const std::vector<std::string> small = run(SmallDeviceState(4), &waiting_small);
  ServiceOptions unbounded;
  unbounded.max_batch = 4;
  const std::vector<std::string> free = run(unbounded, &waiting_free);
  // The third request cannot finish 400 tokens while the other two are being submitted.
  EXPECT_EQ(waiting_small, 1);
  EXPECT_EQ(waiting_free, 0);
  EXPECT_EQ(small, free);
}

TEST(ColocatedServiceTest, RequestThatCanNeverFitTheDevicePoolsIs400ContextLengthExceeded) {
  auto service = NewService(SmallDeviceState(1));  // one page a rate: 256 tokens at most
  frontend::StartResult started =
      service->Start(Completion("In the beginning", 400), std::make_shared<CollectingSink>());
  ASSERT_TRUE(std::holds_alternative<frontend::ApiError>(started));
  const frontend::ApiError& error = std::get<frontend::ApiError>(started);
  EXPECT_EQ(error.http_status, 400);
  EXPECT_EQ(error.code, "context_length_exceeded");
  EXPECT_NE(error.message.find("device_state_rate4"), std::string::npos) << error.message;
  auto fits =
      service->Start(Completion("In the beginning", 200), std::make_shared<CollectingSink>());
  EXPECT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(fits));
}

}  // namespace
}  // namespace pdserve::colocated
