// Test harness of the PD integration tests: one `pdserve prefill` and one `pdserve decode`
// process on loopback (UCX_TLS chosen per cluster), gRPC stubs to both, the router's request flow
// (Reserve, then Prefill and Generate concurrently) and the colocated reference run in-process
// (serving::Scheduler + runtime::EngineStepRunner, the colocated mode's engine path).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "serving/sampling_params.h"
#include "tests/kvtransfer/test_support.h"

namespace pdserve::pd::testing {

struct RequestSpec {
  uint64_t request_id = 0;
  std::vector<int32_t> prompt;
  serving::SamplingParams params;  // n is 1; choice below
  int32_t choice = 0;
};

// One request's outcome, comparable bit for bit.
struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<uint32_t> logprob_bits;  // per token: logprob bits, then (id, bits) per alternative
  std::string finish_reason;
  pdserve::worker::v1::IsolationError isolation_error =
      pdserve::worker::v1::ISOLATION_ERROR_UNSPECIFIED;
  std::string error;           // Generate's error_message or an RPC error
  std::string prefill_status;  // "OK" or the Prefill RPC's error
  bool operator==(const Outcome&) const = default;
};

struct ClusterOptions {
  std::string ucx_tls = "tcp";
  int lease_ms = 30000;
  int64_t decode_max_batch = 64;
  int64_t decode_pool_tokens = 0;
  std::vector<std::string> prefill_env;  // e.g. the TEST-ONLY fault switches
  std::string guards_yaml;               // a `guards:` section for the deploy config, or ""
  int64_t drain_timeout_ms = 30000;      // both workers' --drain-timeout-ms
  int64_t prefill_max_waiting = 256;     // the prefill worker's --max-waiting
  int transfer_lanes = 0;                // transfer.lanes (0: not written, the default)
  std::string ucx_protocols;             // transfer.ucx_protocols ("": not written, v1)
  bool register_pages = false;           // transfer.register_pages (false: not written)
  bool shm_pull = false;                 // transfer.shm_pull (written either way; on by default)
};

class PdCluster {
 public:
  // Starts both workers and waits for Health SERVING. Errors: a process did not come up.
  static absl::StatusOr<std::unique_ptr<PdCluster>> Start(const ClusterOptions& options);
  ~PdCluster();

  // The router's flow for one request. `lease_ms` goes into Reserve.
  Outcome Run(const RequestSpec& spec);
  // Runs `specs` on `clients` threads (each request's own flow); outcomes in spec order.
  std::vector<Outcome> RunAll(const std::vector<RequestSpec>& specs, int clients);

  pdserve::worker::v1::DecodeWorker::Stub& decode() { return *decode_stub_; }
  pdserve::worker::v1::PrefillWorker::Stub& prefill() { return *prefill_stub_; }
  kv::testing::PeerProcess& prefill_process() { return *prefill_process_; }
  kv::testing::PeerProcess& decode_process() { return *decode_process_; }
  // The workers' gRPC ports on 127.0.0.1 (for a router in the test process).
  int prefill_port() const { return prefill_port_; }
  int decode_port() const { return decode_port_; }

 private:
  PdCluster() = default;
  std::string dir_;
  std::unique_ptr<kv::testing::PeerProcess> prefill_process_;
  std::unique_ptr<kv::testing::PeerProcess> decode_process_;
  std::unique_ptr<pdserve::worker::v1::PrefillWorker::Stub> prefill_stub_;
  std::unique_ptr<pdserve::worker::v1::DecodeWorker::Stub> decode_stub_;
  int prefill_port_ = 0;
  int decode_port_ = 0;
};

pdserve::worker::v1::ReserveRequest ReserveFor(const RequestSpec& spec);
pdserve::worker::v1::PrefillRequest PrefillFor(const RequestSpec& spec,
                                               const pdserve::worker::v1::TransferTicket& ticket);
// Reads a Generate stream to its end into `outcome`.
void ReadGenerate(grpc::ClientReader<pdserve::worker::v1::GenerateResponse>& reader,
                  Outcome* outcome);

// The decode worker's Stats (a failed call is a test failure).
pdserve::worker::v1::StatsResponse DecodeStats(PdCluster& cluster);
// Polls the decode worker's stats until every page is free or `timeout` passes; the last stats.
pdserve::worker::v1::StatsResponse AwaitAllPagesFree(PdCluster& cluster, absl::Duration timeout);

// Colocated mode on the bundled model: every spec as one choice of its own request, in one
// continuous batch (batch invariance makes this equal to each alone).
std::vector<Outcome> RunColocated(const std::vector<RequestSpec>& specs);

// Vocabulary of the bundled model.
inline constexpr int32_t kVocab = 4096;

}  // namespace pdserve::pd::testing
