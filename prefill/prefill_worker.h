// The prefill worker (pdserve.worker.v1.PrefillWorker): runs a request's prompt through the
// engine, samples its first token, and writes the request's state pages to the decode worker
// named by the ticket over UCX (kvtransfer/), then commits.
//
// Math. The prompt runs on a PrefillEngine (runtime/prefill_engine.h): the CPU engine by default,
// the CUDA engine (runtime/cuda) with PrefillWorkerOptions::engine_factory. Both cut the prompt at
// absolute multiples of `prefill_block` (64), exactly as the colocated runners cut them
// (runtime/step_runner.h), and the first token is sampled here from the engine's last logits
// with serving::RequestSampler keyed (seed, choice, position = prompt length). On the CPU engine
// the state and the token are bit-identical to colocated mode's; on the CUDA engine they are
// `serve --backend cuda`'s prefill (same engine, same cuts).
//
// Transfer. The engine stores each layer's final prompt state into the worker's own pool pages
// (runtime::PagedState::StoreLayer, the transfer format) and hands the layer over; the worker
// posts its pages (Transfer::PostLayer) at once. On the CPU engine that happens inside the final
// block's forward, so UCX moves layer l while layers l+1.. compute; on the CUDA engine after the
// whole forward (runtime/cuda/gpu_prefill_engine.h says why). Slots come from kv::PlanTransfer.
// A ticket that asks for GPU pages (transfer.cuda_ipc) is served from the worker's GPU arena
// instead (prefill/device_pages.cc, DeviceArena).
// Heartbeats go out between prefill blocks, so a long prompt keeps its lease. One prefill runs at
// a time (the UCX transport is single-threaded; the CPU backend's GEMMs already use every core;
// the CUDA engine has one slot); others wait in FIFO order (run_queue_), at most max_waiting.
//
// Abort(request) stops a waiting or running prefill; a waiting one leaves the queue at once and
// never starts; a running transfer is destroyed, which cancels its sends and sends the abort fence
// (docs/protocol.md). Abort answers quiesced = true once the request no longer runs. A Prefill
// that fails after the transfer was prepared also destroys the transfer, so the decode worker
// gets the fence and ends the request at once (not an isolation failure).
//
// Thread-safety: every RPC may run concurrently on gRPC's threads.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics.h"
#include "common/progress_heartbeat.h"
#include "common/reason_latch.h"
#include "engine/model.h"
#include "kvtransfer/fault_transport.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/transfer_plan.h"
#include "kvtransfer/transfer_sender.h"
#include "kvtransfer/ucx/ucx_transport.h"
#include "pdserve/worker/v1/worker.grpc.pb.h"
#include "prefill/test_faults.h"
#include "runtime/prefill_engine.h"
#include "serving/page_pool.h"
#include "serving/sampler.h"
#include "serving/state_layout.h"
#include "worker/worker_model.h"

namespace pdserve::prefill {

// The CUDA IPC path's prefill side (transfer.cuda_ipc; docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)"): the request's pages lie in a GPU arena the decode worker
// maps, written there by the engine (PrefillEngine::RunToDevice, with GPU checksums) and sent as
// page references (TransferSender::PrepareDevice), for tickets that ask for GPU pages. `pdserve
// prefill` builds it for backend cuda (kv::cuda_ipc::IpcPageArena); the CPU tests give a host
// stand-in.
struct DeviceArena {
  std::span<std::byte> memory;  // the arena's device memory, 256-byte aligned
  kv::shm::IpcRegionName name;  // how page references name it (boot id and GPU included)
  std::shared_ptr<void> owner;  // keeps `memory` (the worker holds it past its pool)
};
struct DeviceArenaOptions {
  // An arena of `bytes` (one sequence's pages of `tokens` tokens).
  std::function<absl::StatusOr<DeviceArena>(size_t bytes)> allocate;
  int64_t tokens = 0;  // transfer.cuda_ipc_arena_tokens; 0: the model's context
  // transfer.cuda_ipc on: an arena that cannot be made fails Create; auto: logged, host pages.
  bool required = false;
};

struct PrefillWorkerOptions {
  std::string model_dir = "models/kjv-v4-tiny";
  std::string model_name = "kjv-v4-tiny";
  int64_t prefill_block = 64;  // as runtime::RunnerOptions::prefill_block
  // Prefills waiting for their turn beyond this are refused with RESOURCE_EXHAUSTED (the router
  // answers 429), so a queue never outlives the transfer leases its requests hold on decode.
  // Default 256: four decode workers' worth of reservations (--max-batch 64 each); a deployment
  // whose prefill is slow against its lease sets it lower.
  int64_t max_waiting = 256;
  TestFaults faults;           // test-only; off by default
  engine::ModelOptions model;  // guards.reference_kernels and test-only faults
  // Empty: the CPU engine (engine::Model, loaded here). Set (backend: cuda, runtime/cuda): the
  // engine it returns; the CPU engine's weights are then not loaded (the config only).
  runtime::PrefillEngineFactory engine_factory;
  // UCX send lanes (config transfer.lanes, resolved: docs/protocol.md, "Lanes"), 1 .. 16.
  int transfer_lanes = 1;
  // UCX's protocol implementation (config transfer.ucx_protocols; docs/protocol.md).
  kv::UcxProtocols transfer_ucx_protocols = kv::UcxProtocols::kV1;
  // Register the page pool's host memory with the transport once (config
  // transfer.register_pages; docs/protocol.md, "Registered page memory").
  bool transfer_register_pages = false;
  // transfer.shm_pull: the page pool in a shared region decode workers on this host may pull
  // from (kvtransfer/shm/pull.h; docs/protocol.md, "Same-host pages by shared memory").
  bool transfer_shm_pull = false;
  std::string transfer_path = "host";  // the transfer metrics' path label
  // Set: tickets asking for GPU pages are served from a GPU arena (needs an engine with
  // stores_device_pages(); without one the worker states no arena and such tickets fail).
  std::optional<DeviceArenaOptions> device_arena;
};

class PrefillWorker final : public pdserve::worker::v1::PrefillWorker::Service {
 public:
  // Loads the model (the CPU engine, or the config and options.engine_factory's engine) and
  // generation_config.json and creates the UCX transport (UCX_TLS).
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(PrefillWorkerOptions options);
  ~PrefillWorker() override;

  grpc::Status Prefill(grpc::ServerContext* context,
                       const pdserve::worker::v1::PrefillRequest* request,
                       pdserve::worker::v1::PrefillResponse* response) override;
  grpc::Status Abort(grpc::ServerContext* context, const pdserve::worker::v1::AbortRequest* request,
                     pdserve::worker::v1::AbortResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const pdserve::worker::v1::StatsRequest* request,
                     pdserve::worker::v1::StatsResponse* response) override;
  grpc::Status Health(grpc::ServerContext* context,
                      const pdserve::worker::v1::HealthRequest* request,
                      pdserve::worker::v1::HealthResponse* response) override;

  std::string MetricsText() const { return registry_.Serialize(); }
  // The running prefill's heartbeat (each chunk, layer posted and transfer poll; idle while no
  // prefill runs): the systemd watchdog.
  const ProgressHeartbeat& progress() const { return progress_; }
  // Starts refusing new prefills (UNAVAILABLE; Health says DRAINING): every Prefill that
  // arrives after this returns is refused. Idempotent; thread-safe.
  void BeginDrain() ABSL_LOCKS_EXCLUDED(mu_);
  // BeginDrain, then waits up to `timeout` for running and queued prefills to finish, then
  // aborts the rest (their transfers fence) and waits at most 5 s more for them to stop.
  // Returns whether every prefill finished by itself.
  bool Drain(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // What RunPrefill checked and derived from a request before it waits for its turn.
  struct Admitted {
    uint64_t id = 0;
    int32_t choice = 0;
    int32_t choice_count = 1;  // choices choice .. choice + choice_count - 1 share this prefill
    std::vector<int32_t> prompt;
    int64_t prompt_length = 0;
    int64_t max_tokens = 0;
    int64_t total = 0;  // prompt + max_tokens: the extent of the request's pages
    kv::Ticket ticket;
    std::optional<serving::RequestSampler> sampler;  // set
  };
  // One transfer as RunPrefill drives it; transfer_error once a failure is the transfer's own.
  struct Sending {
    kv::Transfer& transfer;
    const grpc::ServerContext& context;
    bool transfer_error = false;
    absl::Status Fail(absl::Status status) {
      transfer_error = true;
      return status;
    }
  };
  // When the engine ran and the pages left, for the metrics and the response.
  struct Timing {
    absl::Time prefill_start;
    absl::Time prefill_end;
    absl::Time first_post = absl::InfiniteFuture();
    absl::Time transfer_end;
  };

  PrefillWorker() = default;
  // The steps of one Prefill RPC, in order: Admit, AwaitTurn, PlanSources, StartTransfer,
  // PrefillAndSend (PrefillPages, Deliver, RecordTransfer, Response), Failed on an error.
  absl::StatusOr<pdserve::worker::v1::PrefillResponse> RunPrefill(
      const pdserve::worker::v1::PrefillRequest& request, const grpc::ServerContext& context);
  // The request's tokens, sampling and ticket against the model, the engine and Reserve's plan.
  absl::StatusOr<Admitted> Admit(const pdserve::worker::v1::PrefillRequest& request) const;
  // `fingerprint`: this worker's model fingerprint, `protocols`: its transport's UCX protocols
  // (a ticket stating another of either is refused, marked worker::kTicketMismatch); `now`: this
  // worker's clock, from which the ticket's lease deadline is measured (kv::TicketFromProto).
  static absl::StatusOr<kv::Ticket> CheckTicket(const pdserve::worker::v1::PrefillRequest& request,
                                                const Admitted& a, uint64_t fingerprint,
                                                kv::UcxProtocols protocols, absl::Time now);
  // Waits for the request's turn (then run_busy_ and running_ are set for it), its abort or
  // cancellation (Cancelled), or half its lease (ResourceExhausted).
  absl::Status AwaitTurn(uint64_t id, absl::Time lease_deadline, const grpc::ServerContext& context)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The pages of `table` in the ticket's slot order, checked against the ticket.
  absl::StatusOr<std::vector<kv::SourcePage>> PlanSources(const Admitted& a,
                                                          serving::RequestId sequence,
                                                          const serving::PageTable& table);
  // The plan of `table` (pages of `pool`), checked against the ticket's slots.
  absl::StatusOr<std::vector<kv::PlannedPage>> CheckedPlan(const Admitted& a,
                                                           const serving::PageTable& table) const;
  // Connects to the decode worker (through `faulty` when test faults apply); counts a failure.
  absl::StatusOr<std::unique_ptr<kv::Transfer>> StartTransfer(const Admitted& a,
                                                              std::vector<kv::SourcePage> sources,
                                                              kv::FaultInjectingTransport& faulty)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  absl::StatusOr<pdserve::worker::v1::PrefillResponse> PrefillAndSend(
      Admitted& a, const serving::PageTable& table, Sending& sending);
  // A failed Prepare: counted ("lease_expired" or "connect") and marked the decode worker's.
  absl::Status PrepareFailed(absl::Status status);
  // OK unless the request was aborted or cancelled or the transfer failed (drives it once).
  absl::Status Check(uint64_t id, Sending& sending);
  // Runs the prompt on the engine, posting each layer as it is stored; samples the first token
  // of every covered choice from the last position's logits (a.choice_count of them, in order).
  absl::StatusOr<std::vector<serving::SampledToken>> PrefillPages(Admitted& a,
                                                                  const serving::PageTable& table,
                                                                  Sending& sending, Timing* t);
  // Commits the first tokens, drives the transfer until the commit is delivered, releases it.
  absl::Status Deliver(const Admitted& a, std::span<const serving::SampledToken> first,
                       Sending& sending);
  void RecordTransfer(const kv::Ticket& ticket, const Timing& t, bool pulled);
  static pdserve::worker::v1::PrefillResponse Response(const Admitted& a,
                                                       std::span<const serving::SampledToken> first,
                                                       const Timing& t);
  // Counts `status` (by its reason when the transfer failed, else "prefill_error") and returns
  // it, marked as the decode worker's failure unless it was a cancellation this worker was asked
  // for (`aborted`: an Abort, the call cancelled, or the drain).
  absl::Status Failed(absl::Status status, bool transfer_error, bool aborted);
  // The first tokens of every covered choice from the last position's logits.
  absl::StatusOr<std::vector<serving::SampledToken>> SampleFirst(Admitted& a,
                                                                 std::span<const float> last);

  // The CUDA IPC path (prefill/device_pages.cc), for a ticket whose pages are GPU memory: the
  // arena's pool (CreateDeviceArena), the request's pages there, RunToDevice, PrepareDevice of
  // their references, the commit. FailedPrecondition when this worker has no arena.
  absl::Status CreateDeviceArena() ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  absl::StatusOr<pdserve::worker::v1::PrefillResponse> RunDevicePrefill(
      Admitted& a, const grpc::ServerContext& context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  // The page references of the ticket's slots (`plan`) in the arena's pages of `sequence`, their
  // checksums pending.
  absl::StatusOr<kv::DevicePages> DeviceSources(serving::RequestId sequence,
                                                const std::vector<kv::PlannedPage>& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  // Runs the prompt into the arena's pages of `table`, polling `sending`'s transfer between
  // chunks; each slot's GPU checksum (`checksums`, index = slot of `plan`) and the first tokens.
  absl::StatusOr<std::vector<serving::SampledToken>> PrefillDevicePages(
      Admitted& a, const serving::PageTable& table, const std::vector<kv::PlannedPage>& plan,
      Sending& sending, std::vector<uint64_t>* checksums, Timing* t)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(run_mu_);
  static bool AsksDevicePages(const kv::Ticket& ticket) {
    return ticket.shm_pull.has_value() && !ticket.shm_pull->device_pci_bus_id.empty();
  }
  bool Aborted(uint64_t request_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Logs a failed Prefill at worker::FailureLogLevel; a refused ticket (worker::kTicketMismatch)
  // only when its reason changes (common/reason_latch.h), else at debug.
  void LogFailure(uint64_t id, const absl::Status& status, bool cancelled_by_caller);
  // Counts one failed transfer in pdserve_prefill_transfer_failures_total: reason "cancelled"
  // only when `aborted` (the router aborted the request or cancelled its call: a client that went
  // away, or a request that ended elsewhere), so the transfer-failure alert can leave those out;
  // otherwise "lease_expired" for DEADLINE_EXCEEDED and "remote_error" for anything else (a
  // transport's own CANCELLED included).
  void CountFailure(const absl::Status& status, bool aborted);
  void RememberAborted(uint64_t request_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  PrefillWorkerOptions options_;
  worker::WorkerModel model_;
  std::unique_ptr<runtime::PrefillEngine> engine_;  // driven under run_mu_
  // With transfer_shm_pull: the pool's memory (before pool_, which lives in it) and its puller.
  std::unique_ptr<kv::shm::SharedRegion> shared_pages_;
  std::unique_ptr<serving::PagePool> pool_;
  std::unique_ptr<kv::shm::PullSender> pull_sender_;
  // With device_arena (an engine that stores device pages): the arena (before its pool, which
  // lives in it), the pool of one sequence there, and the ack-word mapper PrepareDevice needs
  // (over a one-page region of its own: nothing is pulled from host memory through it).
  DeviceArena arena_;
  std::unique_ptr<serving::PagePool> arena_pool_;
  std::unique_ptr<kv::shm::SharedRegion> arena_acks_region_;
  std::unique_ptr<kv::shm::PullSender> arena_acks_;
  // The last reason a ticket with an shm_pull offer went by active messages (logged on change).
  ReasonLatch<> pull_refusals_;
  SystemClock clock_;
  uint64_t incarnation_ = 0;
  kv::UcxProtocols ucx_protocols_ = kv::UcxProtocols::kV1;  // transport_'s, set at Create
  std::atomic<bool> draining_{false};
  ReasonLatch<> ticket_refusals_;  // the last refused ticket's reason

  // Serializes prefills: the UCX transport and the pool's one sequence.
  absl::Mutex run_mu_;
  std::unique_ptr<kv::UcxTransport> transport_ ABSL_GUARDED_BY(run_mu_);
  std::unique_ptr<kv::TransferMetrics> transfer_metrics_;  // Set at Create.
  serving::RequestId next_sequence_ ABSL_GUARDED_BY(run_mu_) = 1;

  mutable absl::Mutex mu_;
  absl::flat_hash_set<uint64_t> active_ ABSL_GUARDED_BY(mu_);  // running or waiting
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  // Prefills waiting for their turn, in arrival order; run_busy_ while one runs.
  std::deque<uint64_t> run_queue_ ABSL_GUARDED_BY(mu_);
  bool run_busy_ ABSL_GUARDED_BY(mu_) = false;
  absl::flat_hash_set<uint64_t> aborted_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> aborted_order_ ABSL_GUARDED_BY(mu_);  // bounds aborted_
  std::atomic<int64_t> transfer_bytes_{0};
  std::atomic<int64_t> transfer_bytes_pulled_{0};  // of transfer_bytes_: pulled (shm pull)
  std::atomic<int64_t> prefilled_tokens_{0};       // forward chunks completed (Stats: progress)
  std::atomic<int64_t> forward_layers_{0};         // layers computed, every chunk (Stats: progress)
  ProgressHeartbeat progress_;

  metrics::Registry registry_;
  metrics::Counter* tokens_total_ = nullptr;
  metrics::Gauge* queue_depth_ = nullptr;
  metrics::Counter* queue_timeouts_ = nullptr;  // gave up in the queue: the lease would end
  metrics::Histogram* chunk_tokens_ = nullptr;
  metrics::Histogram* latency_ = nullptr;
  // Prompts run through the engine, for one choice or shared by several (choice_count > 1).
  metrics::Counter* runs_single_ = nullptr;
  metrics::Counter* runs_shared_ = nullptr;
  metrics::Counter* transfer_bytes_total_ = nullptr;
  metrics::Histogram* transfer_seconds_ = nullptr;
  metrics::Histogram* bandwidth_ = nullptr;
  metrics::Family<metrics::Counter>* failures_ = nullptr;
  metrics::Gauge* in_flight_ = nullptr;
};

}  // namespace pdserve::prefill
