// The decode worker (pdserve.worker.v1.DecodeWorker): reserves a request's state pages and issues
// the transfer ticket, verifies the prefill worker's pages (kv::TransferReceiver), and decodes
// verified requests in a continuous batch, streaming their tokens to Generate.
//
// Life of a request: Reserve allocates the pages for prompt + max_tokens (all or nothing) and
// registers the transferred slots with the receiver. A transfer thread drives UCX and takes
// outcomes: a verified request records the commit's first token in its sampler, emits it as the
// first Generate event and joins the batch; a failed one (isolation error, lease) ends with
// finish_reason "error" and the error kind and is never decoded, its pages quarantined by the
// receiver until the lease ends; one the prefill worker abandoned (its fence before a commit)
// ends with "error" at once, not as an isolation error, its pages freed once no receive is in
// flight. A decode thread steps every decoding request one token per step
// with runtime::EngineStepRunner (one Forward per sequence, the colocated math), so tokens are
// bit-identical to colocated mode; with DecodeWorkerOptions::runner_factory (backend: cuda) with
// runtime::GpuStepRunner instead, which imports each verified request's pages into a GPU slot
// and decodes the whole batch in one step (runtime/cuda/gpu_step_runner.h says what batch
// invariance then holds); with DecodeWorkerOptions::device_landing a request whose prefill
// worker sends from a GPU arena lands in device pages instead (decode/device_pages.cc). Abort
// (or a cancelled Generate) ends the request with "abort": a receiving request's pages are
// released behind the abort fence, a decoding one's after the step in flight. An Abort that
// comes before its Reserve, or while Reserve is registering the request, makes that Reserve
// fail with ABORTED: the ticket never left this worker, so nothing can write the pages and they
// are freed at once (or never allocated). Each of these steps is an event of the request's one
// lifecycle (decode/request_state.h), applied by Apply.
//
// Thread-safety: every RPC may run concurrently on gRPC's threads. Lock order: a request's
// RequestContext::mu, then mu_; the receiver's mutex, then mu_ (on_release, on_outcome). mu_ is
// never held while calling the receiver.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/progress_heartbeat.h"
#include "common/reason_latch.h"
#include "decode/request_state.h"
#include "decode/test_faults.h"
#include "engine/model.h"
#include "guards/canary.h"
#include "kvtransfer/transfer_plan.h"
#include "kvtransfer/ucx/ucx_receive_transport.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "runtime/cuda_ipc_memory.h"
#include "runtime/device_state_pools.h"
#include "runtime/step_runner.h"
#include "serving/page_lease.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/sampling_params.h"
#include "serving/state_layout.h"
#include "worker/worker_model.h"

namespace pdserve::decode {

// The CUDA IPC path's decode side (transfer.cuda_ipc; docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)"): a request whose prefill worker sends from a GPU arena this
// process can map has its pages landed in a device page pool (per lane by `landers`) and
// imported into its GPU slot device to device, layer by layer as the layers verify (the early
// importer's ClaimFromDevice). `pdserve decode` builds it for backend cuda (CudaPageLander,
// cudaMalloc, CheckIpcUsable); the CPU tests give host stand-ins.
struct DeviceLanding {
  std::string pci_bus_id;  // this worker's GPU (ReceiveSpec::device_pci_bus_id)
  // `bytes` of memory for the device page pool, 256-byte aligned, valid while the returned owner
  // lives (the worker keeps it past its pool and receiver).
  struct Memory {
    std::span<std::byte> bytes;
    std::shared_ptr<void> owner;
  };
  std::function<absl::StatusOr<Memory>(size_t bytes)> allocate;
  kv::DeviceLanderFactory landers;
  // OK when this process can map the arena a prefill worker states (same host, its GPU visible:
  // kv::cuda_ipc::CheckIpcUsable), else why not (the request then goes by host pages).
  std::function<absl::Status(const pdserve::worker::v1::CudaIpcSource&)> can_map;
  // Tokens of state the pool holds per request (a request of more goes by host pages; 0: the
  // model's context) and requests it holds at once (their pages are held from Reserve until the
  // import is done).
  int64_t request_tokens = 0;
  int64_t requests = runtime::kCudaIpcPoolRequests;
  // transfer.cuda_ipc on: a pool or lander that cannot be made fails Create; auto: logged, host
  // pages.
  bool required = false;
};

struct DecodeWorkerOptions {
  std::string model_dir = "models/kjv-v4-tiny";
  std::string model_name = "kjv-v4-tiny";
  int64_t max_batch = 64;   // requests holding pages (reserved or decoding); Reserve beyond: 429
  int64_t pool_tokens = 0;  // tokens of state in the pool; 0: max_batch * context length
  absl::Duration lease = absl::Seconds(30);  // transfer lease (config transfer.lease_ms)
  // UCX receive lanes (config transfer.lanes, resolved: docs/protocol.md, "Lanes"), 1 .. 16.
  int transfer_lanes = 1;
  // UCX's protocol implementation (config transfer.ucx_protocols; docs/protocol.md).
  kv::UcxProtocols transfer_ucx_protocols = kv::UcxProtocols::kV1;
  // Register the page pool's host memory with the transport once (config
  // transfer.register_pages; docs/protocol.md, "Registered page memory").
  bool transfer_register_pages = false;
  // transfer.shm_pull: tickets offer prefill workers on this host to have their pages pulled from
  // their shared memory (kvtransfer/shm/pull.h; docs/protocol.md, "Same-host pages by shared
  // memory").
  bool transfer_shm_pull = false;
  std::string transfer_path = "host";  // the transfer metrics' path label
  runtime::RunnerOptions runner;  // degeneration action, prefill_block, paranoid (guards.paranoid)
  // The canary checks 1 in canary_every requests (guards.canary_every; 0: none), picked by
  // guards::CanarySampler over worker::SeedRequestId(request id).
  int64_t canary_every = 0;
  engine::ModelOptions model;  // guards.reference_kernels and test-only faults
  // Empty: decode on the CPU engine (runtime::EngineStepRunner). Set (backend: cuda,
  // runtime/cuda/gpu_backend.h): the runner it returns, with max_batch slots (the CUDA runner
  // recomputes the canary on the GPU; Create sets runner.canary when canary_every > 0); paranoid
  // checks the GPU's state pages. The CPU engine's weights are then not loaded (the config only).
  runtime::RunnerFactory runner_factory;
  // With runner_factory (backend: cuda): the tokens of paged device state the GPU engine's pools
  // hold (worker key `state_tokens`; GpuModelOptions::state_tokens; 0: every slot full). Reserve
  // then also reserves each request's device pages (runtime::DeviceStatePools) for prompt +
  // max_tokens: RESOURCE_EXHAUSTED when they are short now (the router waits or asks another
  // decode worker), FAILED_PRECONDITION when the request exceeds a whole pool (a 400 to the
  // client). Unset: the device pools are not counted. With the CPU engine (no runner_factory;
  // the deploy config allows the key for backend cuda only) the pools are counted though nothing
  // holds them: how the CPU tests check admission (tests/decode/device_pages_test.cc).
  std::optional<int64_t> device_state_tokens;
  TestFaults faults;  // TEST-ONLY (decode/test_faults.h); none by default
  // Set: the CUDA IPC path where a request's prefill worker offers it (DeviceLanding). Needs a
  // runner with an early importer (CUDA on one GPU, transfer.early_import); without one every
  // request goes by host pages.
  std::optional<DeviceLanding> device_landing;
};

class DecodeWorker final : public pdserve::worker::v1::DecodeWorker::Service {
 public:
  // Loads the model, builds the pool, creates the UCX receiver (UCX_TLS) and starts the transfer
  // and decode threads.
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerOptions options);
  // Stops the threads; open Generate streams end.
  ~DecodeWorker() override;

  grpc::Status Reserve(grpc::ServerContext* context,
                       const pdserve::worker::v1::ReserveRequest* request,
                       pdserve::worker::v1::ReserveResponse* response) override;
  grpc::Status Generate(grpc::ServerContext* context,
                        const pdserve::worker::v1::GenerateRequest* request,
                        grpc::ServerWriter<pdserve::worker::v1::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const pdserve::worker::v1::AbortRequest* request,
                     pdserve::worker::v1::AbortResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const pdserve::worker::v1::StatsRequest* request,
                     pdserve::worker::v1::StatsResponse* response) override;
  grpc::Status Health(grpc::ServerContext* context,
                      const pdserve::worker::v1::HealthRequest* request,
                      pdserve::worker::v1::HealthResponse* response) override;

  std::string MetricsText() const;
  // The decode loop's heartbeat (a step, or an idle wait of at most 20 ms): the systemd watchdog.
  const ProgressHeartbeat& progress() const { return progress_; }
  // Turns DRAINING: Health says STATE_DRAINING, Reserve answers UNAVAILABLE from here on (a
  // Reserve already past that check still completes). Idempotent; thread-safe.
  void BeginDrain() { draining_ = true; }
  // BeginDrain, then waits up to `timeout` for every reserved request to finish and its stream
  // to end. Requests still open
  // then end with a final event finish_reason "abort", error_message "worker shutting down"
  // (never a silent cut); waits at most 2 s more for their streams to take it. Returns whether
  // every request finished by itself.
  bool Drain(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops the threads and ends every open Generate stream (idempotent).
  void Stop();

 private:
  struct Request {
    uint64_t request_id = 0;
    serving::RequestId sequence = 0;  // owner of the pages in the pool
    uint64_t ticket_id = 0;
    int32_t choice = 0;
    // A shared reservation (SamplingParams.choice_count = n > 1, decode/fork.cc): fork k of it
    // is worker request group + k with choice `choice` + k. Fork 0 (this record when forks is
    // not empty) receives the transfer; forks 1 .. n-1 hold their own pages, wait in kReceiving
    // on the same ticket, and start from a copy of fork 0's pages once the transfer verified.
    // n = 1: group == request_id, fork 0, no forks.
    uint64_t group = 0;
    int32_t fork = 0;
    std::vector<std::shared_ptr<Request>> forks;
    serving::SamplingParams params;
    std::vector<int32_t> prompt;  // the prompt ids, or zeros when the router sent none
    serving::PageTable table;
    // The worker's hold on `table`'s pages, from admission while the state holds pages
    // (HoldsPages); its early import holds them too while it may read them
    // (runtime/early_import.h), so they go back to the pool when both let go.
    std::shared_ptr<const serving::PageLease> pages;
    // Changed only by Apply / Finish (decode/request_state.h says what each state holds).
    RequestState state = RequestState::kReceiving;
    bool attached = false;  // a Generate stream reads the events (the stream's, not the request's)
    int64_t generated = 0;  // tokens emitted (the first token included)
    std::string degeneration_kind;  // non-empty once flagged (TokenEvent::degeneration_kind)
    absl::Time done_at = absl::InfiniteFuture();
    std::deque<pdserve::worker::v1::GenerateResponse> events;
    std::shared_ptr<runtime::RequestContext> context;
    // Its GPU slot was claimed at Reserve and is imported layer by layer as the transfer runs
    // (decode/early_import.cc); cleared when the runner takes the slot or the import is
    // cancelled.
    bool early_import = false;
    // The CUDA IPC path: the request's pages in the device page pool, where the transfer lands
    // (decode/device_pages.cc); held until its import is taken or the request ends.
    std::shared_ptr<const serving::PageLease> device_pages;
  };

  struct RequestCounts {
    int64_t running = 0;            // decoding
    int64_t waiting = 0;            // receiving their state
    int64_t quarantined_pages = 0;  // failed or aborted, pages not yet released
  };

  DecodeWorker() = default;
  absl::Status AddMetrics();
  RequestCounts CountRequests() const ABSL_LOCKS_EXCLUDED(mu_);
  // Pages of failed or aborted requests not yet released (behind their fence or lease).
  int64_t QuarantinedPages() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Reserve, in three steps: the request record from a validated ReserveRequest (nothing
  // allocated); its admission (a batch slot and its pages, the receive spec for the receiver);
  // its registration with the receiver, which issues the ticket.
  absl::StatusOr<pdserve::worker::v1::TransferTicket> DoReserve(
      const pdserve::worker::v1::ReserveRequest& request);
  absl::StatusOr<std::shared_ptr<Request>> NewRequest(
      const pdserve::worker::v1::ReserveRequest& request) const;
  // `choice_count` batch slots and pages: fork 0's in `record`, the others' (AdmitForksLocked)
  // in record.forks.
  absl::StatusOr<kv::ReceiveSpec> AdmitLocked(Request& record, int32_t choice_count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A shared reservation's forks 1 .. n-1 (decode/fork.cc): their records with pages of their
  // own (all or nothing; nothing is kept on an error), set into record.forks.
  absl::Status AdmitForksLocked(Request& record, int32_t choice_count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Batch slots and pages for `choice_count` sequences: FailedPrecondition when this worker can
  // never hold them (more than max_batch, or more pages than its whole pool), naming n.
  absl::Status CheckForkFit(const Request& record, int32_t choice_count) const;
  // The pages a request of `total_tokens` tokens reserves per pool kind: the state layout's, then
  // (device_state_tokens) the device pools'.
  serving::PageDemand Demand(int64_t total_tokens) const;
  // Where each planned page of `record`'s table lands.
  absl::StatusOr<kv::ReceiveSpec> ReceiveSpecFor(const Request& record, int64_t total_tokens);
  absl::StatusOr<pdserve::worker::v1::TransferTicket> Register(std::shared_ptr<Request> record,
                                                               kv::ReceiveSpec spec);

  // A transfer outcome the receiver pushed (OnOutcome), for the transfer loop.
  struct Decided {
    uint64_t request_id = 0;
    uint64_t ticket_id = 0;
    kv::TransferOutcome outcome;
  };
  void TransferLoop();
  // Forgets finished requests nobody streamed for kKeepFinished.
  void SweepFinished() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The receiver decided `ticket_id` (its on_outcome; runs under the receiver's mutex): queued
  // for the transfer loop, which handles it after the receiver's current RunFor.
  void OnOutcome(uint64_t ticket_id, uint64_t request_id, const kv::TransferOutcome& outcome)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Verified: starts decoding; otherwise EndTransfer.
  void HandleOutcome(const Decided& decided) ABSL_LOCKS_EXCLUDED(mu_);
  // The transfer ended without verifying (failed, abandoned, aborted): the request ends with the
  // outcome's error or abort.
  void EndTransfer(const Decided& decided) ABSL_LOCKS_EXCLUDED(mu_);

  // The transfer of `request_id` verified: checks the commit against the reservation (prompt
  // length, one first token per fork), starts every fork of it (StartFork), then the request
  // itself: records the first token and joins the batch.
  void StartDecoding(uint64_t request_id, const kv::ControlMessage& commit);
  // Samples from the verified state: the request's sampler records `first_token`, the token is
  // emitted, and the sequence joins the batch (or ends: aborted meanwhile, a final first token).
  void StartSequence(const std::shared_ptr<Request>& record, int32_t first_token)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The commit does not fit the reservation (never forked nor decoded): why, else OK.
  static absl::Status CheckCommit(const Request& record, const kv::ControlMessage& commit);
  // Fork `fork` of `base`'s verified state: copies base's transferred pages into the fork's own
  // (each read and written through its owner's handle), then StartSequence. An aborted fork
  // ends instead; a failed copy fails the fork alone (loudly).
  void StartFork(const Request& base, const std::shared_ptr<Request>& fork, int32_t first_token)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status CopyVerifiedPages(const Request& base, const Request& fork);
  // Ends every fork of `base` that is still receiving with `reason` / `error` (the shared
  // transfer failed, was released unverified, or its commit was refused); their pages go back
  // at once (nothing ever wrote them).
  void EndForks(Request& base, const std::string& reason, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a record of `base`'s reservation (base or a fork) still waits for the transfer
  // unaborted (kReceiving).
  // REQUIRES: mu_ held.
  static bool GroupWaiting(const Request& base);
  // Emits the verified first token; true when it was the request's last.
  bool EmitFirstToken(Request& r, int32_t first_token,
                      const std::optional<serving::FinishReason>& finish)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The runner's per-request context: its callbacks queue the request's events.
  std::shared_ptr<runtime::RequestContext> MakeContext(const std::shared_ptr<Request>& record,
                                                       serving::RequestSampler sampler);
  // Adds the verified request to the runner and the batch.
  void JoinBatch(Request& r, int32_t first_token) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The CUDA IPC path (decode/device_pages.cc): for a request whose prefill worker offers it and
  // this worker can map, the device pages, the slot's import from them and `spec` rewritten to
  // land there. False (nothing kept; `spec` as it was) when the request goes by host pages.
  bool BeginDeviceImport(Request& record, const pdserve::worker::v1::ReserveRequest& request,
                         int32_t choice_count, kv::ReceiveSpec* spec) ABSL_LOCKS_EXCLUDED(mu_);
  // Why `request` cannot go by device pages here, or OK.
  absl::Status DevicePagesRefusal(const pdserve::worker::v1::ReserveRequest& request,
                                  int32_t choice_count, int64_t total_tokens) const;
  absl::Status CreateDevicePool();
  // A lander refused a page of the arena named `source` (it cannot be mapped here, or the range
  // is outside it): requests from that GPU go by host pages for kDeviceSuspension (the failed
  // request itself fails, loudly, as any failed transfer). Runs on a lane thread under the
  // receiver's mutex.
  void SuspendDeviceSource(const std::string& source, const absl::Status& why)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Early import (decode/early_import.cc; the runner's EarlyImporter, RunnerOptions::
  // early_import). Claims `record`'s slot (no forks; no mu_ held); on failure the request
  // imports at its first step as without early import.
  void BeginEarlyImport(Request& record, int32_t choice_count) ABSL_LOCKS_EXCLUDED(mu_);
  // The receiver's on_layer (its mutex held): every page of `layer` landed and checked.
  void OnLayer(uint64_t request_id, uint32_t layer) ABSL_LOCKS_EXCLUDED(mu_);
  // A verified early-imported request waits for its last copies before it joins the batch;
  // false (join now) for one without early import.
  bool DeferJoin(const std::shared_ptr<Request>& record, int32_t first_token)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The early import of a request that ended unjoined is cancelled by the transfer loop.
  void QueueImportCancel(Request& request) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The transfer loop's share: the queued cancels, then each deferred join whose import is
  // ready (joins the batch), failed (the request fails with the error) or aborted.
  void RunEarlyImports() ABSL_LOCKS_EXCLUDED(mu_);

  void DecodeLoop();
  // The next step's plan: every decoding request, in sequence order; false when stopping.
  bool PlanStep(serving::StepPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // Requests that finished or were aborted leave the batch after the step.
  void LeaveBatch() ABSL_LOCKS_EXCLUDED(mu_);

  // Moves `request` on by `event` (NextRequestState); its pages go back to the pool when the new
  // state holds none. An illegal event is a bug: logged as an error, and the request fails
  // (finish_reason "error") instead of going on silently. Returns whether the event was legal.
  bool Apply(Request& request, RequestEvent event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the final event (unless one is queued already), then applies `event`.
  void Finish(Request& request, RequestEvent event, std::string reason, absl::Status error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void QueueFinal(Request& request, std::string reason, const absl::Status& error)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets a finished request once nothing refers to it any more.
  void MaybeForget(uint64_t request_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Remembers (boundedly) that `request_id` was aborted before its Reserve registered it.
  void RememberAborted(uint64_t request_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The receiver released `ticket_id`'s pages; `outcome` is the ticket's final status.
  void OnRelease(uint64_t ticket_id, const absl::Status& outcome) ABSL_LOCKS_EXCLUDED(mu_);
  // Aborts `request_id`; returns whether its pages are already free. `prefill_quiesced`: the
  // prefill worker said no write is or will be in flight (AbortRequest.prefill_quiesced), which
  // stands for the sender's fence.
  bool AbortRequest(uint64_t request_id, bool prefill_quiesced) ABSL_LOCKS_EXCLUDED(mu_);
  // Aborts worker requests request_id .. request_id + count - 1 (a shared reservation's forks,
  // the last first); returns whether all their pages are free.
  bool AbortRequests(uint64_t request_id, uint32_t count, bool prefill_quiesced)
      ABSL_LOCKS_EXCLUDED(mu_);

  DecodeWorkerOptions options_;
  worker::WorkerModel model_;
  // With transfer_shm_pull: the ack words of its tickets (before receiver_, which writes them).
  std::unique_ptr<kv::shm::AckTable> acks_;
  std::unique_ptr<serving::PagePool> pool_;
  std::optional<runtime::DeviceStatePools> device_pools_;  // with device_state_tokens
  // With device_landing: the device page pool's memory (before the pool) and the pool.
  DeviceLanding::Memory device_memory_;
  std::unique_ptr<serving::PagePool> device_page_pool_;
  int64_t device_request_tokens_ = 0;  // the most tokens one request may hold there
  // Arenas ("boot id / PCI bus id") a lander refused, and until when requests from them go by
  // host pages.
  absl::flat_hash_map<std::string, absl::Time> device_suspended_ ABSL_GUARDED_BY(mu_);
  ReasonLatch<> device_refusals_;  // the last reason a request offered GPU pages went by host
  SystemClock clock_;
  // Before receiver_, which records into it (and whose lane threads ~DecodeWorker stops first).
  std::unique_ptr<kv::TransferMetrics> transfer_metrics_;
  std::unique_ptr<kv::TransferReceiver> receiver_;
  // The receiver's UCX protocols in effect (set at Create; its tickets state them).
  kv::UcxProtocols ucx_protocols_ = kv::UcxProtocols::kV1;
  std::unique_ptr<runtime::SequenceRunner> runner_;
  std::atomic<bool> draining_{false};

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Request>> requests_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint64_t> by_ticket_ ABSL_GUARDED_BY(mu_);
  std::vector<Decided> decided_ ABSL_GUARDED_BY(mu_);  // OnOutcome -> TransferLoop
  // The runner's early importer (null without early import), and its work for the transfer
  // loop: verified requests waiting for their imports, and sequences whose import must end.
  runtime::EarlyImporter* early_importer_ = nullptr;
  struct DeferredJoin {
    std::shared_ptr<Request> record;
    int32_t first_token = 0;
  };
  std::vector<DeferredJoin> deferred_joins_ ABSL_GUARDED_BY(mu_);
  std::vector<serving::RequestId> import_cancels_ ABSL_GUARDED_BY(mu_);
  // Ids of requests aborted before (or while) Reserve registered them: their Reserve fails.
  // Bounded (kAbortedRemembered); the deque holds them oldest first.
  absl::flat_hash_set<uint64_t> aborted_ids_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> aborted_order_ ABSL_GUARDED_BY(mu_);
  serving::RequestId next_sequence_ ABSL_GUARDED_BY(mu_) = 1;
  std::thread transfer_thread_;
  std::thread decode_thread_;
  ProgressHeartbeat progress_;

  metrics::Registry registry_;
  metrics::Gauge* running_gauge_ = nullptr;
  metrics::Gauge* waiting_gauge_ = nullptr;
  metrics::Histogram* batch_size_ = nullptr;
  metrics::Histogram* step_seconds_ = nullptr;
  metrics::Counter* tokens_total_ = nullptr;
  metrics::Family<metrics::Gauge>* pages_used_ = nullptr;
  metrics::Family<metrics::Gauge>* pages_free_ = nullptr;
  metrics::Family<metrics::Counter>* isolation_failures_ = nullptr;
  metrics::Gauge* fenced_pages_ = nullptr;
  metrics::Family<metrics::Counter>* degenerate_ = nullptr;
  metrics::Counter* canary_checks_ = nullptr;
  metrics::Counter* canary_mismatches_ = nullptr;
  guards::CanarySampler canary_{0};  // set once in Create
};

}  // namespace pdserve::decode
