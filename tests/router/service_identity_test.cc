// The router's model identity check and the canary's blame for a pair that cannot work together
// (router/worker_pool.h), against fake workers that state an identity in Health.
#include <gtest/gtest.h>

#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model_fingerprint.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/router/service_fixture.h"
#include "worker/transfer_peer.h"

namespace pdserve::router::testing {
namespace {

class RouterIdentityTest : public RouterServiceTest {
 protected:
  // The fingerprint the router computes of its model directory (PDSERVE_BUNDLED_MODEL).
  static uint64_t BundledFingerprint() {
    absl::StatusOr<uint64_t> f = common::ModelFingerprint(PDSERVE_BUNDLED_MODEL);
    EXPECT_TRUE(f.ok()) << f.status();
    return f.value_or(0);
  }
  void StateIdentity(uint64_t fingerprint, const std::string& geometry) {
    for (auto& d : decode_) {
      d->model = "tiny";
      d->model_fingerprint = fingerprint;
      d->page_geometry = geometry;
    }
    prefill_->model = "tiny";
    prefill_->model_fingerprint = fingerprint;
    prefill_->page_geometry = geometry;
  }
};

// The log line names the fields that differ; a cluster field no matching worker has stated yet
// reads "not known yet" (not "?"), and fingerprints read as hex and as Health's decimal.
TEST(ModelMismatchTextTest, NamesTheDifferingFieldsAndWhatIsNotKnownYet) {
  const ModelIdentity stated{"tiny", 0x2a, "layers=sch"};
  const ModelIdentity cluster{"tiny", 0x2b, ""};
  EXPECT_EQ(DescribeModelMismatch(stated, cluster),
            "differs in fingerprint: it states model tiny, fingerprint 0x000000000000002a (42), "
            "geometry layers=sch; the cluster is model tiny, fingerprint 0x000000000000002b (43), "
            "geometry not known yet");
  const ModelIdentity renamed{"wide", 0, "layers=scchh"};
  EXPECT_EQ(DescribeModelMismatch(renamed, {"tiny", 0x2b, "layers=sch"}),
            "differs in model, geometry: it states model wide, fingerprint not stated, geometry "
            "layers=scchh; the cluster is model tiny, fingerprint 0x000000000000002b (43), "
            "geometry layers=sch");
}

TEST_F(RouterIdentityTest, DecodeWorkerWithOtherWeightsIsMarkedDownAtOnce) {
  StateIdentity(BundledFingerprint(), "layers=sch");
  decode_[1]->model_fingerprint = BundledFingerprint() ^ 1;  // random weights of the same shapes
  auto service = MakeService(2);
  EXPECT_TRUE(service->pool().decode()[0]->up());
  EXPECT_FALSE(service->pool().decode()[1]->up());  // one check, not down_after
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  EXPECT_NE(
      service->MetricsText().find("pdserve_router_worker_up{role=\"decode\",worker=\"d1\"} 0"),
      std::string::npos);
  for (int i = 0; i < 4; ++i) {
    auto sink = Run(*service, Completion({1, 2, 3}, 3));
    EXPECT_FALSE(sink->failed) << sink->error.message;
  }
  absl::MutexLock lock(&decode_[1]->mu);
  EXPECT_TRUE(decode_[1]->reserves.empty());  // nothing went to the wrong model
}

TEST_F(RouterIdentityTest, OtherNameOrGeometryIsMarkedDownAndComesBackOnTheRightModel) {
  StateIdentity(0, "layers=sch");  // fingerprints not stated: the name and geometry decide
  decode_[1]->page_geometry = "layers=scchh";
  auto service = MakeService(2);  // d0's geometry is the first stated: the cluster's
  EXPECT_TRUE(service->pool().decode()[0]->up());
  EXPECT_FALSE(service->pool().decode()[1]->up());
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  prefill_->model = "another-model";  // restarted on another model under another name
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().prefill()[0]->up());
  EXPECT_FALSE(service->Ready());
  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  EXPECT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  // Restarted on the cluster's model: the next check brings them back.
  decode_[1]->page_geometry = "layers=sch";
  prefill_->model = "tiny";
  service->pool().CheckAll();
  EXPECT_TRUE(service->pool().decode()[1]->up());
  EXPECT_TRUE(service->pool().prefill()[0]->up());
  EXPECT_TRUE(service->Ready());
}

TEST_F(RouterIdentityTest, AllDecodeWorkersOnAnotherModelLeaveTheRouterNotReadyWith503) {
  StateIdentity(BundledFingerprint(), "layers=sch");
  auto service = MakeService(2);
  for (auto& d : decode_) d->model_fingerprint = 42;
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().decode()[0]->up());
  EXPECT_FALSE(service->pool().decode()[1]->up());
  EXPECT_FALSE(service->Ready());
  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  EXPECT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
}

TEST_F(RouterIdentityTest, CanaryBlamesTheDecodeWorkerWhoseTicketsThePrefillWorkerRefuses) {
  // d0 states no identity (a worker that predates it) and issues tickets of another geometry;
  // it is first in the list, so the prefill worker's canary meets it first.
  prefill_->accepted_ticket_fingerprint = 5;
  decode_[0]->ticket_fingerprint = 9;
  decode_[1]->ticket_fingerprint = 5;
  canary_timeout_ = absl::Seconds(5);
  auto service = MakeService(2);
  service->pool().CheckAll();
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().decode()[0]->up());
  EXPECT_TRUE(service->pool().decode()[1]->up());
  EXPECT_TRUE(service->pool().prefill()[0]->up());  // it passes through d1
  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  EXPECT_FALSE(sink->failed) << sink->error.message;
}

TEST_F(RouterIdentityTest, TransferFailureInTheCanaryIsTheDecodeWorkersNotThePrefillWorkers) {
  canary_timeout_ = absl::Seconds(5);
  auto service = MakeService(1);
  prefill_->fail_first = 1000;
  prefill_->fail_details = worker::kTransferPeerFailed;
  service->pool().CheckAll();
  service->pool().CheckAll();
  EXPECT_FALSE(service->pool().decode()[0]->up());
  EXPECT_TRUE(service->pool().prefill()[0]->up());
}

// Between health checks a request may still meet a decode worker of another model: the prefill
// worker refuses its ticket (ticket_mismatch) and the request is retried on another decode
// worker; with none left it gets 503, not 500.
TEST_F(RouterIdentityTest, RequestWhoseTicketIsRefusedIsRetriedOnAnotherDecodeWorker) {
  prefill_->accepted_ticket_fingerprint = 5;
  decode_[0]->ticket_fingerprint = 9;
  decode_[1]->ticket_fingerprint = 5;
  // The fakes stream without waiting for a transfer: slow enough that the refusal comes first.
  for (auto& d : decode_) d->token_delay_ms = 25;
  auto service = MakeService(2);  // no canary: both decode workers are up
  for (int i = 0; i < 4; ++i) {
    auto sink = Run(*service, Completion({1, 2, 3}, 3));
    EXPECT_FALSE(sink->failed) << sink->error.message;
  }
  {
    absl::MutexLock lock(&prefill_->mu);
    int refused = 0;
    for (const auto& prefill : prefill_->prefills)
      refused += prefill.ticket().model_fingerprint() == 9;
    EXPECT_GE(refused, 1);  // round robin sent some to d0; each was tried again on d1
  }
  decode_[1]->ticket_fingerprint = 9;
  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  EXPECT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503) << sink->error.message;
  EXPECT_EQ(sink->error.code, "workers_incompatible");
  EXPECT_TRUE(
      sink->error.message.starts_with("prefill worker p0 refused the ticket of decode "
                                      "worker d"))
      << sink->error.message;
}

// The log lines of the default logger while it lives, for assertions.
class CapturedLog {
 public:
  CapturedLog()
      : previous_(spdlog::default_logger()),
        logger_(std::make_shared<spdlog::logger>(
            "captured", std::make_shared<spdlog::sinks::ostream_sink_mt>(lines_))) {
    spdlog::set_default_logger(logger_);
  }
  ~CapturedLog() { spdlog::set_default_logger(previous_); }
  int Count(const std::string& text) {
    logger_->flush();
    const std::string all = lines_.str();
    int n = 0;
    for (size_t at = all.find(text); at != std::string::npos; at = all.find(text, at + 1)) ++n;
    return n;
  }

 private:
  std::ostringstream lines_;
  std::shared_ptr<spdlog::logger> previous_;
  std::shared_ptr<spdlog::logger> logger_;
};

// breaker G2: the only two workers disagree on transfer.ucx_protocols, so the prefill worker
// refuses every ticket of the decode worker. The canary ends when the Prefill fails (its
// Generate waited for the transfer until the canary's deadline), the log says so once, not at
// every check, and the client's 503 names the refusal, not only "no worker is up".
TEST_F(RouterIdentityTest, APairThatRefusesEachOtherFailsFastOnceLoggedAndNamedToTheClient) {
  const std::string refusal =
      "the ticket's decode worker uses UCX protocols v2, this worker v1 (transfer.ucx_protocols "
      "or UCX_PROTO_ENABLE must agree on both workers)";
  prefill_->accepted_ticket_fingerprint = 5;
  prefill_->mismatch_message = "request 77: " + refusal;
  decode_[0]->ticket_fingerprint = 9;
  decode_[0]->generate_wait_ms = 4000;  // waits for a transfer that never comes
  canary_timeout_ = absl::Seconds(5);
  CapturedLog log;
  auto service = MakeService(1, PolicyKind::kRoundRobin, /*expect_ready=*/false);
  for (int i = 0; i < 3; ++i) {
    const absl::Time start = absl::Now();
    service->pool().CheckAll();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "check " << i;
  }
  EXPECT_TRUE(service->pool().decode()[0]->up());  // no up partner: Health decides
  EXPECT_FALSE(service->pool().prefill()[0]->up());
  EXPECT_FALSE(service->Ready());
  const std::string why =
      "every up partner it was tried with refused the pair: prefill worker p0 refused the "
      "ticket of decode worker d0: " +
      refusal;
  EXPECT_EQ(log.Count(absl::StrCat("router: prefill worker p0 failed its check: ", why)), 1);
  EXPECT_EQ(log.Count(refusal), 1);  // 4 checks of p0, one line

  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.type, "server_error");
  EXPECT_EQ(sink->error.code, "workers_incompatible");
  EXPECT_EQ(sink->error.message, absl::StrCat("no prefill worker is up (p0: ", why, ")"));

  // Fixed (restarted with the same protocols): the next check brings it back and it serves.
  decode_[0]->ticket_fingerprint = 5;
  decode_[0]->generate_wait_ms = 0;
  service->pool().CheckAll();
  EXPECT_TRUE(service->Ready());
  EXPECT_FALSE(Run(*service, Completion({1, 2, 3}, 3))->failed);
}

// While no worker of a role is up for another reason, the 503 names that reason too, with the
// code worker_unavailable (nothing is misconfigured).
TEST_F(RouterIdentityTest, NoPrefillWorkerUpNamesTheReasonOfEach) {
  auto service = MakeService();
  prefill_->state = worker::v1::HealthResponse::STATE_NOT_SERVING;
  service->pool().CheckAll();
  service->pool().CheckAll();
  ASSERT_FALSE(service->Ready());
  auto sink = Run(*service, Completion({1, 2, 3}, 3));
  ASSERT_TRUE(sink->failed);
  EXPECT_EQ(sink->error.http_status, 503);
  EXPECT_EQ(sink->error.code, "worker_unavailable");
  EXPECT_EQ(sink->error.message,
            "no prefill worker is up (p0: it is not serving (health state STATE_NOT_SERVING))");
}

}  // namespace
}  // namespace pdserve::router::testing
