// The router's admission against in-process fake workers: full decode workers (asked in turn,
// then waited for in the admission queue, first come first served, up to queue_timeout), clients
// gone while queued, fan-outs and requests that can never fit (400), and Reserves whose answer
// was lost (aborted on the worker).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/router/service_fixture.h"

namespace pdserve::router {
namespace {

using testing::CollectingSink;
using testing::Eventually;
using testing::FakeToken;
using testing::RouterServiceTest;

TEST_F(RouterServiceTest, FullDecodePoolIs429AtOnceWithoutAQueue) {
  decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  queue_timeout_ = absl::ZeroDuration();
  auto service = MakeService();
  auto sink = Run(*service, Completion({1}, 2));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 429);
  EXPECT_EQ(sink->error.code, "pool_exhausted");
  EXPECT_EQ(sink->error.message,
            "every decode worker is full; retry later (decode worker d0: fake refuses)");
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  // Nothing waited: no queued choice, no wait observed (the 429 is counted as a request).
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("\npdserve_router_queued_total 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\npdserve_router_queue_wait_seconds_count{outcome=\"timeout\"} 0\n"),
            std::string::npos)
      << metrics;
  absl::MutexLock lock(&decode_[0]->mu);
  EXPECT_EQ(decode_[0]->reserves.size(), 1u);
}

// A full worker is waited for, up to queue_timeout, with a few backed-off tries (no busy loop),
// then 429.
TEST_F(RouterServiceTest, FullDecodePoolIsWaitedForThen429) {
  decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  queue_timeout_ = absl::Milliseconds(400);
  auto service = MakeService();
  const absl::Time start = absl::Now();
  auto sink = Run(*service, Completion({1}, 2));
  const absl::Duration waited = absl::Now() - start;
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 429);
  EXPECT_EQ(sink->error.code, "pool_exhausted");
  EXPECT_EQ(sink->error.message,
            "every decode worker stayed full for the 400 ms the request may wait "
            "(router.queue_timeout_ms); retry later (decode worker d0: fake refuses)");
  EXPECT_GE(waited, absl::Milliseconds(400));
  EXPECT_LT(waited, absl::Seconds(3));
  {
    // Tries back off 5, 10, 20, ... 100 ms: about 8 in 400 ms, not thousands.
    absl::MutexLock lock(&decode_[0]->mu);
    EXPECT_GE(decode_[0]->reserves.size(), 3u);
    EXPECT_LE(decode_[0]->reserves.size(), 15u);
  }
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queued_total 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="timeout"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("pdserve_router_queue_depth 0\n"), std::string::npos) << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// Requests beyond the worker's slots wait and are served, first come first served, each as
// soon as a slot frees (the end of a stream), not after a backoff.
TEST_F(RouterServiceTest, RequestsBeyondTheSlotsWaitAndAreServedInArrivalOrder) {
  decode_[0]->slots = 1;
  decode_[0]->token_delay_ms = 100;  // the first holds the slot ~300 ms: time for all to queue
  auto service = MakeService();
  std::vector<std::shared_ptr<CollectingSink>> sinks;
  std::vector<std::unique_ptr<frontend::Generation>> generations;
  for (int i = 0; i < 4; ++i) {
    auto sink = std::make_shared<CollectingSink>();
    frontend::StartResult started = service->Start(Completion({1, 2, i + 3}, 3), sink);
    ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
    generations.push_back(std::move(std::get<std::unique_ptr<frontend::Generation>>(started)));
    sinks.push_back(sink);
    if (i == 0) {  // the first holds the slot before the others arrive
      ASSERT_TRUE(Eventually([&] {
        absl::MutexLock lock(&decode_[0]->mu);
        return decode_[0]->admitted.size() == 1u;
      }));
    } else {
      // Arrival order is queue order: each waits in the queue before the next starts. (A sleep
      // of 5 ms between starts was not enough on a loaded 2-core machine: a request whose first
      // Reserve was still in flight was not queued yet, and the next one, trying directly, was
      // admitted first: {3, 6, 4, 5} in CI's run, 2026-12-05.)
      ASSERT_TRUE(Eventually([&] {
        return service->MetricsText().find(absl::StrCat("pdserve_router_queue_depth ", i, "\n")) !=
               std::string::npos;
      })) << i;
    }
  }
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(sinks[i]->done.WaitForNotificationWithTimeout(absl::Seconds(20))) << i;
    ASSERT_FALSE(sinks[i]->failed) << i << ": " << sinks[i]->error.message;
    std::vector<int32_t> expected;
    for (int t = 0; t < 3; ++t) expected.push_back(FakeToken(42, 0, t, 3));
    EXPECT_EQ(sinks[i]->text[0], Decode(*service, expected)) << i;
  }
  {
    // Reserved in arrival order: the prompt's last token tells the requests apart.
    absl::MutexLock lock(&decode_[0]->mu);
    std::vector<int32_t> order;
    for (uint64_t id : decode_[0]->admitted) {
      for (const auto& r : decode_[0]->reserves) {
        if (r.request_id() == id) order.push_back(r.prompt_token_ids(2));
      }
    }
    EXPECT_EQ(order, (std::vector<int32_t>{3, 4, 5, 6}));
  }
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queued_total 3\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="admitted"} 3)"),
            std::string::npos)
      << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, ClientGoneWhileQueuedLeavesTheQueue) {
  decode_[0]->slots = 1;
  decode_[0]->token_delay_ms = 100;
  auto service = MakeService();
  auto first = std::make_shared<CollectingSink>();
  frontend::StartResult running = service->Start(Completion({1, 2}, 5), first);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(running));
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->admitted.size() == 1u;
  }));
  auto second = std::make_shared<CollectingSink>();
  frontend::StartResult queued = service->Start(Completion({3, 4}, 5), second);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(queued));
  ASSERT_TRUE(Eventually([&] {
    return service->MetricsText().find("pdserve_router_queue_depth 1\n") != std::string::npos;
  }));
  std::get<std::unique_ptr<frontend::Generation>>(queued)->Cancel();
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find("pdserve_router_queue_depth 0\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="cancelled"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find(R"(finish_reason="cancelled",status="499"} 1)"), std::string::npos)
      << metrics;
  ASSERT_TRUE(first->done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_FALSE(first->failed);
  absl::SleepFor(absl::Milliseconds(200));  // a try for the cancelled one would come by now
  {
    absl::MutexLock lock(&decode_[0]->mu);
    EXPECT_EQ(decode_[0]->admitted.size(), 1u);  // only the first was ever reserved
  }
  EXPECT_FALSE(second->done.HasBeenNotified());
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// A queued choice whose try fails otherwise (here the worker refuses outright, as one going
// down) fails its request, and its wait still ends in an outcome: every choice counted in
// queued_total is counted once in queue_wait_seconds (it was not: the try had taken it out of
// the queue, so the request's failure found nothing waiting).
TEST_F(RouterServiceTest, QueuedChoiceWhoseTryFailsEndsItsWait) {
  decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  queue_timeout_ = absl::Seconds(20);
  auto service = MakeService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion({1, 2}, 3), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(Eventually([&] {
    return service->MetricsText().find("pdserve_router_queued_total 1\n") != std::string::npos;
  }));
  {
    absl::MutexLock lock(&decode_[0]->mu);
    decode_[0]->reserve_code = grpc::StatusCode::INVALID_ARGUMENT;
  }
  ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(sink->failed);
  EXPECT_NE(sink->error.http_status, 429);
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="cancelled"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("pdserve_router_queue_depth 0\n"), std::string::npos) << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// With two decode workers, a full one sends the choice to the other before it waits.
TEST_F(RouterServiceTest, FullDecodeWorkerSendsTheChoiceToTheOtherFirst) {
  decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  auto service = MakeService(2, PolicyKind::kRoundRobin);
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  absl::MutexLock lock0(&decode_[0]->mu);
  absl::MutexLock lock1(&decode_[1]->mu);
  EXPECT_EQ(decode_[0]->reserves.size(), 1u);
  EXPECT_EQ(decode_[1]->reserves.size(), 1u);
  EXPECT_EQ(service->MetricsText().find("pdserve_router_queued_total 1"), std::string::npos);
}

// Two decode workers: d0 full, d1 goes down while the choice asks it. The choice waits for room
// on d0, which is up; it was 503 "no decode worker is up" (kill -9 of one of two decode workers
// with 58 choices queued failed 5 requests so).
TEST_F(RouterServiceTest, ChoiceWhoseOtherDecodeWorkerGoesDownWaitsForTheFullOne) {
  decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  decode_[1]->reserve_code = grpc::StatusCode::UNAVAILABLE;
  decode_[1]->reserve_delay_ms = 500;  // marked down below while its Reserve is answered
  queue_timeout_ = absl::Seconds(20);
  auto service = MakeService(2, PolicyKind::kRoundRobin);  // both up; d1 down at the next checks:
  decode_[1]->state = worker::v1::HealthResponse::STATE_NOT_SERVING;
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion({1, 2}, 3), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  // d0 answered "no room"; d1 is asked now.
  ASSERT_TRUE(Eventually([&] { return service->pool().decode()[1]->load() == 1; }));
  service->pool().CheckAll();
  service->pool().CheckAll();
  ASSERT_FALSE(service->pool().decode()[1]->up());
  ASSERT_TRUE(Eventually([&] {
    return service->MetricsText().find("pdserve_router_queue_depth 1\n") != std::string::npos;
  })) << (sink->failed ? sink->error.message : "");
  EXPECT_FALSE(sink->done.HasBeenNotified());
  {
    absl::MutexLock lock(&decode_[0]->mu);
    decode_[0]->reserve_code = grpc::StatusCode::OK;  // room on d0
  }
  ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find(R"(pdserve_router_queue_wait_seconds_count{outcome="admitted"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// Two decode workers: d1 refuses (UNAVAILABLE, not yet held down), d0 is full. The choice tries
// d1, then d0 (no room), then d1 again: out of retries, it waits for room on d0, which is up; it
// was 503 "no decode worker could take the request" (SIGTERM of one of two decode workers with
// 66 choices queued failed a request so).
TEST_F(RouterServiceTest, ChoiceOutOfRetriesWaitsWhileAnotherDecodeWorkerIsUp) {
  queue_timeout_ = absl::Seconds(20);
  auto service = MakeService(2, PolicyKind::kRoundRobin);
  ASSERT_FALSE(Run(*service, Completion({1, 2}, 3))->failed);  // d0's turn: d1 is asked first
  {
    absl::MutexLock lock0(&decode_[0]->mu);
    absl::MutexLock lock1(&decode_[1]->mu);
    decode_[0]->reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
    decode_[1]->reserve_code = grpc::StatusCode::UNAVAILABLE;
  }
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion({1, 2}, 3), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(Eventually([&] {
    return sink->done.HasBeenNotified() ||
           service->MetricsText().find("pdserve_router_queued_total 1\n") != std::string::npos;
  }));
  absl::SleepFor(absl::Milliseconds(300));  // a few tries from the queue
  ASSERT_FALSE(sink->done.HasBeenNotified()) << sink->error.message;
  {
    absl::MutexLock lock(&decode_[0]->mu);
    decode_[0]->reserve_code = grpc::StatusCode::OK;  // room on d0
  }
  ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, ReservePastItsDeadlineIsAbortedOnTheDecodeWorker) {
  decode_[0]->reserve_delay_ms = 300;  // the worker reserves, but answers after the deadline
  reserve_timeout_ = absl::Milliseconds(50);
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "worker_unavailable");
  // Both tries (the first and its retry) reserved on the worker; each is aborted, with
  // prefill_quiesced (no Prefill was sent), so the worker frees its pages at once.
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->reserves.size() == 2u && decode_[0]->abort_requests.size() == 2u;
  }));
  absl::MutexLock lock(&decode_[0]->mu);
  std::set<uint64_t> reserved, aborted;
  for (const auto& r : decode_[0]->reserves) reserved.insert(r.request_id());
  for (const auto& a : decode_[0]->abort_requests) {
    aborted.insert(a.request_id());
    EXPECT_TRUE(a.prefill_quiesced()) << a.request_id();
  }
  EXPECT_EQ(aborted, reserved);
  absl::MutexLock prefill_lock(&prefill_->mu);
  EXPECT_TRUE(prefill_->prefills.empty());
}

TEST_F(RouterServiceTest, CanaryReservePastItsDeadlineIsAborted) {
  canary_timeout_ = absl::Milliseconds(100);
  auto service = MakeService();  // canaries pass
  size_t before = 0;
  {
    absl::MutexLock lock(&decode_[0]->mu);
    before = decode_[0]->reserves.size();
    EXPECT_TRUE(decode_[0]->abort_requests.empty());  // passed canaries abort nothing
  }
  decode_[0]->reserve_delay_ms = 300;
  service->pool().CheckAll();  // both workers' canaries reserve on d0 and time out
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->reserves.size() == before + 2 && decode_[0]->abort_requests.size() == 2u;
  }));
  absl::MutexLock lock(&decode_[0]->mu);
  std::set<uint64_t> late;  // the Reserves of the timed-out canaries
  for (size_t i = before; i < decode_[0]->reserves.size(); ++i) {
    late.insert(decode_[0]->reserves[i].request_id());
  }
  std::set<uint64_t> aborted;
  for (const auto& a : decode_[0]->abort_requests) {
    if (late.contains(a.request_id())) {
      aborted.insert(a.request_id());
      EXPECT_TRUE(a.prefill_quiesced());
    }
  }
  EXPECT_EQ(aborted, late);
}

TEST_F(RouterServiceTest, MoreChoicesThanTheDecodeWorkersSlotsIs400BeforeAnyReserve) {
  decode_[0]->max_batch = 3;
  decode_[1]->max_batch = 2;
  auto service = MakeService(2);
  frontend::ApiRequest req = Completion({1, 2}, 2);
  req.n = 6;
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 400);
  EXPECT_EQ(sink->error.param, "n");
  EXPECT_EQ(sink->error.message,
            "'n' is 6 but the choices share one prefill and decode together on one decode worker, "
            "and the widest runs at most 3 sequences at once (d0: max_batch 3, d1: max_batch 2)");
  for (auto& d : decode_) {
    absl::MutexLock lock(&d->mu);
    EXPECT_TRUE(d->reserves.empty());
  }
  req.n = 5;  // would fit both workers together, but the choices share one reservation
  sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.param, "n");
  req.n = 3;  // fits the widest
  sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_EQ(sink->usage.completion_tokens, 6);
}

TEST_F(RouterServiceTest, ReserveThatCanNeverFitIs400OnMaxTokens) {
  decode_[0]->reserve_code = grpc::StatusCode::FAILED_PRECONDITION;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1}, 2));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 400);
  EXPECT_EQ(sink->error.param, "max_tokens");
  EXPECT_EQ(sink->error.type, "invalid_request_error");
  absl::MutexLock lock(&decode_[0]->mu);
  EXPECT_EQ(decode_[0]->reserves.size(), 1u);  // not retried: it never fits
}

}  // namespace
}  // namespace pdserve::router
