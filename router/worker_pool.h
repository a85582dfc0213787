// The router's view of its prefill and decode workers: a gRPC channel and stub per worker, the
// load the router has dispatched to it, and its health.
//
// A worker is up when its last health check passed and its circuit breaker is closed. The
// health checker (a thread per worker, every `health_interval`; every min(health_interval,
// down_retry) while the worker is not up) calls Health with a deadline and
// then runs a canary: a real one-token generation (Reserve on a decode worker, Prefill on a prefill
// worker, Generate) through the worker and an up partner of the other role, so a worker that
// still answers Health but cannot generate (wedged engine) is caught too. `down_after` checks
// failing in a row mark a worker down; one passing check marks it up again (and closes its
// breaker). The circuit breaker opens after `breaker_failures` request failures in a row
// (UNAVAILABLE or DEADLINE_EXCEEDED from the worker), so traffic moves away before the next
// check; a success resets the count.
//
// Busy is not wedged: a prefill worker whose canary Prefill passes its deadline (the canary
// waited in a full queue) still passes its check when its Stats RPC answers within
// `health_timeout` and its transfer_bytes + prefilled_tokens + forward_layers grew since the
// checker's previous sample (it sent state, finished a forward chunk or computed a layer of one,
// also when the work that delayed the canary has just drained), or there is no sample
// yet and it reports waiting or running requests. A stopped worker answers neither Health nor
// Stats and is marked down after `down_after` checks as before; one that answers but sends
// nothing is wedged and fails.
//
// Model identity (docs/operations.md, "Model identity"): every passing Health also states the
// worker's model name, model fingerprint and page geometry. The cluster's identity is the
// options' expected_* fields where set (the router's own model directory), each other field the
// first value a worker states whose pinned fields match. A worker that states a different value
// of any field is marked down at once (worker_up 0; /ready 503 when no prefill and decode pair is
// left) and the log names both identities; every check compares again, so a worker restarted on
// the right model comes back. A field a worker leaves unset (one that predates it) is not compared.
//
// The canary tries partners in order until one passes: a failure of the partner's own step moves
// on to the next partner, as does a ticket mismatch (the prefill worker refused the decode
// worker's ticket: another page geometry, fingerprint or UCX protocols), which counts against the
// worker under check when no partner passes. So a decode worker whose tickets no prefill worker
// accepts fails its own check, while a prefill worker passes through any good decode worker. A
// Prefill that fails ends the canary at once (its Generate is cancelled: no transfer will come).
//
// Every failed check leaves its reason on the worker (Worker::check_failure): a canary's is
// logged once per change of reason (not at every check), and while no worker of a role is up the
// client's 503 names each one's reason (NoWorkerUp; a pair or identity mismatch is the code
// workers_incompatible, docs/operations.md).
//
// Thread-safety: every method is thread-safe; Worker references stay valid for the pool's life.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deploy_config.h"
#include "common/reason_latch.h"
#include "grpcpp/security/credentials.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"

namespace pdserve::router {

enum class Role { kPrefill, kDecode };
const char* RoleName(Role role);

class Worker {
 public:
  // `credentials` null: an insecure channel.
  Worker(config::WorkerConfig config, Role role, int breaker_failures,
         std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

  const std::string& name() const { return config_.name; }
  Role role() const { return role_; }
  std::string address() const;
  // REQUIRES: role() == kDecode / kPrefill respectively.
  worker::v1::DecodeWorker::Stub* decode() const { return decode_.get(); }
  worker::v1::PrefillWorker::Stub* prefill() const { return prefill_.get(); }

  bool up() const { return healthy_.load() && !breaker_open_.load(); }
  int64_t load() const { return load_.load(); }
  // Load counted at dispatch: +1 when a request is sent, -1 when its work here ends.
  void AddLoad(int64_t delta) { load_.fetch_add(delta); }

  // Request outcomes for the circuit breaker.
  void RecordSuccess();
  void RecordFailure();
  // Health checker results.
  void RecordCheck(bool passed, int down_after);
  // The checker's last Stats sample of transfer_bytes + prefilled_tokens + forward_layers (-1:
  // none yet); returns the previous one.
  int64_t ExchangeProgress(int64_t progress) { return progress_.exchange(progress); }
  // Decode worker: its batch slots as its last passing Health check stated them (0: not stated).
  int64_t max_batch() const { return max_batch_.load(); }
  void set_max_batch(int64_t slots) { max_batch_.store(slots); }
  // Prefill worker: where its GPU arena lies, as its last passing Health check stated it (unset:
  // it sends host pages only). The router passes it to the decode worker at each Reserve for a
  // request this worker prefills (ReserveRequest.prefill_cuda_ipc), which decides the path.
  std::optional<worker::v1::CudaIpcSource> cuda_ipc() const ABSL_LOCKS_EXCLUDED(cuda_ipc_mu_) {
    absl::MutexLock lock(&cuda_ipc_mu_);
    return cuda_ipc_;
  }
  void set_cuda_ipc(std::optional<worker::v1::CudaIpcSource> source)
      ABSL_LOCKS_EXCLUDED(cuda_ipc_mu_) {
    absl::MutexLock lock(&cuda_ipc_mu_);
    cuda_ipc_ = std::move(source);
  }
  // A hash of the other model identity the last check found (0: the cluster's, or no check
  // yet); returns the previous one.
  uint64_t ExchangeWrongModel(uint64_t stated) { return wrong_model_.exchange(stated); }
  bool breaker_open() const { return breaker_open_.load(); }

  // Why the last check failed (reason empty: it passed, or no check yet); `mismatch`: the worker
  // cannot work with the cluster as configured (it serves another model, or every partner it was
  // tried with refused the pair), which no retry mends.
  struct CheckFailure {
    std::string reason;
    bool mismatch = false;
  };
  // Records the last check's failure; true when its reason changed to a new failure (then it is
  // logged: common/reason_latch.h).
  bool RecordCheckFailure(CheckFailure failure) { return failure_.Record(std::move(failure)); }
  CheckFailure check_failure() const { return failure_.last(); }

 private:
  const config::WorkerConfig config_;
  const Role role_;
  const int breaker_failures_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<worker::v1::DecodeWorker::Stub> decode_;
  std::unique_ptr<worker::v1::PrefillWorker::Stub> prefill_;
  std::atomic<int64_t> load_{0};
  std::atomic<bool> healthy_{false};  // down until the first check passes
  std::atomic<bool> breaker_open_{false};
  std::atomic<int> request_failures_{0};
  std::atomic<int> check_failures_{0};
  std::atomic<int64_t> progress_{-1};
  std::atomic<int64_t> max_batch_{0};
  std::atomic<uint64_t> wrong_model_{0};
  mutable absl::Mutex cuda_ipc_mu_;
  std::optional<worker::v1::CudaIpcSource> cuda_ipc_ ABSL_GUARDED_BY(cuda_ipc_mu_);
  ReasonLatch<CheckFailure> failure_;
};

// The ReserveRequest field for a request `prefill` prefills: its GPU arena's place when its
// Health stated one (ReserveRequest.prefill_cuda_ipc), else left unset.
void SetPrefillCudaIpc(const Worker& prefill, worker::v1::ReserveRequest* reserve);

// What a worker states about the model it computes with (HealthResponse model,
// model_fingerprint, page_geometry); empty / 0: not stated.
struct ModelIdentity {
  std::string model;
  uint64_t fingerprint = 0;
  std::string page_geometry;
  // "model M, fingerprint F, geometry G", F as common::FingerprintText; an unset field reads
  // `unset` (a worker's: "not stated"; the cluster's: "not known yet").
  std::string ToString(const char* unset = "not stated") const;
};

// The log line's account of a worker that states another identity than the cluster's
// (docs/operations.md, "Model identity"): "differs in F[, F]: it states ...; the cluster is ...",
// naming the fields that differ (model, fingerprint, geometry), then both identities; a field of
// the cluster's that no matching worker has stated yet reads "not known yet".
std::string DescribeModelMismatch(const ModelIdentity& stated, const ModelIdentity& cluster);

struct WorkerPoolOptions {
  std::vector<config::WorkerConfig> prefill;
  std::vector<config::WorkerConfig> decode;
  // The channels' credentials (mutual TLS, common/tls_credentials.h); null: insecure.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Duration health_interval = absl::Seconds(1);
  // A worker that is not up is checked again after min(health_interval, down_retry): one that
  // was not listening yet when the router started (`pdserve up` starts them together) or that
  // came back comes up within this, not a whole health_interval (up to 10 minutes).
  absl::Duration down_retry = absl::Seconds(1);
  absl::Duration health_timeout = absl::Seconds(2);  // Health RPC deadline
  absl::Duration canary_timeout = absl::Seconds(5);  // whole canary generation deadline
  int down_after = 2;
  int breaker_failures = 3;
  std::vector<int32_t> canary_prompt;  // token ids; empty: no canary (Health only)
  int64_t lease_ms = 30000;
  bool background_checks = true;  // false: only CheckAll() checks (tests)
  // Called (from the checker) after every failed check that leaves the worker down.
  std::function<void(Worker&)> on_still_down;
  // The cluster's model identity as far as the router knows it (RouterService: the served name
  // and the fingerprint of its model directory when that holds weights); unset fields are taken
  // from the first worker that states them.
  ModelIdentity expected;
};

class WorkerPool {
 public:
  // Creates the channels (no connection yet) and starts the health checkers, whose first checks
  // run at once. `next_request_id` hands out cluster-unique request ids for canaries.
  WorkerPool(WorkerPoolOptions options, std::function<uint64_t()> next_request_id);
  ~WorkerPool();  // stops the checker
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  std::vector<Worker*> prefill() const;
  std::vector<Worker*> decode() const;
  // At least one prefill and one decode worker up.
  bool Ready() const;
  // Checks every worker once now (tests; the checker threads check on their own every interval).
  void CheckAll();

  // The client's error while no worker of `role` is up: "no prefill worker is up (p0: REASON;
  // p1: ...)", each worker's last check failure (at most 4 workers named), and whether every one
  // of them is down for a mismatch (Worker::CheckFailure). Racy by nature: checks run meanwhile.
  struct Unavailable {
    std::string message;
    bool mismatch = false;
  };
  Unavailable NoWorkerUp(Role role) const;

 private:
  // What one check found: passed, failed (down after `down_after` in a row), or another model
  // (down at once).
  enum class Verdict { kPassed, kFailed, kWrongModel };
  enum class CanaryResult { kPassed, kPrefillFailed, kDecodeFailed, kPairFailed };
  struct CheckResult {
    Verdict verdict = Verdict::kPassed;
    Worker::CheckFailure failure;  // why it did not pass
    // The failure is a canary's, logged by CheckAndRecord when its reason changed (the others
    // are logged where they are found).
    bool log_on_change = false;
  };
  CheckResult Check(Worker& worker);
  // Compares `stated` with the cluster's identity, adopting the fields not known yet; logs a
  // mismatch when it is new for `worker`.
  bool SameModel(Worker& worker, const ModelIdentity& stated) ABSL_LOCKS_EXCLUDED(identity_mu_);
  // Canaries of `worker` through its up partners (see the header comment).
  CheckResult CanaryThroughPartners(Worker& worker);
  // `why`: set to the reason when the result is not kPassed.
  CanaryResult Canary(Worker& prefill, Worker& decode, Role checked, std::string* why);
  // Whether a prefill worker whose canary timed out is busy (see the header comment).
  bool PrefillBusy(Worker& prefill);
  // One checker thread per worker, so a worker whose checks hang until their deadline does not
  // delay the others' verdicts.
  void Loop(Worker& worker);
  // Runs one check of `worker` and records it (then on_still_down when it is down).
  void CheckAndRecord(Worker& worker);
  // A check's RPC context, registered while its call may be in flight so that the destructor
  // can cancel it: a worker that stopped answering would otherwise hold the pool's (the
  // router's) shutdown for up to health_timeout / canary_timeout. Cancelled at once when the
  // pool is already stopping.
  class CallScope;

  const WorkerPoolOptions options_;
  const std::function<uint64_t()> next_request_id_;
  std::vector<std::unique_ptr<Worker>> prefill_;
  std::vector<std::unique_ptr<Worker>> decode_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> calls_ ABSL_GUARDED_BY(mu_);  // CallScope
  std::vector<std::thread> checkers_;
  absl::Mutex identity_mu_;
  ModelIdentity cluster_ ABSL_GUARDED_BY(identity_mu_);
};

}  // namespace pdserve::router
