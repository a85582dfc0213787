// Shared prefill for n > 1 (docs/protocol.md, "Shared prefill"), with real `pdserve prefill` and
// `pdserve decode` processes: one Reserve with choice_count n, one Prefill, n Generate streams
// (worker request id + k). The decode worker forks only verified state: every fork equals its
// choice run colocated (paranoid ownership checks on), each fork's pages are its own and go back
// when it ends, is aborted, or the transfer fails; a corrupted transfer fails every fork loudly
// and none decodes.
#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/pd/pd_cluster.h"

namespace pdserve::pd::testing {
namespace {

namespace v1 = pdserve::worker::v1;

RequestSpec Spec(uint64_t id, int length) {
  RequestSpec s;
  s.request_id = id;
  for (int t = 0; t < length; ++t) s.prompt.push_back(2 + (t * 53 + static_cast<int>(id)) % 4000);
  s.params.temperature = 0.6;
  s.params.top_p = 0.95;
  s.params.seed = 29;
  s.params.max_tokens = 6;
  return s;
}

// The router's flow for a shared reservation of `n` choices: one Reserve, one Prefill, n Generate
// streams. `reserved_ok` false: Reserve's error in outcomes[0].error. `abort_fork` >= 0: that
// fork's stream is cancelled after its first token.
std::vector<Outcome> RunShared(PdCluster& cluster, const RequestSpec& spec, int n,
                               v1::PrefillResponse* prefilled_out = nullptr) {
  std::vector<Outcome> outcomes(static_cast<size_t>(n));
  v1::ReserveRequest reserve = ReserveFor(spec);
  reserve.mutable_sampling()->set_choice_count(static_cast<uint32_t>(n));
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext context;
    const grpc::Status status = cluster.decode().Reserve(&context, reserve, &reserved);
    if (!status.ok()) {
      outcomes[0].error = "Reserve: " + status.error_message();
      return outcomes;
    }
  }
  v1::PrefillResponse prefilled;
  grpc::Status prefill_status;
  std::thread prefill([&] {
    grpc::ClientContext context;
    v1::PrefillRequest request = PrefillFor(spec, reserved.ticket());
    request.mutable_sampling()->set_choice_count(static_cast<uint32_t>(n));
    prefill_status = cluster.prefill().Prefill(&context, request, &prefilled);
  });
  std::vector<std::thread> streams;
  for (int k = 0; k < n; ++k) {
    streams.emplace_back([&, k] {
      grpc::ClientContext context;
      v1::GenerateRequest generate;
      generate.set_request_id(spec.request_id + static_cast<uint64_t>(k));
      generate.set_ticket_id(reserved.ticket().ticket_id());
      auto reader = cluster.decode().Generate(&context, generate);
      ReadGenerate(*reader, &outcomes[static_cast<size_t>(k)]);
    });
  }
  for (std::thread& t : streams) t.join();
  prefill.join();
  for (Outcome& o : outcomes) {
    o.prefill_status = prefill_status.ok() ? "OK" : prefill_status.error_message();
  }
  if (prefilled_out != nullptr) *prefilled_out = prefilled;
  return outcomes;
}

TEST(PdForkTest, ForksEqualTheirChoicesColocatedAndGiveBackEveryPage) {
  ClusterOptions options;
  options.guards_yaml = "guards:\n  paranoid: true\n";
  auto cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int n = 6;
  const RequestSpec spec = Spec(810000, 40);
  v1::PrefillResponse prefilled;
  const std::vector<Outcome> forks = RunShared(**cluster, spec, n, &prefilled);
  std::vector<RequestSpec> colocated_specs;
  for (int c = 0; c < n; ++c) {
    RequestSpec s = spec;
    s.choice = c;
    colocated_specs.push_back(s);
  }
  const std::vector<Outcome> colocated = RunColocated(colocated_specs);
  std::set<std::vector<int32_t>> distinct;
  for (int c = 0; c < n; ++c) {
    const Outcome& fork = forks[static_cast<size_t>(c)];
    EXPECT_EQ(fork.error, "") << "fork " << c;
    EXPECT_EQ(fork.tokens, colocated[static_cast<size_t>(c)].tokens) << "fork " << c;
    EXPECT_EQ(fork.finish_reason, colocated[static_cast<size_t>(c)].finish_reason);
    distinct.insert(fork.tokens);
  }
  EXPECT_GT(distinct.size(), 1u);  // each fork drew from its own stream
  // One prefill: the response carries every choice's first token.
  ASSERT_EQ(prefilled.more_first_tokens_size(), n - 1);
  ASSERT_EQ(prefilled.commit().more_first_tokens_size(), n - 1);
  for (int c = 1; c < n; ++c) {
    EXPECT_EQ(prefilled.more_first_tokens(c - 1).token_id(),
              colocated[static_cast<size_t>(c)].tokens[0]);
  }
  EXPECT_TRUE(AwaitAllPagesFree(**cluster, absl::Seconds(10)).pages_free() ==
              DecodeStats(**cluster).pages_total());
}

// Every fork's pages come from the pool (one batch slot and one page table each): a reservation
// of n holds n times one choice's pages until its forks end; aborting it as a whole (the
// router's Abort with choice_count) frees them all.
TEST(PdForkTest, EachForkHoldsItsOwnPagesAndAnAbortOfAllFreesThem) {
  auto cluster = PdCluster::Start({});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const RequestSpec spec = Spec(820000, 30);
  const v1::StatsResponse idle = DecodeStats(**cluster);
  v1::ReserveResponse one;
  {
    grpc::ClientContext context;
    ASSERT_TRUE((*cluster)->decode().Reserve(&context, ReserveFor(spec), &one).ok());
  }
  const int64_t per_choice = idle.pages_free() - DecodeStats(**cluster).pages_free();
  ASSERT_GT(per_choice, 0);
  {
    grpc::ClientContext context;
    v1::AbortRequest abort;
    abort.set_request_id(spec.request_id);
    abort.set_prefill_quiesced(true);
    v1::AbortResponse aborted;
    ASSERT_TRUE((*cluster)->decode().Abort(&context, abort, &aborted).ok());
  }
  ASSERT_TRUE(AwaitAllPagesFree(**cluster, absl::Seconds(10)).pages_free() ==
              DecodeStats(**cluster).pages_total());
  RequestSpec shared = spec;
  shared.request_id = 820100;
  v1::ReserveRequest reserve = ReserveFor(shared);
  reserve.mutable_sampling()->set_choice_count(4);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext context;
    ASSERT_TRUE((*cluster)->decode().Reserve(&context, reserve, &reserved).ok());
  }
  EXPECT_EQ(idle.pages_free() - DecodeStats(**cluster).pages_free(), 4 * per_choice);
  EXPECT_EQ(DecodeStats(**cluster).waiting_requests(), 4);
  grpc::ClientContext context;
  v1::AbortRequest abort;
  abort.set_request_id(shared.request_id);
  abort.set_prefill_quiesced(true);
  abort.set_choice_count(4);
  v1::AbortResponse aborted;
  ASSERT_TRUE((*cluster)->decode().Abort(&context, abort, &aborted).ok());
  EXPECT_TRUE(AwaitAllPagesFree(**cluster, absl::Seconds(10)).pages_free() ==
              DecodeStats(**cluster).pages_total());
}

// More choices than the worker's batch slots can never fit: FAILED_PRECONDITION naming n, and
// nothing is allocated.
TEST(PdForkTest, MoreForksThanBatchSlotsIsRefusedNamingN) {
  ClusterOptions options;
  options.decode_max_batch = 4;
  auto cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  v1::ReserveRequest reserve = ReserveFor(Spec(830000, 20));
  reserve.mutable_sampling()->set_choice_count(5);
  v1::ReserveResponse reserved;
  grpc::ClientContext context;
  const grpc::Status refused = (*cluster)->decode().Reserve(&context, reserve, &reserved);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("n = 5 choices"), std::string::npos)
      << refused.error_message();
  const v1::StatsResponse stats = DecodeStats(**cluster);
  EXPECT_EQ(stats.pages_free(), stats.pages_total());
}

// A corrupted page in the shared transfer: every fork ends with the isolation error and no
// token (nothing is forked from unverified state), and every page goes back.
TEST(PdForkTest, CorruptedTransferFailsEveryForkAndForksNothing) {
  ClusterOptions options;
  options.prefill_env = {"PDSERVE_TEST_CORRUPT_REQUEST=840000"};
  options.lease_ms = 3000;  // fork 0's quarantined pages go back at the lease end
  auto cluster = PdCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::vector<Outcome> forks = RunShared(**cluster, Spec(840000, 30), 4);
  for (size_t k = 0; k < forks.size(); ++k) {
    EXPECT_TRUE(forks[k].tokens.empty()) << "fork " << k;
    EXPECT_EQ(forks[k].finish_reason, "error") << "fork " << k;
    EXPECT_EQ(forks[k].isolation_error, v1::ISOLATION_ERROR_CHECKSUM)
        << "fork " << k << ": " << forks[k].error;
  }
  // The forks' pages go back at once; fork 0's once its quarantine ends.
  EXPECT_TRUE(AwaitAllPagesFree(**cluster, absl::Seconds(15)).pages_free() ==
              DecodeStats(**cluster).pages_total());
}

}  // namespace
}  // namespace pdserve::pd::testing
