// Untrusted text on the worker RPCs with real processes: a Reserve or a Prefill whose sampling
// carries a schema or a tool-call grammar 100000 JSON levels deep (a breaker's, 2026-12-04, sent
// straight to the workers) is INVALID_ARGUMENT, and both workers go on serving.
#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "tests/pd/pd_cluster.h"

namespace pdserve::pd::testing {
namespace {

namespace v1 = pdserve::worker::v1;

RequestSpec Spec(uint64_t id) {
  RequestSpec s;
  s.request_id = id;
  for (int t = 0; t < 20; ++t) s.prompt.push_back(2 + (t * 37 + static_cast<int>(id)) % 4000);
  s.params.temperature = 0.6;
  s.params.seed = 1;
  s.params.max_tokens = 4;
  return s;
}

const std::string& Deep() {
  static const std::string* deep = new std::string(R"({"a":)" + std::string(100000, '[') +
                                                   std::string(100000, ']') + R"(,"b":1,"c":2})");
  return *deep;
}

TEST(PdUntrustedInputTest, DeepSchemaOrGrammarTextIsInvalidArgumentOnBothWorkers) {
  absl::StatusOr<std::unique_ptr<PdCluster>> cluster = PdCluster::Start(ClusterOptions{});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  RequestSpec schema = Spec(790001);
  schema.params.json_schema = Deep();
  RequestSpec grammar = Spec(790002);
  grammar.params.tool_call_grammar = Deep();
  for (const RequestSpec& spec : {schema, grammar}) {
    grpc::ClientContext c;
    v1::ReserveResponse reserved;
    const grpc::Status status = (*cluster)->decode().Reserve(&c, ReserveFor(spec), &reserved);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "nests deeper than 256 JSON levels"))
        << status.error_message();
  }
  // Prefill with a ticket from a plain Reserve, then the deep sampling.
  const RequestSpec plain = Spec(790003);
  v1::ReserveResponse reserved;
  {
    grpc::ClientContext c;
    ASSERT_TRUE((*cluster)->decode().Reserve(&c, ReserveFor(plain), &reserved).ok());
  }
  for (RequestSpec spec : {schema, grammar}) {
    spec.request_id = plain.request_id;
    grpc::ClientContext c;
    v1::PrefillResponse response;
    const grpc::Status status =
        (*cluster)->prefill().Prefill(&c, PrefillFor(spec, reserved.ticket()), &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), "nests deeper than 256 JSON levels"))
        << status.error_message();
  }
  // Both processes are alive: they serve a request end to end.
  const Outcome outcome = (*cluster)->Run(Spec(790004));
  EXPECT_EQ(outcome.prefill_status, "OK") << outcome.error;
  EXPECT_EQ(outcome.tokens.size(), 4u) << outcome.error;
}

}  // namespace
}  // namespace pdserve::pd::testing
