// The router's admission for prefill room (RouterOptions::max_prefills_per_worker) against
// in-process fake workers: a choice waits in the admission queue while every prefill worker holds
// its share, reserving no decode pages meanwhile, and is served when a prefill ends; past
// queue_timeout it is a 429 prefill_busy.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "tests/router/service_fixture.h"

namespace pdserve::router {
namespace {

using testing::CollectingSink;
using testing::Eventually;
using testing::RouterServiceTest;

size_t Reserves(testing::FakeDecode& decode) {
  absl::MutexLock lock(&decode.mu);
  return decode.reserves.size();
}

size_t Prefills(testing::FakePrefill& prefill) {
  absl::MutexLock lock(&prefill.mu);
  return prefill.prefills.size();
}

class PrefillAdmissionTest : public RouterServiceTest {
 protected:
  // Starts completions of prompts {1, 2, 3}, {1, 2, 4}, {1, 2, 5} (max_tokens 2), 5 ms apart
  // (arrival order); their sinks, in that order.
  std::vector<std::shared_ptr<CollectingSink>> StartThree(
      RouterService& service, std::vector<std::unique_ptr<frontend::Generation>>* generations) {
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    for (int i = 0; i < 3; ++i) {
      auto sink = std::make_shared<CollectingSink>();
      frontend::StartResult started = service.Start(Completion({1, 2, i + 3}, 2), sink);
      EXPECT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
      if (auto* g = std::get_if<std::unique_ptr<frontend::Generation>>(&started)) {
        generations->push_back(std::move(*g));
      }
      sinks.push_back(sink);
      absl::SleepFor(absl::Milliseconds(5));
    }
    return sinks;
  }

  // Two prefill workers, room for one request each (set before MakeService): p0 fails its first
  // `p0_failures` calls (UNAVAILABLE, 150 ms in: a worker that died, not yet marked down), p1
  // answers after `p1_ms`.
  void FailingP0AndSlowP1(int p0_failures, int p1_ms) {
    AddSecondPrefill();
    prefill_->fail_first = p0_failures;
    prefill_->delay_ms = 150;
    second_prefill_->delay_ms = p1_ms;
    max_prefills_per_worker_ = 1;
  }

  // Starts two completions 30 ms apart: p0 takes the first, p1 the second (p0 holds its share).
  // Their sinks; their generations go to `generations`.
  std::pair<std::shared_ptr<CollectingSink>, std::shared_ptr<CollectingSink>> StartOnP0ThenP1(
      RouterService& service, std::vector<std::unique_ptr<frontend::Generation>>* generations) {
    std::vector<std::shared_ptr<CollectingSink>> sinks;
    for (int i = 0; i < 2; ++i) {
      if (i > 0) absl::SleepFor(absl::Milliseconds(30));
      sinks.push_back(std::make_shared<CollectingSink>());
      frontend::StartResult started = service.Start(Completion({1, 2 + i}, 2), sinks.back());
      EXPECT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
      if (auto* g = std::get_if<std::unique_ptr<frontend::Generation>>(&started)) {
        generations->push_back(std::move(*g));
      }
    }
    return {sinks[0], sinks[1]};
  }

  // StartOnP0ThenP1, then waits for both: each must be served.
  void RunOnP0ThenP1AndExpectBothServed(RouterService& service) {
    std::vector<std::unique_ptr<frontend::Generation>> generations;
    auto [first, second] = StartOnP0ThenP1(service, &generations);
    for (const auto& sink : {first, second}) {
      ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
      EXPECT_FALSE(sink->failed) << sink->error.message;
    }
  }
};

// Three requests at once on one prefill worker with room for one: the second and third wait in
// the router, holding no decode reservation, and are each reserved only when the prefill before
// them answered; all three are served, in arrival order.
TEST_F(PrefillAdmissionTest, RequestsBeyondThePrefillShareWaitWithoutDecodePages) {
  prefill_->delay_ms = 300;
  max_prefills_per_worker_ = 1;
  auto service = MakeService();
  std::vector<std::unique_ptr<frontend::Generation>> generations;
  const std::vector<std::shared_ptr<CollectingSink>> sinks = StartThree(*service, &generations);
  ASSERT_TRUE(Eventually([&] {
    return service->MetricsText().find("pdserve_router_queue_depth 2\n") != std::string::npos;
  }));
  // The first prefill is still running (300 ms): only its request holds decode pages.
  EXPECT_EQ(Reserves(*decode_[0]), 1u);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(sinks[i]->done.WaitForNotificationWithTimeout(absl::Seconds(20))) << i;
    ASSERT_FALSE(sinks[i]->failed) << i << ": " << sinks[i]->error.message;
  }
  // A choice can finish before its Prefill answers (the fake decode worker streams at once).
  ASSERT_TRUE(Eventually([&] { return Prefills(*prefill_) == 3u; }));
  {
    absl::MutexLock lock(&prefill_->mu);
    for (int i = 0; i < 3; ++i) {
      const worker::v1::PrefillRequest& p = prefill_->prefills[i];
      EXPECT_EQ(p.token_ids(p.token_ids_size() - 1), i + 3) << i;  // the prompt's last token
    }
  }
  EXPECT_EQ(Reserves(*decode_[0]), 3u);  // one each: a wait for prefill room asks no decode worker
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queued_total 2\n"), std::string::npos) << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// A prefill worker that stays busy past queue_timeout: the waiting request gets 429 prefill_busy
// naming both settings, and never reserved decode pages.
TEST_F(PrefillAdmissionTest, PrefillRoomWaitedForThen429PrefillBusy) {
  prefill_->delay_ms = 2000;
  max_prefills_per_worker_ = 1;
  queue_timeout_ = absl::Milliseconds(300);
  auto service = MakeService();
  auto first = std::make_shared<CollectingSink>();
  frontend::StartResult running = service->Start(Completion({1, 2}, 2), first);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(running));
  ASSERT_TRUE(Eventually([&] { return Prefills(*prefill_) == 0 && Reserves(*decode_[0]) == 1; }));
  auto second = Run(*service, Completion({3, 4}, 2));
  ASSERT_TRUE(second->failed);
  EXPECT_EQ(second->error.http_status, 429);
  EXPECT_EQ(second->error.code, "prefill_busy");
  EXPECT_EQ(second->error.message,
            "every prefill worker stayed busy (1 requests each, router.max_prefills_per_worker) "
            "for the 300 ms the request may wait (router.queue_timeout_ms); retry later");
  EXPECT_EQ(Reserves(*decode_[0]), 1u);
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_FALSE(first->failed) << first->error.message;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// Without a queue (queue_timeout 0) a request finding every prefill worker at its share is a 429
// prefill_busy at once.
TEST_F(PrefillAdmissionTest, PrefillShareFullIs429AtOnceWithoutAQueue) {
  prefill_->delay_ms = 2000;
  max_prefills_per_worker_ = 1;
  queue_timeout_ = absl::ZeroDuration();
  auto service = MakeService();
  auto first = std::make_shared<CollectingSink>();
  frontend::StartResult running = service->Start(Completion({1, 2}, 2), first);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(running));
  ASSERT_TRUE(Eventually([&] { return Reserves(*decode_[0]) == 1; }));
  auto second = Run(*service, Completion({3, 4}, 2));
  ASSERT_TRUE(second->failed);
  EXPECT_EQ(second->error.http_status, 429);
  EXPECT_EQ(second->error.code, "prefill_busy");
  EXPECT_EQ(second->error.message,
            "every prefill worker is busy (1 requests each, router.max_prefills_per_worker); "
            "retry later");
  EXPECT_EQ(Reserves(*decode_[0]), 1u);
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
}

// A prefill worker that fails (UNAVAILABLE: it died, not yet marked down) while the only other one
// holds its share: the retry waits in the queue for room on the full one and is served there; it
// does not go back to the failed worker (which would fail again and end the request with a 503).
TEST_F(PrefillAdmissionTest, ARetryWaitsForTheFullWorkerRatherThanTheOneThatFailed) {
  FailingP0AndSlowP1(/*p0_failures=*/2, /*p1_ms=*/500);
  decode_[0]->generate_wait_ms = 700;  // no token before the prefill answered (a real worker)
  auto service = MakeService();
  RunOnP0ThenP1AndExpectBothServed(*service);
  EXPECT_EQ(Prefills(*prefill_), 1u);         // asked once, not again on the retry
  EXPECT_EQ(Prefills(*second_prefill_), 2u);  // the second request, then the first's retry
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queued_total 1\n"), std::string::npos) << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// The retry's tries after a full decode worker answered "no room" still avoid the prefill
// worker that failed (d0 is always full here; every choice ends up on d1). least_load breaks
// ties by the lowest index, so a try that forgot the failed worker would pick p0.
TEST_F(PrefillAdmissionTest, ARetryAvoidsTheFailedWorkerAfterAFullDecodeWorkerToo) {
  FailingP0AndSlowP1(/*p0_failures=*/100, /*p1_ms=*/500);
  prefill_policy_ = PolicyKind::kLeastLoad;
  decode_[0]->slots = 0;
  decode_[1]->generate_wait_ms = 700;
  auto service = MakeService(/*decode_workers=*/2);
  RunOnP0ThenP1AndExpectBothServed(*service);
  EXPECT_EQ(Prefills(*prefill_), 1u) << "the failed worker was asked again";
  EXPECT_EQ(Prefills(*second_prefill_), 2u);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// The same failure without a queue (queue_timeout 0): nothing can wait, so the retry goes back
// to the failed worker as before (here it answers the second time).
TEST_F(PrefillAdmissionTest, WithoutAQueueTheRetryGoesBackToTheFailedWorker) {
  FailingP0AndSlowP1(/*p0_failures=*/1, /*p1_ms=*/500);
  decode_[0]->generate_wait_ms = 700;
  queue_timeout_ = absl::ZeroDuration();
  auto service = MakeService();
  RunOnP0ThenP1AndExpectBothServed(*service);
  EXPECT_EQ(Prefills(*prefill_), 2u);  // failed, then answered
  EXPECT_EQ(Prefills(*second_prefill_), 1u);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// The retry's wait for room ends at queue_timeout like any prefill wait: 429 prefill_busy, whose
// message names the worker that failed it.
TEST_F(PrefillAdmissionTest, ARetryThatWaitsPastTheTimeoutNamesTheWorkerThatFailed) {
  FailingP0AndSlowP1(/*p0_failures=*/100, /*p1_ms=*/3000);
  decode_[0]->generate_wait_ms = 4000;
  queue_timeout_ = absl::Milliseconds(300);
  auto service = MakeService();
  std::vector<std::unique_ptr<frontend::Generation>> generations;
  auto [first, second] = StartOnP0ThenP1(*service, &generations);
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(first->failed);
  EXPECT_EQ(first->error.http_status, 429);
  EXPECT_EQ(first->error.code, "prefill_busy");
  EXPECT_EQ(first->error.message,
            "every prefill worker stayed busy (1 requests each, router.max_prefills_per_worker) "
            "for the 300 ms the request may wait (router.queue_timeout_ms) after prefill worker "
            "p0 failed it; retry later");
  EXPECT_EQ(Prefills(*prefill_), 1u);  // not asked again
  ASSERT_TRUE(second->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_FALSE(second->failed) << second->error.message;
}

// max_prefills_per_worker 0: no cap, every request goes to the prefill worker at once (its own
// queue), each with its decode reservation.
TEST_F(PrefillAdmissionTest, NoPrefillShareSendsEveryRequestAtOnce) {
  prefill_->delay_ms = 300;
  max_prefills_per_worker_ = 0;
  auto service = MakeService();
  std::vector<std::unique_ptr<frontend::Generation>> generations;
  const std::vector<std::shared_ptr<CollectingSink>> sinks = StartThree(*service, &generations);
  EXPECT_TRUE(Eventually([&] { return Reserves(*decode_[0]) == 3u; }));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(sinks[i]->done.WaitForNotificationWithTimeout(absl::Seconds(20))) << i;
  }
}

}  // namespace
}  // namespace pdserve::router
