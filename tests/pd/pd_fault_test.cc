// Fault proofs of issue 5 with real processes over loopback UCX tcp (the transport that detects a
// lost peer; docs/protocol.md): an abort mid-transfer followed at once by a request that reuses
// the pages; the prefill worker killed mid-transfer; the decode worker killed mid-transfer. The
// transfer is held open with the prefill worker's TEST-ONLY delay switch (prefill/test_faults.h).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <csignal>
#include <iostream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/model_fingerprint.h"
#include "tests/pd/pd_cluster.h"
#include "worker/transfer_peer.h"

namespace pdserve::pd::testing {
namespace {

namespace v1 = pdserve::worker::v1;

RequestSpec Spec(uint64_t id, int length, uint64_t seed) {
  RequestSpec s;
  s.request_id = id;
  for (int t = 0; t < length; ++t) s.prompt.push_back(2 + (t * 37 + static_cast<int>(id)) % 4000);
  s.params.temperature = 0.6;
  s.params.top_p = 0.95;
  s.params.seed = seed;
  s.params.max_tokens = 6;
  s.params.logprobs = 1;
  return s;
}

// Reserve on the decode worker; the ticket goes to `reserved` when given.
grpc::Status ReserveOnDecode(PdCluster& cluster, const RequestSpec& spec,
                             v1::ReserveResponse* reserved = nullptr) {
  grpc::ClientContext c;
  v1::ReserveResponse response;
  return cluster.decode().Reserve(&c, ReserveFor(spec), reserved ? reserved : &response);
}

// Sends Abort for request `id` to the decode worker (with `prefill_quiesced`) and returns its
// answer; the call must succeed.
v1::AbortResponse AbortOnDecode(PdCluster& cluster, uint64_t id, bool prefill_quiesced) {
  grpc::ClientContext c;
  v1::AbortRequest abort;
  abort.set_request_id(id);
  abort.set_prefill_quiesced(prefill_quiesced);
  v1::AbortResponse response;
  EXPECT_TRUE(cluster.decode().Abort(&c, abort, &response).ok());
  return response;
}

// Attaches Generate to `ticket`'s request and reads its stream to the end (deadline in s).
Outcome GenerateOutcome(PdCluster& cluster, uint64_t request_id, const v1::TransferTicket& ticket,
                        int deadline_s) {
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  v1::GenerateRequest generate;
  generate.set_request_id(request_id);
  generate.set_ticket_id(ticket.ticket_id());
  auto reader = cluster.decode().Generate(&c, generate);
  Outcome outcome;
  ReadGenerate(*reader, &outcome);
  return outcome;
}

// Attaches Generate to `ticket`'s request, cancels the call after `wait` (the client went away)
// and returns the call's final status code.
grpc::StatusCode CancelGenerateAfter(PdCluster& cluster, const v1::TransferTicket& ticket,
                                     absl::Duration wait) {
  grpc::ClientContext c;
  v1::GenerateRequest generate;
  generate.set_request_id(ticket.request_id());
  generate.set_ticket_id(ticket.ticket_id());
  auto reader = cluster.decode().Generate(&c, generate);
  absl::SleepFor(wait);
  c.TryCancel();
  v1::GenerateResponse event;
  while (reader->Read(&event)) {
  }
  return reader->Finish().error_code();
}

// Reserves `spec` and starts its Prefill and Generate without waiting for them.
struct InFlight {
  v1::ReserveResponse reserved;
  grpc::Status prefill_status;
  Outcome outcome;
  std::thread prefill;
  std::thread generate;
  void Join() {
    if (prefill.joinable()) prefill.join();
    if (generate.joinable()) generate.join();
  }
};

void StartInFlight(PdCluster& cluster, const RequestSpec& spec, InFlight* flight) {
  grpc::ClientContext context;
  ASSERT_TRUE(cluster.decode().Reserve(&context, ReserveFor(spec), &flight->reserved).ok());
  flight->prefill = std::thread([&cluster, spec, flight] {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::PrefillResponse response;
    flight->prefill_status =
        cluster.prefill().Prefill(&c, PrefillFor(spec, flight->reserved.ticket()), &response);
  });
  flight->generate = std::thread([&cluster, spec, flight] {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GenerateRequest generate;
    generate.set_request_id(spec.request_id);
    generate.set_ticket_id(flight->reserved.ticket().ticket_id());
    auto reader = cluster.decode().Generate(&c, generate);
    ReadGenerate(*reader, &flight->outcome);
  });
}

TEST(PdFaultTest, AbortMidTransferThenPagesReusedMatchesAloneRun) {
  const RequestSpec first = Spec(700001, 200, 5);
  const RequestSpec second = Spec(700002, 150, 6);
  ClusterOptions options;
  options.decode_max_batch = 1;  // one request's pages: the second must reuse the first's
  options.decode_pool_tokens = 512;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=700001", "PDSERVE_TEST_DELAY_MS=1500"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();

  InFlight flight;
  StartInFlight(**cluster, first, &flight);
  absl::SleepFor(absl::Milliseconds(400));  // the pages are posted and held in flight
  {
    grpc::ClientContext c;
    v1::AbortRequest abort;
    abort.set_request_id(first.request_id);
    v1::AbortResponse response;
    ASSERT_TRUE((*cluster)->prefill().Abort(&c, abort, &response).ok());
    EXPECT_TRUE(response.quiesced());
  }
  // The prefill worker's fence ends the request on decode at once (the router aborts the prefill
  // worker first): an abandoned transfer, not an isolation error.
  flight.Join();
  EXPECT_EQ(flight.outcome.finish_reason, "error");
  EXPECT_EQ(flight.outcome.isolation_error, v1::ISOLATION_ERROR_UNSPECIFIED);
  EXPECT_TRUE(absl::StrContains(flight.outcome.error, "prefill worker abandoned the transfer"))
      << flight.outcome.error;
  EXPECT_EQ(flight.prefill_status.error_code(), grpc::StatusCode::CANCELLED);
  // The router's decode Abort that follows finds the pages free already.
  EXPECT_TRUE(AbortOnDecode(**cluster, first.request_id, /*prefill_quiesced=*/true).quiesced());
  // At once: the second request's Reserve finds the first's pages back.
  Outcome outcome;
  const absl::Time until = absl::Now() + absl::Seconds(20);
  do {
    outcome = (*cluster)->Run(second);
  } while (absl::StrContains(outcome.error, "Reserve") && absl::Now() < until);
  const std::vector<Outcome> alone = RunColocated({second});
  EXPECT_TRUE(outcome.error.empty()) << outcome.error;
  EXPECT_EQ(outcome.tokens, alone[0].tokens);
  EXPECT_EQ(outcome.logprob_bits, alone[0].logprob_bits);
  EXPECT_EQ(outcome.finish_reason, alone[0].finish_reason);
  const v1::StatsResponse stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
}

TEST(PdFaultTest, PrefillKilledMidTransferFreesDecodePagesAfterLease) {
  ClusterOptions options;
  options.lease_ms = 1500;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=all", "PDSERVE_TEST_DELAY_MS=20000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight flight;
  StartInFlight(**cluster, Spec(710001, 100, 1), &flight);
  absl::SleepFor(absl::Milliseconds(400));
  EXPECT_LT(DecodeStats(**cluster).pages_free(), DecodeStats(**cluster).pages_total());
  (*cluster)->prefill_process().Kill();
  flight.Join();
  EXPECT_EQ(flight.outcome.finish_reason, "error");
  EXPECT_EQ(flight.outcome.isolation_error, v1::ISOLATION_ERROR_LEASE) << flight.outcome.error;
  EXPECT_TRUE(flight.outcome.tokens.empty());
  // The failed ticket's pages are quarantined until the lease ends, then freed.
  v1::StatsResponse stats;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(100));
    stats = DecodeStats(**cluster);
  } while (stats.pages_free() != stats.pages_total() && absl::Now() < until);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.isolation_errors(v1::ISOLATION_ERROR_LEASE), 1);
}

TEST(PdFaultTest, DecodeKilledMidTransferEndsPrefillWork) {
  ClusterOptions options;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=all", "PDSERVE_TEST_DELAY_MS=20000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight flight;
  StartInFlight(**cluster, Spec(720001, 100, 1), &flight);
  absl::SleepFor(absl::Milliseconds(400));
  (*cluster)->decode_process().Kill();
  flight.Join();
  // The prefill ends with the lost peer (well before the 20 s hold or the 30 s lease).
  EXPECT_EQ(flight.prefill_status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << flight.prefill_status.error_message();
  // Marked as the transfer's failure, so the router counts it against the decode worker.
  EXPECT_EQ(flight.prefill_status.error_details(), worker::kTransferPeerFailed);
  grpc::ClientContext c;
  v1::StatsResponse stats;
  ASSERT_TRUE((*cluster)->prefill().Stats(&c, v1::StatsRequest(), &stats).ok());
  EXPECT_EQ(stats.running_requests(), 0);
  EXPECT_EQ(stats.waiting_requests(), 0);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
}

// The decode worker stalls (SIGSTOP: a stopped or starved process) while a transfer is under
// way and resumes after the lease: the pages and the commit then land and verify in the same sweep
// that reaches the lease. The request may decode (its state verified) or fail, but its pages must
// come back; they used to be lost until the process restarted (the receiver forgot the verified
// ticket unread, and the worker freed nothing on NotFound).
TEST(PdFaultTest, DecodeStalledPastTheLeaseLosesNoPages) {
  ClusterOptions options;
  options.lease_ms = 2000;
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // A first request connects the prefill worker's endpoint, so that the stalled request's pages
  // go into the socket at once (a new endpoint would wait for the stopped peer's handshake).
  const RequestSpec warm = Spec(730000, 40, 3);
  const Outcome alone = (*cluster)->Run(warm);
  ASSERT_TRUE(alone.error.empty()) << alone.error;
  const RequestSpec spec = Spec(730001, 40, 3);
  v1::ReserveResponse reserved;
  ASSERT_TRUE(ReserveOnDecode(**cluster, spec, &reserved).ok());
  const pid_t decode_pid = (*cluster)->decode_process().pid();
  ASSERT_EQ(kill(decode_pid, SIGSTOP), 0);
  grpc::Status prefill_status;
  std::thread prefill([&] {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::PrefillResponse response;
    prefill_status =
        (*cluster)->prefill().Prefill(&c, PrefillFor(spec, reserved.ticket()), &response);
  });
  absl::SleepFor(absl::Milliseconds(3500));  // past the 2 s lease while stopped
  ASSERT_EQ(kill(decode_pid, SIGCONT), 0);
  prefill.join();
  const Outcome outcome = GenerateOutcome(**cluster, spec.request_id, reserved.ticket(), 20);
  std::cout << "prefill: " << prefill_status.error_message() << " (code "
            << prefill_status.error_code() << "); generate: " << outcome.tokens.size()
            << " tokens, finish " << outcome.finish_reason << " " << outcome.error << "\n";
  const v1::StatsResponse stats = AwaitAllPagesFree(**cluster, absl::Seconds(10));
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.running_requests(), 0);
}

TEST(PdFaultTest, CancelledGenerateAbortsTheRequestOnDecode) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(730001, 40, 3);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved).ok());
  }
  EXPECT_EQ(DecodeStats(**cluster).waiting_requests(), 1);
  EXPECT_EQ(CancelGenerateAfter(**cluster, reserved.ticket(), absl::Milliseconds(200)),
            grpc::StatusCode::CANCELLED);
  // The request is aborted: no longer waiting; its pages wait behind the fence (no prefill
  // worker ever wrote them, so the lease frees them).
  v1::StatsResponse stats;
  const absl::Time until = absl::Now() + absl::Seconds(5);
  do {
    absl::SleepFor(absl::Milliseconds(50));
    stats = DecodeStats(**cluster);
  } while (stats.waiting_requests() != 0 && absl::Now() < until);
  EXPECT_EQ(stats.waiting_requests(), 0);
  EXPECT_GT(stats.pages_quarantined(), 0);
}

// Sampling that can never produce a token on the 4096-token bundled model.
serving::SamplingParams EveryTokenMasked(serving::SamplingParams params) {
  params.stop_token_ids.clear();
  for (int32_t id = 0; id < 4096; ++id) params.stop_token_ids.push_back(id);
  params.min_tokens = params.max_tokens;
  return params;
}

TEST(PdFaultTest, ReserveRejectsSamplingThatCanNeverProduceAToken) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RequestSpec spec = Spec(740001, 30, 1);
  spec.params = EveryTokenMasked(spec.params);
  grpc::ClientContext c;
  v1::ReserveResponse reserved;
  const grpc::Status status = (*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "every token is masked"))
      << status.error_message();
  const v1::StatsResponse stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
}

// The prefill worker fails after connecting (its sampling masks every token): its fence ends the
// request on decode at once, as an error that is not an isolation failure, and frees the pages.
TEST(PdFaultTest, PrefillFailureAfterConnectEndsDecodeRequestAtOnceWithoutIsolationError) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(740002, 100, 1);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved).ok());
  }
  const absl::Time start = absl::Now();
  RequestSpec rejected = spec;
  rejected.params = EveryTokenMasked(spec.params);
  grpc::Status prefill_status;
  std::thread prefill([&] {
    grpc::ClientContext c;
    v1::PrefillResponse response;
    prefill_status =
        (*cluster)->prefill().Prefill(&c, PrefillFor(rejected, reserved.ticket()), &response);
  });
  const Outcome outcome = GenerateOutcome(**cluster, spec.request_id, reserved.ticket(), 60);
  prefill.join();
  EXPECT_EQ(prefill_status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << prefill_status.error_message();
  EXPECT_EQ(outcome.finish_reason, "error");
  EXPECT_EQ(outcome.isolation_error, v1::ISOLATION_ERROR_UNSPECIFIED) << outcome.error;
  EXPECT_TRUE(absl::StrContains(outcome.error, "prefill worker abandoned the transfer"))
      << outcome.error;
  EXPECT_TRUE(outcome.tokens.empty());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));  // the lease is 30 s
  const v1::StatsResponse stats = AwaitAllPagesFree(**cluster, absl::Seconds(5));
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.pages_quarantined(), 0);
  for (int kind = 0; kind < stats.isolation_errors_size(); ++kind) {
    EXPECT_EQ(stats.isolation_errors(kind), 0) << "kind " << kind;
  }
}

// Reserve then Abort, many times over on a worker that holds two requests: with prefill_quiesced
// (the router's word that the prefill worker never wrote or will write) the pages are free at
// once and never block --max-batch; without it they wait for the fence or the lease.
TEST(PdFaultTest, AbortWithPrefillQuiescedFreesPagesAtOnce) {
  ClusterOptions options;
  options.decode_max_batch = 2;
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (uint64_t id = 750001; id < 750011; ++id) {
    grpc::ClientContext c;
    v1::ReserveResponse reserved;
    const grpc::Status status =
        (*cluster)->decode().Reserve(&c, ReserveFor(Spec(id, 80, 1)), &reserved);
    ASSERT_TRUE(status.ok()) << "request " << id << ": " << status.error_message();
    EXPECT_TRUE(AbortOnDecode(**cluster, id, /*prefill_quiesced=*/true).quiesced())
        << "request " << id;
  }
  v1::StatsResponse stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.pages_quarantined(), 0);
  // Without the prefill worker's word the pages stay behind the fence (the 30 s lease here).
  {
    grpc::ClientContext c;
    v1::ReserveResponse reserved;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(Spec(750100, 80, 1)), &reserved).ok());
  }
  EXPECT_FALSE(AbortOnDecode(**cluster, 750100, /*prefill_quiesced=*/false).quiesced());
  EXPECT_GT(DecodeStats(**cluster).pages_quarantined(), 0);
  // A later Abort with the prefill worker's word frees them.
  EXPECT_TRUE(AbortOnDecode(**cluster, 750100, /*prefill_quiesced=*/true).quiesced());
  stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.pages_quarantined(), 0);
}

// A Prefill whose max_tokens differs from what Reserve reserved fails FAILED_PRECONDITION before
// it writes anything.
TEST(PdFaultTest, PrefillWithOtherMaxTokensThanReservedIsFailedPrecondition) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(780001, 50, 1);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved).ok());
  }
  EXPECT_EQ(reserved.ticket().reserved_prompt_tokens(), 50);
  EXPECT_EQ(reserved.ticket().reserved_max_tokens(), 6);
  RequestSpec other = spec;
  other.params.max_tokens = 7;
  grpc::ClientContext c;
  v1::PrefillResponse response;
  const grpc::Status status =
      (*cluster)->prefill().Prefill(&c, PrefillFor(other, reserved.ticket()), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "Reserve reserved 50 and 6"))
      << status.error_message();
}

// Both workers state the model identity of the bundled model in Health; the decode worker's
// tickets carry its fingerprint, and a ticket stating another (a decode worker on other weights)
// is refused before anything is written, marked as a ticket mismatch for the router's canary.
TEST(PdFaultTest, WorkersStateTheModelIdentityAndRefuseATicketOfAnotherModel) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const absl::StatusOr<uint64_t> fingerprint = common::ModelFingerprint(PDSERVE_BUNDLED_MODEL);
  ASSERT_TRUE(fingerprint.ok()) << fingerprint.status();
  v1::HealthResponse prefill_health, decode_health;
  {
    grpc::ClientContext c1, c2;
    ASSERT_TRUE((*cluster)->prefill().Health(&c1, v1::HealthRequest(), &prefill_health).ok());
    ASSERT_TRUE((*cluster)->decode().Health(&c2, v1::HealthRequest(), &decode_health).ok());
  }
  EXPECT_EQ(prefill_health.model_fingerprint(), *fingerprint);
  EXPECT_EQ(decode_health.model_fingerprint(), *fingerprint);
  EXPECT_TRUE(absl::StartsWith(decode_health.page_geometry(), "layers="))
      << decode_health.page_geometry();
  EXPECT_EQ(prefill_health.page_geometry(), decode_health.page_geometry());
  const RequestSpec spec = Spec(780101, 20, 2);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved).ok());
  }
  EXPECT_EQ(reserved.ticket().model_fingerprint(), *fingerprint);
  EXPECT_EQ(reserved.ticket().ucx_protocols(), v1::UCX_PROTOCOLS_V1);
  v1::TransferTicket foreign = reserved.ticket();
  foreign.set_model_fingerprint(*fingerprint ^ 1);
  grpc::ClientContext c;
  v1::PrefillResponse response;
  const grpc::Status status =
      (*cluster)->prefill().Prefill(&c, PrefillFor(spec, foreign), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_EQ(status.error_details(), worker::kTicketMismatch);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model fingerprint"))
      << status.error_message();
}

// The decode worker's tickets state its UCX protocols (transfer.ucx_protocols: v2 here); a
// prefill worker on the other implementation (UCX_PROTO_ENABLE=n wins over the config) refuses
// the pair before it connects, marked as a ticket mismatch for the router, and nothing is sent.
TEST(PdFaultTest, PrefillRefusesADecodeWorkerOfOtherUcxProtocols) {
  ClusterOptions options;
  options.ucx_protocols = "v2";
  options.prefill_env = {"UCX_PROTO_ENABLE=n"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(780201, 20, 2);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved).ok());
  }
  EXPECT_EQ(reserved.ticket().ucx_protocols(), v1::UCX_PROTOCOLS_V2);
  grpc::ClientContext c;
  v1::PrefillResponse response;
  const grpc::Status status =
      (*cluster)->prefill().Prefill(&c, PrefillFor(spec, reserved.ticket()), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_EQ(status.error_details(), worker::kTicketMismatch);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "UCX protocols v2, this worker v1"))
      << status.error_message();
}

// Abort of a prefill waiting behind a running one answers at once (quiesced) and the waiting
// request never starts; the running one is unaffected.
TEST(PdFaultTest, AbortOfQueuedPrefillAnswersAtOnceAndItNeverStarts) {
  ClusterOptions options;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=790001", "PDSERVE_TEST_DELAY_MS=3000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight running;
  StartInFlight(**cluster, Spec(790001, 100, 1), &running);
  absl::SleepFor(absl::Milliseconds(300));
  InFlight queued;
  StartInFlight(**cluster, Spec(790002, 60, 1), &queued);
  absl::SleepFor(absl::Milliseconds(300));
  {
    grpc::ClientContext c;
    v1::StatsResponse stats;
    ASSERT_TRUE((*cluster)->prefill().Stats(&c, v1::StatsRequest(), &stats).ok());
    EXPECT_EQ(stats.running_requests(), 1);
    EXPECT_EQ(stats.waiting_requests(), 1);
  }
  const absl::Time start = absl::Now();
  {
    grpc::ClientContext c;
    v1::AbortRequest abort;
    abort.set_request_id(790002);
    v1::AbortResponse response;
    ASSERT_TRUE((*cluster)->prefill().Abort(&c, abort, &response).ok());
    EXPECT_TRUE(response.quiesced());
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // the running prefill holds 3 s
  if (queued.prefill.joinable()) queued.prefill.join();
  EXPECT_EQ(queued.prefill_status.error_code(), grpc::StatusCode::CANCELLED)
      << queued.prefill_status.error_message();
  EXPECT_TRUE(AbortOnDecode(**cluster, 790002, /*prefill_quiesced=*/true).quiesced());
  running.Join();
  queued.Join();
  EXPECT_TRUE(running.prefill_status.ok()) << running.prefill_status.error_message();
  EXPECT_EQ(running.outcome.finish_reason, "length");
  EXPECT_EQ(queued.outcome.finish_reason, "abort");
}

// A prefill queue at --max-waiting refuses the next Prefill with RESOURCE_EXHAUSTED at once (the
// router's 429), so queued requests never sit past their decode leases; the others still finish.
TEST(PdFaultTest, PrefillQueueAtMaxWaitingRefusesWithResourceExhausted) {
  ClusterOptions options;
  options.prefill_max_waiting = 1;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=791001", "PDSERVE_TEST_DELAY_MS=2000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight running;
  StartInFlight(**cluster, Spec(791001, 100, 1), &running);
  absl::SleepFor(absl::Milliseconds(300));
  InFlight queued;
  StartInFlight(**cluster, Spec(791002, 60, 1), &queued);
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  InFlight refused;
  StartInFlight(**cluster, Spec(791003, 60, 1), &refused);
  if (refused.prefill.joinable()) refused.prefill.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));  // the running prefill holds 2 s
  EXPECT_EQ(refused.prefill_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.prefill_status.error_message();
  EXPECT_TRUE(AbortOnDecode(**cluster, 791003, /*prefill_quiesced=*/true).quiesced());
  running.Join();
  queued.Join();
  refused.Join();
  EXPECT_EQ(running.outcome.finish_reason, "length");
  EXPECT_EQ(queued.outcome.finish_reason, "length");
  EXPECT_EQ(refused.outcome.finish_reason, "abort");
}

// A request whose transfer lease would end while it waits in the prefill queue (nothing renews
// the lease before its transfer starts) is refused with RESOURCE_EXHAUSTED a margin before the
// lease ends: the worker is busy, not broken, and the decode worker hears of it as an abort
// instead of counting a lease isolation error (before: every queued request past the lease
// failed as an isolation error, the router opened the prefill worker's breaker and answered 503
// "no prefill worker is up"; found by the breaker with 16 long prompts on a 2 s lease).
TEST(PdFaultTest, QueuedPrefillGivesUpBeforeItsLeaseEnds) {
  ClusterOptions options;
  options.lease_ms = 2000;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=792001", "PDSERVE_TEST_DELAY_MS=3000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight running;  // holds the prefill worker for 3 s (its heartbeats renew its own lease)
  StartInFlight(**cluster, Spec(792001, 100, 1), &running);
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time start = absl::Now();
  InFlight queued;
  StartInFlight(**cluster, Spec(792002, 60, 1), &queued);
  if (queued.prefill.joinable()) queued.prefill.join();
  const absl::Duration waited = absl::Now() - start;
  EXPECT_EQ(queued.prefill_status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << queued.prefill_status.error_message();
  EXPECT_TRUE(absl::StrContains(queued.prefill_status.error_message(), "prefill queue"))
      << queued.prefill_status.error_message();
  EXPECT_GT(waited, absl::Milliseconds(700)) << "it waited its turn first";
  EXPECT_LT(waited, absl::Milliseconds(2000)) << "and gave up before the lease ended";
  EXPECT_TRUE(AbortOnDecode(**cluster, 792002, /*prefill_quiesced=*/true).quiesced());
  running.Join();
  queued.Join();
  EXPECT_EQ(running.outcome.finish_reason, "length") << running.outcome.error;
  EXPECT_EQ(queued.outcome.finish_reason, "abort") << queued.outcome.error;
  EXPECT_EQ(queued.outcome.isolation_error, v1::ISOLATION_ERROR_UNSPECIFIED);
}

// A full pool's RESOURCE_EXHAUSTED names the request id (not the worker's internal sequence).
TEST(PdFaultTest, ReserveOnAFullPoolNamesTheRequestId) {
  ClusterOptions options;
  options.decode_pool_tokens = 256;  // a few 500-token requests
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  grpc::Status status;
  uint64_t id = 800000;
  while (status.ok() && id < 800060) {
    grpc::ClientContext c;
    v1::ReserveResponse reserved;
    status = (*cluster)->decode().Reserve(&c, ReserveFor(Spec(++id, 500, 1)), &reserved);
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_TRUE(absl::StartsWith(status.error_message(),
                               absl::StrCat("request ", id, " (prompt 500 + max_tokens 6")))
      << status.error_message();
  EXPECT_FALSE(absl::StrContains(status.error_message(), absl::StrCat("request ", id - 800000)))
      << status.error_message();
}

// Every decode page free, none quarantined, within 5 s of `start` (the lease is 30 s), and no
// isolation error counted.
void ExpectPagesBackWellBeforeTheLease(PdCluster& cluster, absl::Time start) {
  const v1::StatsResponse stats = AwaitAllPagesFree(cluster, absl::Seconds(5));
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.pages_quarantined(), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  for (int kind = 0; kind < stats.isolation_errors_size(); ++kind) {
    EXPECT_EQ(stats.isolation_errors(kind), 0) << "kind " << kind;
  }
}

// Starts a cluster (transfer.shm_pull as given), reserves request `id` on the decode worker and
// cancels its Generate, so that the decode worker alone hears of the abort, then prefills the
// request: `prefill` is the Prefill's status. Checks the pages came back well before the lease.
void PrefillAfterACancelledGenerate(bool shm_pull, uint64_t id, grpc::Status* prefill) {
  ClusterOptions options;
  options.shm_pull = shm_pull;
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(id, 40, 3);
  v1::ReserveResponse reserved;
  ASSERT_TRUE(ReserveOnDecode(**cluster, spec, &reserved).ok());
  EXPECT_EQ(CancelGenerateAfter(**cluster, reserved.ticket(), absl::Milliseconds(200)),
            grpc::StatusCode::CANCELLED);
  ASSERT_GT(AwaitAllPagesFree(**cluster, absl::Milliseconds(300)).pages_quarantined(), 0)
      << "the aborted request's pages wait behind the fence";
  const absl::Time start = absl::Now();
  grpc::ClientContext c;
  v1::PrefillResponse response;
  *prefill = (*cluster)->prefill().Prefill(&c, PrefillFor(spec, reserved.ticket()), &response);
  ExpectPagesBackWellBeforeTheLease(**cluster, start);
}

// Active messages: the prefill worker commits normally; the commit, sent once every page send
// completed, is the sender's word that no write is in flight, so the pages come back at once
// instead of at the 30 s lease.
TEST(PdFaultTest, CommitAfterACancelledGenerateFreesThePagesAtOnce) {
  grpc::Status status;
  PrefillAfterACancelledGenerate(/*shm_pull=*/false, 740001, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();  // the prefill side committed normally
}

// Pages pulled from the prefill worker's shared memory (transfer.shm_pull, the default): the
// decode worker refuses the aborted ticket's page references unread, so the prefill ends with
// CANCELLED (as an active-message page refused by rendezvous does) instead of committing, and its
// fence, sent once every page send completed, frees the pages at once too.
TEST(PdFaultTest, PulledPagesOfACancelledGenerateAreRefusedAndFreedAtOnce) {
  grpc::Status status;
  PrefillAfterACancelledGenerate(/*shm_pull=*/true, 740002, &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "refused the page"))
      << status.error_message();
  // The decode worker's doing, not a cancellation the prefill worker was asked for: marked, so
  // the router counts it against the decode worker (router/request.h RefusedByDrainAsDown).
  EXPECT_EQ(status.error_details(), worker::kTransferPeerFailed);
}

// An Abort that overtakes its Reserve (the router aborts a choice whose Reserve is still on the
// wire) is remembered: the Reserve is refused and allocates nothing.
TEST(PdFaultTest, AbortBeforeReserveRefusesTheReserve) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_TRUE(AbortOnDecode(**cluster, 760001, /*prefill_quiesced=*/true).quiesced());
  const grpc::Status status = ReserveOnDecode(**cluster, Spec(760001, 80, 1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED) << status.error_message();
  EXPECT_EQ(status.error_message(), "request 760001 was aborted before it was reserved");
  const v1::StatsResponse stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
  EXPECT_EQ(stats.waiting_requests(), 0);
}

// Aborts racing their Reserves (as when the router fails a wide fan-out while Reserves are in
// flight): whichever comes first, no ticket reached a prefill worker, so no page stays fenced.
TEST(PdFaultTest, AbortsRacingReservesLeaveNoPageFenced) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  std::vector<std::thread> threads;
  for (uint64_t id = 770001; id <= 770064; ++id) {
    threads.emplace_back([&cluster, id] {
      const grpc::Status status = ReserveOnDecode(**cluster, Spec(id, 80, 1));
      EXPECT_TRUE(status.ok() || status.error_code() == grpc::StatusCode::ABORTED)
          << status.error_message();
    });
    threads.emplace_back(
        [&cluster, id] { AbortOnDecode(**cluster, id, /*prefill_quiesced=*/true); });
  }
  for (std::thread& t : threads) t.join();
  const v1::StatsResponse stats = AwaitAllPagesFree(**cluster, absl::Seconds(2));
  EXPECT_EQ(stats.pages_free(), stats.pages_total());  // the lease is 30 s
  EXPECT_EQ(stats.pages_quarantined(), 0);
  EXPECT_EQ(stats.waiting_requests(), 0);
}

// RESOURCE_EXHAUSTED says what ran out: batch slots (requests that may still decode), or state
// pages (an aborted request behind its fence holds pages, not a batch slot).
TEST(PdFaultTest, FullDecodeWorkerSaysWhetherBatchSlotsOrPagesRanOut) {
  ClusterOptions options;
  options.decode_max_batch = 2;
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (uint64_t id : {810001, 810002}) {
    ASSERT_TRUE(ReserveOnDecode(**cluster, Spec(id, 80, 1)).ok());
  }
  grpc::Status status = ReserveOnDecode(**cluster, Spec(810003, 80, 1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(status.error_message(),
            "no free batch slot: 2 requests are receiving or decoding (max_batch 2)");
  // Aborted without the prefill worker's word: its pages stay behind the fence (30 s lease).
  EXPECT_FALSE(AbortOnDecode(**cluster, 810001, /*prefill_quiesced=*/false).quiesced());
  status = ReserveOnDecode(**cluster, Spec(810004, 80, 1));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(absl::StartsWith(status.error_message(),
                               "request 810004 (prompt 80 + max_tokens 6 tokens): out of state "
                               "pages: needs "))
      << status.error_message();
  const int64_t fenced = DecodeStats(**cluster).pages_quarantined();
  EXPECT_GT(fenced, 0);
  EXPECT_TRUE(absl::EndsWith(status.error_message(),
                             absl::StrCat(" (", fenced,
                                          " pages are held by aborted or failed requests until "
                                          "their fence or lease)")))
      << status.error_message();
}

// The exit status of `pid` once it exits, without reaping it (PeerProcess reaps).
int ExitStatusAfterSigterm(pid_t pid) {
  kill(pid, SIGTERM);
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) != 0) return -1;
  return info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
}

TEST(PdProcessTest, WorkersReportHealthAndExitZeroOnSigterm) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  {
    grpc::ClientContext c;
    v1::HealthResponse health;
    ASSERT_TRUE((*cluster)->prefill().Health(&c, v1::HealthRequest(), &health).ok());
    EXPECT_EQ(health.state(), v1::HealthResponse::STATE_SERVING);
    EXPECT_EQ(health.role(), "prefill");
    EXPECT_EQ(health.model(), "kjv-v4-tiny");
  }
  {
    grpc::ClientContext c;
    v1::HealthResponse health;
    ASSERT_TRUE((*cluster)->decode().Health(&c, v1::HealthRequest(), &health).ok());
    EXPECT_EQ(health.state(), v1::HealthResponse::STATE_SERVING);
    EXPECT_EQ(health.role(), "decode");
    EXPECT_NE(health.incarnation(), 0u);
  }
  EXPECT_EQ(ExitStatusAfterSigterm((*cluster)->prefill_process().pid()), 0);
  EXPECT_EQ(ExitStatusAfterSigterm((*cluster)->decode_process().pid()), 0);
}

// Health of the decode worker (STATE_UNSPECIFIED when the call fails).
v1::HealthResponse::State DecodeHealth(PdCluster& cluster) {
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  v1::HealthResponse health;
  if (!cluster.decode().Health(&c, v1::HealthRequest(), &health).ok()) {
    return v1::HealthResponse::STATE_UNSPECIFIED;
  }
  return health.state();
}

// The exit status of `pid` once it exits (without reaping it).
int ExitStatus(pid_t pid) {
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) != 0) return -1;
  return info.si_code == CLD_EXITED ? info.si_status : 128 + info.si_status;
}

// SIGTERM drains: the worker stops listening at once (a new call finds the port closed: Health
// fails, Reserve is UNAVAILABLE), and the running request finishes normally on its open
// connection (its transfer is held 1.5 s past the signal) before the worker exits 0.
TEST(PdProcessTest, SigtermDrainsRunningRequestsThenExitsZero) {
  ClusterOptions options;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=760001", "PDSERVE_TEST_DELAY_MS=1500"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(760001, 100, 4);
  InFlight flight;
  StartInFlight(**cluster, spec, &flight);
  absl::SleepFor(absl::Milliseconds(300));
  const pid_t decode_pid = (*cluster)->decode_process().pid();
  ASSERT_EQ(kill(decode_pid, SIGTERM), 0);
  v1::HealthResponse::State state = v1::HealthResponse::STATE_SERVING;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (state == v1::HealthResponse::STATE_SERVING && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
    state = DecodeHealth(**cluster);
  }
  EXPECT_EQ(state, v1::HealthResponse::STATE_UNSPECIFIED);  // the call failed
  {
    grpc::ClientContext c;
    v1::ReserveResponse reserved;
    const grpc::Status status =
        (*cluster)->decode().Reserve(&c, ReserveFor(Spec(760002, 20, 1)), &reserved);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }
  flight.Join();
  EXPECT_TRUE(flight.prefill_status.ok()) << flight.prefill_status.error_message();
  EXPECT_TRUE(flight.outcome.error.empty()) << flight.outcome.error;
  EXPECT_EQ(flight.outcome.finish_reason, "length");
  EXPECT_EQ(flight.outcome.tokens.size(), 6u);
  EXPECT_EQ(ExitStatus(decode_pid), 0);
  EXPECT_EQ(ExitStatusAfterSigterm((*cluster)->prefill_process().pid()), 0);
}

// A request still open when the drain timeout passes ends with a final "abort" event naming the
// shutdown, never a cut stream.
TEST(PdProcessTest, DrainTimeoutEndsOpenStreamsWithFinalAbortEvent) {
  ClusterOptions options;
  options.drain_timeout_ms = 300;
  options.prefill_env = {"PDSERVE_TEST_DELAY_REQUEST=all", "PDSERVE_TEST_DELAY_MS=20000"};
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  InFlight flight;
  StartInFlight(**cluster, Spec(770001, 100, 1), &flight);
  absl::SleepFor(absl::Milliseconds(300));
  const pid_t decode_pid = (*cluster)->decode_process().pid();
  const absl::Time signalled = absl::Now();
  ASSERT_EQ(kill(decode_pid, SIGTERM), 0);
  if (flight.generate.joinable()) flight.generate.join();
  EXPECT_EQ(flight.outcome.finish_reason, "abort");
  EXPECT_EQ(flight.outcome.isolation_error, v1::ISOLATION_ERROR_UNSPECIFIED);
  EXPECT_TRUE(absl::StrContains(flight.outcome.error, "worker shutting down"))
      << flight.outcome.error;
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(10));
  EXPECT_EQ(ExitStatus(decode_pid), 0);
  EXPECT_EQ(ExitStatusAfterSigterm((*cluster)->prefill_process().pid()), 0);
  flight.Join();
}

}  // namespace
}  // namespace pdserve::pd::testing
