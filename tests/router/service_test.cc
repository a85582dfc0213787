// The router's GenerationService against in-process fake workers (tests/router/fake_workers.h):
// request flow, n > 1, seeds, logprobs, stop strings, errors, retries and cancellation.
#include "router/service.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "serving/sampling_params.h"
#include "tests/router/promtool_check.h"
#include "tests/router/service_fixture.h"
#include "worker/transfer_peer.h"

namespace pdserve::router {
namespace {

using testing::CollectingSink;
using testing::Eventually;
using testing::FakeDecode;
using testing::FakePrefill;
using testing::FakeServer;
using testing::FakeToken;
using testing::RouterServiceTest;
using testing::WorkerAt;

TEST_F(RouterServiceTest, CompletionTextIsTheDecodeWorkersTokensDetokenized) {
  auto service = MakeService();
  auto sink = Run(*service, Completion({5, 6, 7}, 6));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  std::vector<int32_t> expected;
  for (int i = 0; i < 6; ++i) expected.push_back(FakeToken(42, 0, i, 3));
  ASSERT_EQ(sink->text.size(), 1u);
  EXPECT_EQ(sink->text[0], Decode(*service, expected));
  EXPECT_EQ(sink->finish[0], "length");
  EXPECT_EQ(sink->usage.prompt_tokens, 3);
  EXPECT_EQ(sink->usage.completion_tokens, 6);
  // The prefill worker got the prompt and the decode worker's ticket.
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&prefill_->mu);
    return !prefill_->prefills.empty();
  }));
  absl::MutexLock lock(&prefill_->mu);
  ASSERT_EQ(prefill_->prefills.size(), 1u);
  EXPECT_EQ(std::vector<int32_t>(prefill_->prefills[0].token_ids().begin(),
                                 prefill_->prefills[0].token_ids().end()),
            (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(prefill_->prefills[0].ticket().ticket_id(), 1u);
  // The decode worker gets the prompt too (its repetition penalty counts prompt tokens).
  absl::MutexLock decode_lock(&decode_[0]->mu);
  EXPECT_EQ(decode_[0]->reserves[0].prompt_token_ids_size(), 3);
}

// A prefill worker whose Health states a GPU arena (transfer.cuda_ipc) has its place passed to
// the decode worker with the Reserve of each request it prefills; one that states none has none
// passed (host pages), and a later check that no longer states it stops the passing.
TEST_F(RouterServiceTest, ReservePassesThePrefillWorkersCudaIpcCapability) {
  worker::v1::CudaIpcSource source;
  source.set_boot_id("0b1d2f3e-boot");
  source.set_pci_bus_id("0000:19:00.0");
  AddSecondPrefill();  // p1 states nothing: host pages
  prefill_->cuda_ipc = source;
  auto service = MakeService();
  // Round robin over p0, p1: one request each.
  for (int i = 0; i < 2; ++i) {
    auto sink = Run(*service, Completion({5, 6, 7}, 2));
    ASSERT_FALSE(sink->failed) << sink->error.message;
  }
  prefill_->cuda_ipc.reset();
  service->pool().CheckAll();
  auto sink = Run(*service, Completion({5, 6, 7}, 2));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  std::vector<uint64_t> by_p0;
  {
    absl::MutexLock lock(&prefill_->mu);
    for (const auto& p : prefill_->prefills) by_p0.push_back(p.request_id());
  }
  ASSERT_FALSE(by_p0.empty());
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 3u);
  int with_source = 0;
  for (size_t i = 0; i < decode_[0]->reserves.size(); ++i) {
    const worker::v1::ReserveRequest& r = decode_[0]->reserves[i];
    const bool p0 = std::find(by_p0.begin(), by_p0.end(), r.request_id()) != by_p0.end();
    if (r.has_prefill_cuda_ipc()) {
      ++with_source;
      EXPECT_TRUE(p0) << "request " << r.request_id() << " was not prefilled by p0";
      EXPECT_LT(i, 2u) << "after p0 stopped stating a GPU arena";
      EXPECT_EQ(r.prefill_cuda_ipc().boot_id(), "0b1d2f3e-boot");
      EXPECT_EQ(r.prefill_cuda_ipc().pci_bus_id(), "0000:19:00.0");
    }
  }
  EXPECT_EQ(with_source, 1);
}

// n > 1: one shared reservation (tests/router/service_n_share_test.cc walks it); each choice
// still gets its own stream: tokens of choice c from (seed, c).
TEST_F(RouterServiceTest, EachChoiceHasItsOwnStreamWithTheSameSeed) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({9, 9}, 3);
  req.n = 3;
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  ASSERT_EQ(sink->text.size(), 3u);
  for (uint32_t c = 0; c < 3; ++c) {
    std::vector<int32_t> expected;
    for (int i = 0; i < 3; ++i) expected.push_back(FakeToken(42, c, i, 2));
    EXPECT_EQ(sink->text[c], Decode(*service, expected)) << "choice " << c;
  }
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 1u);
  EXPECT_EQ(decode_[0]->reserves[0].sampling().seed(), 42u);
  EXPECT_EQ(decode_[0]->reserves[0].sampling().max_tokens(), 3);
  EXPECT_EQ(sink->usage.completion_tokens, 9);
}

TEST_F(RouterServiceTest, UnsetFieldsComeFromGenerationConfigAndTheSeedIsExplicit) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({1, 2, 3}, 2);
  req.seed.reset();
  Run(*service, req);
  Run(*service, req);
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 2u);
  const auto& first = decode_[0]->reserves[0].sampling();
  EXPECT_TRUE(first.has_seed());
  EXPECT_NE(first.seed(), decode_[0]->reserves[1].sampling().seed());
  const serving::SamplingParams& defaults = service->preparer().defaults();
  EXPECT_FLOAT_EQ(first.temperature(), static_cast<float>(defaults.temperature));
  EXPECT_FLOAT_EQ(first.top_p(), static_cast<float>(defaults.top_p));
  EXPECT_EQ(first.top_k(), defaults.top_k);
}

TEST_F(RouterServiceTest, IgnoreEosTravelsAsItsOwnFieldAndMinTokensStaysTheRequests) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({1, 2, 3}, 6);
  req.ignore_eos = true;
  req.stop_token_ids = {7};
  ASSERT_FALSE(Run(*service, req)->failed);
  // The fake decode streams without waiting for the Prefill, which may still be on its way.
  auto prefilled = [this] {
    absl::MutexLock prefill_lock(&prefill_->mu);
    return prefill_->prefills.size();
  };
  for (int i = 0; i < 200 && prefilled() == 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 1u);
  const worker::v1::SamplingParams& s = decode_[0]->reserves[0].sampling();
  EXPECT_TRUE(s.ignore_eos());
  EXPECT_EQ(s.min_tokens(), 0);  // not max_tokens: that masked the stop ids too
  EXPECT_EQ(s.max_tokens(), 6);
  ASSERT_EQ(s.stop_token_ids_size(), 1);
  EXPECT_EQ(s.stop_token_ids(0), 7);
  absl::MutexLock prefill_lock(&prefill_->mu);
  ASSERT_EQ(prefill_->prefills.size(), 1u);
  EXPECT_TRUE(prefill_->prefills[0].sampling().ignore_eos());
}

TEST_F(RouterServiceTest, DegenerateChoiceCarriesItsKindInDeltasAndMetrics) {
  decode_[0]->degenerate_from = 3;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 6));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  // Deltas before the fourth token are not flagged; from it on every one is (the last, with
  // finish_reason, included), so the whole response carries the kind.
  const std::vector<std::string>& kinds = sink->kinds[0];
  ASSERT_GE(kinds.size(), 3u);
  EXPECT_EQ(kinds.front(), "");
  EXPECT_EQ(kinds.back(), "repeat");
  const auto first = std::find(kinds.begin(), kinds.end(), "repeat");
  EXPECT_EQ(std::count(first, kinds.end(), "repeat"), kinds.end() - first);
  EXPECT_LE(first - kinds.begin(), 3);
  EXPECT_EQ(sink->finish[0], "length");
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find(R"(pdserve_router_degenerate_generations_total{action="flag",)"
                         R"(kind="repeat"} 1)"),
            std::string::npos)
      << metrics;
}

TEST_F(RouterServiceTest, DegenerateWithoutAKindFromAnOlderWorkerIsUnknown) {
  decode_[0]->degenerate_from = 0;
  decode_[0]->degeneration_kind = "";
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 2));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  ASSERT_FALSE(sink->kinds[0].empty());
  for (const std::string& kind : sink->kinds[0]) EXPECT_EQ(kind, "unknown");
  EXPECT_NE(service->MetricsText().find(
                R"(pdserve_router_degenerate_generations_total{action="flag",kind="unknown"} 1)"),
            std::string::npos);
}

TEST_F(RouterServiceTest, LogprobsAreDetokenized) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({4, 4}, 2);
  req.logprobs = true;
  req.top_logprobs = 2;
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed);
  ASSERT_EQ(sink->logprobs[0].size(), 2u);
  const int32_t first = FakeToken(42, 0, 0, 2);
  EXPECT_EQ(sink->logprobs[0][0].token, Decode(*service, {first}));
  // The first token's logprobs are the prefill worker's (PrefillResponse.first_token).
  EXPECT_FLOAT_EQ(sink->logprobs[0][0].logprob, -0.25f);
  ASSERT_EQ(sink->logprobs[0][0].top.size(), 2u);
  EXPECT_EQ(sink->logprobs[0][0].top[1].first, Decode(*service, {first + 1}));
  EXPECT_FLOAT_EQ(sink->logprobs[0][0].top[1].second, -1.25f);
  // The second token's are the decode worker's.
  const int32_t second = FakeToken(42, 0, 1, 2);
  EXPECT_EQ(sink->logprobs[0][1].token, Decode(*service, {second}));
  EXPECT_FLOAT_EQ(sink->logprobs[0][1].logprob, -0.5f);
  ASSERT_EQ(sink->logprobs[0][1].top.size(), 2u);
  EXPECT_FLOAT_EQ(sink->logprobs[0][1].top[1].second, -1.5f);
}

TEST_F(RouterServiceTest, FirstTokenLogprobsWaitForASlowPrefillForEveryChoice) {
  prefill_->delay_ms = 300;  // Generate's events arrive first and are held
  auto service = MakeService();
  frontend::ApiRequest req = Completion({4, 4, 4}, 3);
  req.logprobs = true;
  req.top_logprobs = 3;
  req.n = 2;
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  ASSERT_EQ(sink->logprobs.size(), 2u);
  for (uint32_t c = 0; c < 2; ++c) {
    ASSERT_EQ(sink->logprobs[c].size(), 3u) << "choice " << c;
    const int32_t first = FakeToken(42, c, 0, 3);
    EXPECT_EQ(sink->logprobs[c][0].token, Decode(*service, {first}));
    EXPECT_FLOAT_EQ(sink->logprobs[c][0].logprob, -0.25f);
    ASSERT_EQ(sink->logprobs[c][0].top.size(), 3u);
    EXPECT_EQ(sink->logprobs[c][0].top[2].first, Decode(*service, {first + 2}));
    EXPECT_FLOAT_EQ(sink->logprobs[c][0].top[2].second, -2.25f);
    EXPECT_FLOAT_EQ(sink->logprobs[c][2].logprob, -0.5f);
    EXPECT_EQ(sink->finish[c], "length");
  }
  EXPECT_EQ(sink->usage.completion_tokens, 6);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, FailedPrefillFailsALogprobsRequestBeforeAnyToken) {
  prefill_->prefill_code = grpc::StatusCode::INTERNAL;
  auto service = MakeService();
  frontend::ApiRequest req = Completion({4, 4}, 4);
  req.logprobs = true;
  req.top_logprobs = 1;
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 500);
  EXPECT_TRUE(sink->text.empty() || sink->text[0].empty());
}

TEST_F(RouterServiceTest, StopStringEndsTheChoiceAndAbortsTheDecodeWorker) {
  auto service = MakeService();
  std::vector<int32_t> ids;
  for (int i = 0; i < 8; ++i) ids.push_back(FakeToken(42, 0, i, 2));
  const std::string full = Decode(*service, ids);
  const std::string second = Decode(*service, {ids[2]});
  frontend::ApiRequest req = Completion({3, 3}, 8);
  req.stop = {second};
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed);
  EXPECT_EQ(sink->finish[0], "stop");
  EXPECT_EQ(sink->text[0], full.substr(0, full.find(second)));
  EXPECT_TRUE(
      Eventually([&] { return decode_[0]->Aborted(decode_[0]->reserves[0].request_id()); }));
}

TEST_F(RouterServiceTest, InvalidArgumentFromReserveIs400) {
  decode_[0]->reserve_code = grpc::StatusCode::INVALID_ARGUMENT;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1}, 2));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 400);
}

// A Reserve failing UNAVAILABLE, or CANCELLED although the router cancelled nothing (a decode
// worker that began to drain refuses a call that crossed its GOAWAY so, common/
// grpc_listener.h), is a worker going down: retried on the other decode worker.
class ReserveRetryTest : public RouterServiceTest,
                         public ::testing::WithParamInterface<grpc::StatusCode> {};

TEST_P(ReserveRetryTest, DecodeWorkerDownIsRetriedOnTheOther) {
  decode_[0]->reserve_code = GetParam();
  auto service = MakeService(2, PolicyKind::kLeastLoad);
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_EQ(sink->finish[0], "length");
  EXPECT_EQ(decode_[0]->reserves.size(), 1u);
  EXPECT_EQ(decode_[1]->reserves.size(), 1u);
  EXPECT_NE(service->MetricsText().find("pdserve_router_retries_total{reason=\"worker_down\"} 1"),
            std::string::npos)
      << service->MetricsText();
}

INSTANTIATE_TEST_SUITE_P(UnavailableOrCancelledByTheWorker, ReserveRetryTest,
                         ::testing::Values(grpc::StatusCode::UNAVAILABLE,
                                           grpc::StatusCode::CANCELLED));

// A Generate answered NOT_FOUND before any event: the decode worker on that port does not know
// the reservation (a replacement took the port of one that began to drain, between the Reserve
// and the Generate). Retried before the first token like a worker that is down, here on the
// same (only) decode worker, whose next Reserve holds.
TEST_F(RouterServiceTest, AGenerateThatFindsNoReservationIsRetried) {
  decode_[0]->forget_reservations = 1;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_EQ(sink->finish[0], "length");
  std::vector<int32_t> expected;
  for (int i = 0; i < 3; ++i) expected.push_back(FakeToken(42, 0, i, 2));
  EXPECT_EQ(sink->text[0], Decode(*service, expected));
  EXPECT_EQ(decode_[0]->reserves.size(), 2u);
  EXPECT_NE(service->MetricsText().find("pdserve_router_retries_total{reason=\"worker_down\"} 1"),
            std::string::npos)
      << service->MetricsText();
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// A decode worker that never finds its reservations is not retried without end: max_attempts
// (2) Reserves, then 503 with the worker's message.
TEST_F(RouterServiceTest, AGenerateThatNeverFindsItsReservationFailsAfterMaxAttempts) {
  decode_[0]->forget_reservations = 1000;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_NE(sink->error.message.find("has no reservation"), std::string::npos)
      << sink->error.message;
  EXPECT_EQ(decode_[0]->reserves.size(), 2u);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, ErrorEventFailsTheRequestWithTheIsolationError) {
  decode_[0]->fail_with_error_event = true;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 5));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 500);
  EXPECT_NE(sink->error.message.find("checksum mismatch"), std::string::npos);
  EXPECT_NE(sink->error.message.find("ISOLATION_ERROR_CHECKSUM"), std::string::npos);
  EXPECT_EQ(sink->error.code, "isolation_error");
}

// A decode worker that shuts down (its drain timeout passed) ends open requests with "abort":
// the client gets 503 (retry later), not 500.
TEST_F(RouterServiceTest, DecodeWorkerShuttingDownIs503) {
  decode_[0]->abort_message = "worker shutting down";
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 5));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "worker_aborted");
  EXPECT_NE(sink->error.message.find("worker shutting down"), std::string::npos)
      << sink->error.message;
}

TEST_F(RouterServiceTest, FailedPrefillIsAnError) {
  prefill_->prefill_code = grpc::StatusCode::INTERNAL;
  decode_[0]->token_delay_ms = 50;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 5));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 500);
  EXPECT_EQ(sink->error.code, "prefill_failed");
}

TEST_F(RouterServiceTest, FullPrefillWorkerIs429AndTheReservationIsAborted) {
  prefill_->prefill_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  decode_[0]->token_delay_ms = 50;  // Prefill's answer comes before the tokens
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 5));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 429);
  EXPECT_EQ(sink->error.code, "prefill_busy");
  EXPECT_TRUE(sink->text.empty() || sink->text[0].empty());
  const uint64_t id = decode_[0]->reserves[0].request_id();
  EXPECT_TRUE(Eventually([&] { return decode_[0]->Aborted(id); }));
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  // A busy worker is not a down one.
  EXPECT_TRUE(service->pool().prefill()[0]->up());
}

TEST_F(RouterServiceTest, FullPrefillWorkerIsRetriedOnAnotherOne) {
  prefill_->prefill_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  AddSecondPrefill();
  decode_[0]->token_delay_ms = 50;  // Prefill's answer comes before the tokens
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 4));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  std::vector<int32_t> expected;
  for (int i = 0; i < 4; ++i) expected.push_back(FakeToken(42, 0, i, 2));
  EXPECT_EQ(sink->text[0], Decode(*service, expected));
  // The fake decode does not wait for the commit: p1's Prefill may arrive after the last token.
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&second_prefill_->mu);
    return second_prefill_->prefills.size() == 1u;
  }));
}

// UNAVAILABLE, and CANCELLED although the router cancelled nothing (a Prefill that crossed a
// draining prefill worker's GOAWAY, common/grpc_listener.h), are a worker that is down: 503
// with no other prefill worker. Other codes are a prefill that failed: 500.
TEST_F(RouterServiceTest, UnavailablePrefillIs503AndOtherCodesAre500WithTheMessage) {
  decode_[0]->token_delay_ms = 50;  // Prefill's answer comes before the tokens
  auto service = MakeService();
  std::shared_ptr<CollectingSink> sink;
  for (const grpc::StatusCode code : {grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::CANCELLED}) {
    prefill_->prefill_code = code;
    service->pool().CheckAll();
    sink = Run(*service, Completion({1, 2}, 3));
    ASSERT_TRUE(sink->failed);
    EXPECT_EQ(sink->error.http_status, 503) << code;
    EXPECT_EQ(sink->error.code, "worker_unavailable") << code;
  }
  prefill_->prefill_code = grpc::StatusCode::FAILED_PRECONDITION;
  service->pool().CheckAll();
  sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 500);
  EXPECT_EQ(sink->error.code, "prefill_failed");
  EXPECT_NE(sink->error.message.find("fake prefill"), std::string::npos);
}

TEST_F(RouterServiceTest, StalledPrefillFailsAtItsDeadlineWith503) {
  prefill_->delay_ms = 1000;          // far past the 100 ms deadline
  decode_[0]->token_delay_ms = 3000;  // Generate has nothing to say meanwhile
  prefill_timeout_ = absl::Milliseconds(100);
  auto service = MakeService();
  frontend::ApiRequest req = Completion({1, 2}, 3);
  req.logprobs = true;  // the first token waits for Prefill
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "prefill_timeout");
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, PrefillOnAWorkerMarkedDownIsRetriedOnAnotherAtOnce) {
  prefill_->delay_ms = 60000;  // p0 never answers (stopped), far inside the 60 s deadline
  // No Generate event before the commit, as on a real decode worker (d0's first comes late).
  decode_[0]->token_delay_ms = 3000;
  AddSecondPrefill();
  auto service = MakeService(2);  // round robin: the retry goes to p1 and d1
  frontend::ApiRequest req = Completion({1, 2, 3}, 3);
  req.logprobs = true;  // the tokens wait for Prefill's answer (the first token's logprobs)
  auto sink = std::make_shared<CollectingSink>();
  const absl::Time start = absl::Now();
  frontend::StartResult started = service->Start(req, sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(Eventually([&] {  // round robin: the first request's Prefill is on p0
    absl::MutexLock lock(&decode_[0]->mu);
    return !decode_[0]->reserves.empty();
  }));
  prefill_->state = worker::v1::HealthResponse::STATE_NOT_SERVING;
  service->pool().CheckAll();
  service->pool().CheckAll();  // down_after = 2: p0 down, its Prefill cancelled
  ASSERT_FALSE(service->pool().prefill()[0]->up());
  ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  std::vector<int32_t> expected;
  for (int i = 0; i < 3; ++i) expected.push_back(FakeToken(42, 0, i, 3));
  EXPECT_EQ(sink->text[0], Decode(*service, expected));
  EXPECT_FLOAT_EQ(sink->logprobs[0][0].logprob, -0.25f);  // p1's first token logprobs
  EXPECT_TRUE(Eventually([&] {                            // p0 sees its call cancelled
    absl::MutexLock lock(&prefill_->mu);
    return prefill_->cancelled.size() == 1u;
  }));
  {
    absl::MutexLock lock(&second_prefill_->mu);
    EXPECT_EQ(second_prefill_->prefills.size(), 1u);
  }
  EXPECT_NE(service->MetricsText().find("pdserve_router_retries_total{reason=\"worker_down\"} 1"),
            std::string::npos)
      << service->MetricsText();
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// The prefill worker's first `n` Prefill calls fail in their transfer (worker/transfer_peer.h's
// marker). Returns `req` with logprobs: the router then holds a decode worker's tokens until
// Prefill has answered (the fake decode worker streams without waiting for a commit, as a real
// one never does).
frontend::ApiRequest FailTransfers(FakePrefill& prefill, int n, frontend::ApiRequest req) {
  prefill.fail_first = n;
  prefill.fail_details = worker::kTransferPeerFailed;
  req.logprobs = true;
  return req;
}

// A Prefill whose transfer to its decode worker failed (the worker marked it with
// worker/transfer_peer.h's details) counts against that decode worker, not the prefill worker:
// three such failures in a row (breaker_failures 3) used to open the only prefill worker's
// breaker, so the next request got 503 although both workers were fine. The retry goes to the
// other decode worker.
TEST_F(RouterServiceTest, TransferFailureCountsAgainstTheDecodeWorker) {
  auto service = MakeService(2);
  const frontend::ApiRequest req = FailTransfers(*prefill_, 3, Completion({1, 2}, 2));
  for (int i = 0; i < 3; ++i) {
    {
      absl::MutexLock lock(&prefill_->mu);
      if (prefill_->fail_first == 0) break;
    }
    Run(*service, req);
  }
  {
    absl::MutexLock lock(&prefill_->mu);
    ASSERT_EQ(prefill_->fail_first, 0);
  }
  EXPECT_TRUE(service->pool().prefill()[0]->up());  // three failures in a row, none its own
  auto after = Run(*service, req);
  EXPECT_FALSE(after->failed) << after->error.message;
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// When every try's transfer fails, the error says so and names the decode worker.
TEST_F(RouterServiceTest, TransferFailureOnEveryTryIs503NamingTheDecodeWorker) {
  auto service = MakeService(2);
  const frontend::ApiRequest req = FailTransfers(*prefill_, 1000, Completion({1, 2}, 2));
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_NE(sink->error.message.find("the state transfer to decode worker d"), std::string::npos)
      << sink->error.message;
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

// A Prefill that ends CANCELLED with the transfer's marker: the decode worker refused the pages
// (prefill/prefill_worker.cc marks a CANCELLED it did not cause). Not a prefill worker that
// drains (RefusedByDrainAsDown leaves a marked status alone), so not counted against it: 500
// with the worker's message and no retry, as for other codes that are not a worker down; three
// in a row leave the only prefill worker up (breaker_failures 3).
TEST_F(RouterServiceTest, PagesTheDecodeWorkerRefusedDoNotCountAgainstThePrefillWorker) {
  auto service = MakeService();
  const frontend::ApiRequest req = FailTransfers(*prefill_, 1000, Completion({1, 2}, 2));
  prefill_->fail_code = grpc::StatusCode::CANCELLED;
  for (int i = 0; i < 3; ++i) {
    auto sink = Run(*service, req);
    ASSERT_TRUE(sink->failed);
    EXPECT_EQ(sink->error.http_status, 500);
    EXPECT_EQ(sink->error.message, "prefill worker p0: fake transfer failure");
  }
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  {
    absl::MutexLock lock(&prefill_->mu);
    EXPECT_EQ(prefill_->prefills.size(), 3u);  // no retries
  }
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, PrefillOnTheOnlyPrefillWorkerMarkedDownIs503AtOnce) {
  prefill_->delay_ms = 60000;
  decode_[0]->token_delay_ms = 3000;  // no Generate event before the commit
  auto service = MakeService();
  frontend::ApiRequest req = Completion({1, 2, 3}, 3);
  req.logprobs = true;
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(req, sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return !decode_[0]->reserves.empty();
  }));
  prefill_->state = worker::v1::HealthResponse::STATE_NOT_SERVING;
  service->pool().CheckAll();
  service->pool().CheckAll();
  ASSERT_TRUE(sink->done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "worker_unavailable");
  // Retried at once, and no other prefill worker is up.
  EXPECT_EQ(sink->error.message,
            "no prefill worker is up (p0: it is not serving (health state STATE_NOT_SERVING))");
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST(RouterOptionsTest, PrefillDeadlineIsItsOwnSettingNotTheTransferLease) {
  config::DeployConfig deploy;
  deploy.model_path = "m";
  deploy.lease_ms = 150;
  absl::StatusOr<RouterOptions> defaults = OptionsFromConfig(deploy);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->prefill_timeout, absl::Seconds(60));
  EXPECT_EQ(defaults->lease_ms, 150);
  deploy.router.prefill_timeout_ms = 45000;
  absl::StatusOr<RouterOptions> set = OptionsFromConfig(deploy);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->prefill_timeout, absl::Seconds(45));
}

TEST(RouterOptionsTest, HealthTimeoutComesFromTheConfig) {
  config::DeployConfig deploy;
  deploy.model_path = "m";
  absl::StatusOr<RouterOptions> defaults = OptionsFromConfig(deploy);
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->health_timeout, absl::Seconds(2));
  deploy.router.health_timeout_ms = 7500;
  absl::StatusOr<RouterOptions> set = OptionsFromConfig(deploy);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->health_timeout, absl::Milliseconds(7500));
}

TEST_F(RouterServiceTest, LeaseRunningOutBeforePrefillAnswersIsAPrefillTimeoutNotIsolation) {
  prefill_->delay_ms = 300;  // has not answered when the decode worker's lease runs out
  decode_[0]->lease_error_first = true;
  auto service = MakeService();
  auto sink = Run(*service, Completion({1, 2}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "prefill_timeout");
  absl::MutexLock lock(&decode_[0]->mu);
  EXPECT_EQ(decode_[0]->reserves.size(), 2u);  // retried once
}

TEST_F(RouterServiceTest, BusyPrefillWorkerWhoseCanaryTimesOutStaysUp) {
  prefill_->delay_ms = 400;  // every Prefill outlasts the canary's 150 ms
  prefill_->stats_waiting = 3;
  prefill_->stats_bytes_per_call = 4096;  // sending: making progress
  canary_timeout_ = absl::Milliseconds(150);
  auto service = MakeService();  // its first CheckAll ran the prefill canary
  service->pool().CheckAll();
  service->pool().CheckAll();
  EXPECT_TRUE(service->pool().prefill()[0]->up());
}

TEST_F(RouterServiceTest, PrefillWorkerThatSentBytesSinceTheLastCheckStaysUpWithAnEmptyQueue) {
  canary_timeout_ = absl::Milliseconds(150);
  auto service = MakeService();  // canaries pass
  // Now each canary outlasts its 150 ms, as behind a long prefill that has just drained when
  // Stats answers (no queue), and the worker sent bytes between samples.
  prefill_->delay_ms = 400;
  prefill_->stats_waiting = 0;
  prefill_->stats_bytes_per_call = 4096;
  service->pool().CheckAll();  // the first sample, no queue: not known busy (one failure)
  service->pool().CheckAll();  // bytes grew since: busy, not wedged (before: a second failure)
  service->pool().CheckAll();
  EXPECT_TRUE(service->pool().prefill()[0]->up());
}

// A prefill worker with queued work whose canaries time out, while only one of its Stats
// progress counters grows between samples (tokens: chunks finished; layers: layers computed).
// Nothing is sent yet: the long prompt's forward runs.
TEST_F(RouterServiceTest, PrefillWorkerInTheForwardOfALongPromptStaysUp) {
  prefill_->stats_tokens_per_call = 64;  // a chunk finished between samples
  ExpectBusyPrefillStaysUp();
}

// One chunk of a long prompt can outlast several checks on a slow or loaded host (a 512-token
// chunk of kjv-v4-wide under load 20 on 2 cores: a new user's trial saw the worker marked down
// and its prefill cancelled): the layers it computes count as progress too.
TEST_F(RouterServiceTest, PrefillWorkerInsideOneLongChunkStaysUp) {
  prefill_->stats_layers_per_call = 2;  // no chunk finished, but two layers were computed
  ExpectBusyPrefillStaysUp();
}

TEST_F(RouterServiceTest, PrefillWorkerWithWorkButNoProgressIsMarkedDown) {
  prefill_->delay_ms = 400;
  prefill_->stats_waiting = 3;
  prefill_->stats_bytes_per_call = 0;  // wedged: nothing sent between checks
  canary_timeout_ = absl::Milliseconds(150);
  auto service = MakeService();  // first sample: counted busy, up
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  service->pool().CheckAll();
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().prefill()[0]->up());
}

TEST_F(RouterServiceTest, ModelsAreListedOnceWithoutThePathAndRejectionsAreCounted) {
  auto service = MakeService();
  const std::string dir_name = std::filesystem::path(PDSERVE_BUNDLED_MODEL).filename().string();
  EXPECT_EQ(service->ListedModelNames(), (std::vector<std::string>{"tiny", dir_name}));
  const std::vector<std::string> accepted = service->ModelNames();
  EXPECT_NE(std::find(accepted.begin(), accepted.end(), PDSERVE_BUNDLED_MODEL), accepted.end());
  service->RecordRejected(frontend::Endpoint::kCompletions, frontend::Front::kHttp, 400);
  service->RecordRejected(frontend::Endpoint::kChatCompletions, frontend::Front::kHttp, 404);
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find(R"(pdserve_router_requests_total{endpoint="completions",)"
                         R"(finish_reason="error",status="400"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_requests_total{endpoint="chat_completions",)"
                         R"(finish_reason="error",status="404"} 1)"),
            std::string::npos);
}

// The HTTP layer's refusals (413, 431, 408, malformed 400) count too; one whose request line
// did not parse as endpoint "unknown". The exposition stays valid for Prometheus.
TEST_F(RouterServiceTest, HttpLayerRefusalsAreCountedInValidExposition) {
  auto service = MakeService();
  service->RecordRefused(std::nullopt, 431);
  service->RecordRefused(frontend::Endpoint::kCompletions, 413);
  const std::string metrics = service->MetricsText();
  EXPECT_NE(metrics.find(R"(pdserve_router_requests_total{endpoint="unknown",)"
                         R"(finish_reason="error",status="431"} 1)"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find(R"(pdserve_router_requests_total{endpoint="completions",)"
                         R"(finish_reason="error",status="413"} 1)"),
            std::string::npos);
  if (!testing::HavePromtool()) {
    GTEST_SKIP() << "promtool not installed (Debian package prometheus)";
  }
  testing::ExpectPromtoolAccepts(metrics, "router_metrics.prom");
}

TEST_F(RouterServiceTest, ServedNameEqualToTheDirectoryNameIsListedOnce) {
  RouterOptions options;
  options.model_dir = PDSERVE_BUNDLED_MODEL;
  options.served_name = std::filesystem::path(PDSERVE_BUNDLED_MODEL).filename().string();
  options.prefill = {WorkerAt("p0", prefill_server_->port())};
  options.decode = {WorkerAt("d0", decode_servers_[0]->port())};
  options.canary = false;
  options.background_checks = false;
  auto service = RouterService::Create(options);
  ASSERT_TRUE(service.ok()) << service.status();
  EXPECT_EQ((*service)->ListedModelNames(), std::vector<std::string>{options.served_name});
}

TEST_F(RouterServiceTest, AWorkerDownAtTheFirstCheckIsCheckedAgainWithinTheDownRetry) {
  // `pdserve up` starts the router with its workers: the first check may find one not serving
  // yet. It used to be checked again only a whole health_interval later (router.health_interval_ms
  // up to 600000), so the cluster stayed not ready with nothing in the log.
  decode_[0]->state = worker::v1::HealthResponse::STATE_UNSPECIFIED;  // fails Health
  RouterOptions options;
  options.model_dir = PDSERVE_BUNDLED_MODEL;
  options.prefill = {WorkerAt("p0", prefill_server_->port())};
  options.decode = {WorkerAt("d0", decode_servers_[0]->port())};
  options.canary = false;
  options.health_interval = absl::Minutes(10);
  options.health_down_retry = absl::Milliseconds(50);
  auto service = RouterService::Create(options);
  ASSERT_TRUE(service.ok()) << service.status();
  ASSERT_TRUE(Eventually([&] { return (*service)->pool().prefill()[0]->up(); }));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE((*service)->Ready());  // d0 does not serve yet
  decode_[0]->state = worker::v1::HealthResponse::STATE_SERVING;
  EXPECT_TRUE(Eventually([&] { return (*service)->Ready(); }));
}

TEST_F(RouterServiceTest, StalledStreamOnADecodeWorkerMarkedDownEndsWithAnError) {
  decode_[0]->token_delay_ms = 60000;  // the stream says nothing
  stall_timeout_ = absl::ZeroDuration();
  auto service = MakeService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion({1, 2}, 5), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  // The stream is open on d0 (its Reserve arrived).
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return !decode_[0]->reserves.empty();
  }));
  decode_[0]->state = worker::v1::HealthResponse::STATE_UNSPECIFIED;  // fails Health
  service->pool().CheckAll();
  service->pool().CheckAll();  // down_after = 2: down, its stalled stream is cancelled
  ASSERT_FALSE(service->pool().decode()[0]->up());
  sink->done.WaitForNotification();
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "worker_unavailable");
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
}

TEST_F(RouterServiceTest, CancelAbortsBothWorkers) {
  decode_[0]->token_delay_ms = 100;
  auto service = MakeService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::StartResult started = service->Start(Completion({1, 2}, 200), sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started))
      << std::get<frontend::ApiError>(started).message;
  auto& generation = std::get<std::unique_ptr<frontend::Generation>>(started);
  for (int i = 0; i < 400; ++i) {
    {
      absl::MutexLock lock(&sink->mu);
      if (!sink->text.empty()) break;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  generation->Cancel();
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  const uint64_t id = decode_[0]->reserves[0].request_id();
  EXPECT_TRUE(Eventually([&] { return decode_[0]->Aborted(id); }));
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&prefill_->mu);
    return !prefill_->aborts.empty();
  }));
  absl::MutexLock lock(&prefill_->mu);
  ASSERT_EQ(prefill_->aborts.size(), 1u);
  EXPECT_EQ(prefill_->aborts[0], id);
  EXPECT_FALSE(sink->done.HasBeenNotified());
}

TEST_F(RouterServiceTest, WorkerFailingHealthIsMarkedDownAndBackUp) {
  auto service = MakeService(2);
  decode_[1]->state = worker::v1::HealthResponse::STATE_NOT_SERVING;
  service->pool().CheckAll();
  EXPECT_TRUE(service->pool().decode()[1]->up());  // one failed check is not enough
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().decode()[1]->up());
  EXPECT_NE(
      service->MetricsText().find("pdserve_router_worker_up{role=\"decode\",worker=\"d1\"} 0"),
      std::string::npos);
  // Requests go to the other decode worker only.
  for (int i = 0; i < 4; ++i) ASSERT_FALSE(Run(*service, Completion({1}, 1))->failed);
  EXPECT_EQ(decode_[1]->reserves.size(), 0u);
  EXPECT_EQ(decode_[0]->reserves.size(), 4u);
  decode_[1]->state = worker::v1::HealthResponse::STATE_SERVING;
  service->pool().CheckAll();
  EXPECT_TRUE(service->pool().decode()[1]->up());
}

// A worker back after a long outage is seen up by the next check or two, not at gRPC's next
// reconnect, which backs off to 120 s by default (a real decode worker down 60 s was seen up
// 9-16 s after it served again). Down about 12 s here: by default the next reconnect comes
// about 16 s after the outage began (1, 1.6, 2.6, 4.1, 6.6 s apart), some 4 s after the restart.
TEST(WorkerPoolTest, WorkerBackAfterAnOutageIsSeenUpWithinASecondOrTwo) {
  FakeDecode decode;
  int port = 0;
  {
    FakeServer probe(&decode);  // finds a free port, then frees it
    port = probe.port();
  }
  WorkerPoolOptions options;
  config::WorkerConfig worker;
  worker.name = "d0";
  worker.host = "127.0.0.1";
  worker.port = port;
  options.decode.push_back(worker);
  options.down_after = 1;
  options.background_checks = false;
  WorkerPool pool(options, [] { return uint64_t{1}; });
  const absl::Time outage_end = absl::Now() + absl::Seconds(12);
  while (absl::Now() < outage_end) {
    pool.CheckAll();
    EXPECT_FALSE(pool.decode()[0]->up());
    absl::SleepFor(absl::Milliseconds(200));
  }
  FakeServer back(&decode, port);
  ASSERT_EQ(back.port(), port);
  const absl::Time restarted = absl::Now();
  while (!pool.decode()[0]->up() && absl::Now() - restarted < absl::Seconds(10)) {
    pool.CheckAll();
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(pool.decode()[0]->up());
  EXPECT_LT(absl::Now() - restarted, absl::Milliseconds(2500));
}

// Stopping the pool does not wait out a check's deadline: a worker that stopped answering
// (SIGSTOPped, its connection open) held the router's shutdown on SIGTERM for the whole
// router.health_timeout_ms (up to 10 minutes) before the checks in flight were cancelled.
TEST(WorkerPoolTest, StoppingCancelsAHangingCheckInsteadOfWaitingOutItsDeadline) {
  FakeDecode decode;
  decode.health_hangs = true;
  FakeServer server(&decode);
  WorkerPoolOptions options;
  config::WorkerConfig worker;
  worker.name = "d0";
  worker.host = "127.0.0.1";
  worker.port = server.port();
  options.decode.push_back(worker);
  options.health_timeout = absl::Seconds(60);
  auto pool = std::make_unique<WorkerPool>(options, [] { return uint64_t{1}; });
  const absl::Time started = absl::Now();
  while (decode.health_calls.load() == 0 && absl::Now() - started < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_GT(decode.health_calls.load(), 0);
  const absl::Time stopping = absl::Now();
  pool.reset();
  EXPECT_LT(absl::Now() - stopping, absl::Seconds(3));
}

TEST_F(RouterServiceTest, ContextOverflowIs400) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({1, 2, 3}, 1 << 30);
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 400);
  EXPECT_EQ(sink->error.code, "context_length_exceeded");
}

}  // namespace
}  // namespace pdserve::router
