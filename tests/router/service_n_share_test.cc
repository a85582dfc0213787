// n > 1 through the router: the request's choices share one Reserve (choice_count n), one
// Prefill and one transfer; each choice streams its own fork (worker request id + k) with its own
// stream (seed, choice). Retries, failures and cancellation cover the whole group.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <vector>

#include "router/service.h"
#include "tests/router/service_fixture.h"

namespace pdserve::router {
namespace {

using testing::CollectingSink;
using testing::Eventually;
using testing::FakeToken;
using testing::RouterServiceTest;

// The choice texts the fake workers give for `prompt_tokens` and `max_tokens` with seed 42.
std::vector<std::vector<int32_t>> Expected(int n, int prompt_tokens, int max_tokens) {
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(n));
  for (int c = 0; c < n; ++c) {
    for (int i = 0; i < max_tokens; ++i) {
      out[static_cast<size_t>(c)].push_back(
          FakeToken(42, static_cast<uint32_t>(c), i, prompt_tokens));
    }
  }
  return out;
}

TEST_F(RouterServiceTest, ChoicesShareOneReserveAndOnePrefillAndStreamTheirOwnForks) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({9, 9, 9}, 4);
  req.n = 4;
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  const auto expected = Expected(4, 3, 4);
  ASSERT_EQ(sink->text.size(), 4u);
  for (size_t c = 0; c < 4; ++c) {
    EXPECT_EQ(sink->text[c], Decode(*service, expected[c])) << "choice " << c;
    EXPECT_EQ(sink->finish[c], "length");
  }
  EXPECT_EQ(sink->usage.completion_tokens, 16);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  // Every fork's stream ended (its handler gives the slot back as it returns).
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->holding.empty();
  }));
  uint64_t base = 0;
  {
    absl::MutexLock lock(&decode_[0]->mu);
    ASSERT_EQ(decode_[0]->reserves.size(), 1u);
    const auto& reserve = decode_[0]->reserves[0];
    EXPECT_EQ(reserve.sampling().choice(), 0u);
    EXPECT_EQ(reserve.sampling().choice_count(), 4u);
    base = reserve.request_id();
    EXPECT_TRUE(decode_[0]->aborts.empty());
  }
  // The fake decode streams without waiting for the Prefill, which may still be on its way.
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&prefill_->mu);
    return !prefill_->prefills.empty();
  }));
  absl::MutexLock lock(&prefill_->mu);
  ASSERT_EQ(prefill_->prefills.size(), 1u);
  EXPECT_EQ(prefill_->prefills[0].request_id(), base);
  EXPECT_EQ(prefill_->prefills[0].sampling().choice_count(), 4u);
}

TEST_F(RouterServiceTest, OneChoiceSendsNoChoiceCount) {
  auto service = MakeService();
  auto sink = Run(*service, Completion({9, 9}, 2));
  ASSERT_FALSE(sink->failed) << sink->error.message;
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 1u);
  EXPECT_EQ(decode_[0]->reserves[0].sampling().choice_count(), 0u);  // wire default: 1 choice
}

// A Prefill that fails before any token: the whole group is aborted with one Abort covering its
// forks and tried again as a whole (one new Reserve, one new Prefill).
TEST_F(RouterServiceTest, FailedPrefillRetriesTheWholeGroupOnce) {
  prefill_->fail_first = 1;
  auto service = MakeService();
  frontend::ApiRequest req = Completion({5, 5}, 3);
  req.n = 3;
  req.logprobs = true;  // the choices' events wait for the Prefill answer: no token goes out first
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  const auto expected = Expected(3, 2, 3);
  for (size_t c = 0; c < 3; ++c) EXPECT_EQ(sink->text[c], Decode(*service, expected[c]));
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  {
    absl::MutexLock lock(&prefill_->mu);
    EXPECT_EQ(prefill_->prefills.size(), 2u);
  }
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->abort_requests.size() == 1;
  }));
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->reserves.size(), 2u);
  for (const auto& reserve : decode_[0]->reserves) {
    EXPECT_EQ(reserve.sampling().choice_count(), 3u);
  }
  const auto& abort = decode_[0]->abort_requests[0];
  EXPECT_EQ(abort.request_id(), decode_[0]->reserves[0].request_id());
  EXPECT_EQ(abort.choice_count(), 3u);
  EXPECT_TRUE(abort.prefill_quiesced());
  EXPECT_NE(service->MetricsText().find("pdserve_router_retries_total{reason=\"worker_down\"} 1"),
            std::string::npos);
}

// A failure with no retry left fails every choice at once (one error, nothing completes).
TEST_F(RouterServiceTest, FailedPrefillWithoutRetriesFailsEveryChoice) {
  prefill_->prefill_code = grpc::StatusCode::INTERNAL;
  auto service = MakeService();
  frontend::ApiRequest req = Completion({5, 5}, 3);
  req.n = 5;
  req.logprobs = true;  // every choice's events wait for the Prefill answer: no token goes out
  req.top_logprobs = 1;
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 500);
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  // The decode worker's Abort follows the prefill worker's answer.
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->holding.empty() && !decode_[0]->abort_requests.empty();
  }));
  absl::SleepFor(absl::Milliseconds(50));  // no second Abort follows
  absl::MutexLock lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->abort_requests.size(), 1u);
  EXPECT_EQ(decode_[0]->abort_requests[0].choice_count(), 5u);
}

// The client gone: every choice ends, the prefill worker gets one Abort and the decode worker one
// Abort covering every fork.
TEST_F(RouterServiceTest, CancelEndsEveryChoiceWithOneAbortPerWorker) {
  decode_[0]->token_delay_ms = 100;
  auto service = MakeService();
  auto sink = std::make_shared<CollectingSink>();
  frontend::ApiRequest req = Completion({1, 2}, 200);
  req.n = 3;
  frontend::StartResult started = service->Start(req, sink);
  ASSERT_TRUE(std::holds_alternative<std::unique_ptr<frontend::Generation>>(started));
  auto& generation = std::get<std::unique_ptr<frontend::Generation>>(started);
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&sink->mu);
    return !sink->text.empty();
  }));
  generation->Cancel();
  EXPECT_TRUE(Eventually([&] { return service->in_flight() == 0; }));
  uint64_t base = 0;
  {
    absl::MutexLock lock(&decode_[0]->mu);
    base = decode_[0]->reserves[0].request_id();
  }
  for (uint64_t k = 0; k < 3; ++k) {
    EXPECT_TRUE(Eventually([&] { return decode_[0]->Aborted(base + k); })) << "fork " << k;
  }
  absl::MutexLock decode_lock(&decode_[0]->mu);
  ASSERT_EQ(decode_[0]->abort_requests.size(), 1u);
  EXPECT_EQ(decode_[0]->abort_requests[0].choice_count(), 3u);
  absl::MutexLock lock(&prefill_->mu);
  ASSERT_EQ(prefill_->aborts.size(), 1u);
  EXPECT_EQ(prefill_->aborts[0], base);
  EXPECT_FALSE(sink->done.HasBeenNotified());
}

// A stop string ends its own choice only: its fork alone is aborted, the others run on.
TEST_F(RouterServiceTest, StopStringAbortsOnlyItsOwnFork) {
  auto service = MakeService();
  frontend::ApiRequest req = Completion({9, 9, 9}, 6);
  req.n = 3;
  const auto expected = Expected(3, 3, 6);
  // A piece of choice 1's text that the others' texts do not contain stops choice 1 alone.
  std::string stop;
  for (size_t i = 1; i + 1 < expected[1].size() && stop.empty(); ++i) {
    const std::string piece = Decode(*service, {expected[1][i], expected[1][i + 1]});
    if (piece.size() >= 2 && Decode(*service, expected[0]).find(piece) == std::string::npos &&
        Decode(*service, expected[2]).find(piece) == std::string::npos) {
      stop = piece;
    }
  }
  ASSERT_FALSE(stop.empty());
  req.stop = {stop};
  auto sink = Run(*service, req);
  ASSERT_FALSE(sink->failed) << sink->error.message;
  EXPECT_EQ(sink->finish[0], "length");
  EXPECT_EQ(sink->finish[1], "stop");
  EXPECT_EQ(sink->finish[2], "length");
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&decode_[0]->mu);
    return decode_[0]->abort_requests.size() == 1;
  }));
  absl::MutexLock lock(&decode_[0]->mu);
  EXPECT_EQ(decode_[0]->abort_requests[0].request_id(), decode_[0]->reserves[0].request_id() + 1);
  EXPECT_EQ(decode_[0]->abort_requests[0].choice_count(), 0u);
}

// A decode worker that can never hold the n choices says so starting "n = ": a 400 on n (a
// request that can never fit for its length stays a 400 on max_tokens).
TEST_F(RouterServiceTest, ChoicesThatCanNeverFitTheDecodeWorkerAre400OnN) {
  decode_[0]->reserve_code = grpc::StatusCode::FAILED_PRECONDITION;
  decode_[0]->reserve_message = "n = 4 choices of prompt 2 + max_tokens 3 tokens need 8 pages";
  auto service = MakeService();
  frontend::ApiRequest req = Completion({5, 5}, 3);
  req.n = 4;
  auto sink = Run(*service, req);
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 400);
  EXPECT_EQ(sink->error.param, "n");
  EXPECT_NE(sink->error.message.find("n = 4 choices"), std::string::npos) << sink->error.message;
}

}  // namespace
}  // namespace pdserve::router
