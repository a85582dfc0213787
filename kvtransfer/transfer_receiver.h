// The decode side of transfers: issues tickets, lands pages, verifies, fences and sweeps leases.
//
// Expect() registers a request's destination pages and returns the ticket for the sender. Pages
// arrive through a ReceiveTransport (UCX active messages in production, kvtransfer/ucx/; the
// in-process loopback in tests); each header is checked against the ticket before a byte lands
// (docs/protocol.md, "Verification"), each landed payload is checksummed, and the commit closes
// the transfer. A request's outcome is exactly one of: verified (its pages now belong to the
// caller), failed with an isolation error (pages quarantined until the lease ends), aborted
// (pages held behind the abort fence), abandoned (the sender fenced before committing: it stopped
// and has nothing in flight, e.g. the prefill failed or was aborted on its side) or
// lease-expired. `on_outcome` reports each outcome once, when it is decided. Pages of a request
// that did not verify go back to the caller only through `on_release`, and only when no receive
// into them is in flight and (for aborts) the sender's fence or its commit for the ticket's epoch
// arrived (a sender commits only once every page send completed), or the lease expired
// (abandoned: at once, once no receive is in flight).
//
// Time: leases, heartbeats and the missing-page grace use the injected clock; Progress() sweeps
// them on every call, and RunFor() sleeps on the transport's wake-up with a timeout so the sweep
// runs even when no message arrives. A stall of the receiver itself pauses the missing-page grace
// (ReceiverOptions::run_clock).
//
// Thread-safety: every public method may be called from any thread; one mutex serializes them
// with the transport (whose sink callbacks run inside Progress(), or on its lane threads under
// the same mutex: ReceiveTransport::SetSinkMutex). A landed page's checksum (and its element
// conversion) runs outside that mutex on a lane thread (LandingTarget::finish), so lanes verify
// in parallel; only the comparison with the header and the bookkeeping take the mutex.
// `on_release` and `on_outcome` run with that mutex held and must not call back into the receiver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/receive_transport.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/transfer_metrics.h"

namespace pdserve::kv {

enum class TransferState {
  kReceiving,  // Waiting for pages or the commit.
  kVerified,   // Every check passed; the caller owns the pages.
  kFailed,     // Isolation error; pages quarantined until the lease ends.
  kAborted,    // Abort(); pages held behind the fence.
  // The sender's fence (or ConfirmFence) arrived before any commit: the sender stopped and has no
  // write in flight. Not an isolation error; pages released once no receive is in flight.
  kAbandoned,
};

struct ReceiverOptions {
  absl::Duration lease = absl::Seconds(10);  // Initial lease; each heartbeat renews it.
  absl::Duration heartbeat_interval = absl::Seconds(1);
  // How long after the commit a page may still be landing before it counts as missing (UCX does
  // not order a rendezvous page before a later eager commit, nor lanes against each other; on a
  // loaded host a lane's pages came 234-285 ms after the commit: docs/protocol.md, "Lanes").
  absl::Duration missing_grace = absl::Seconds(2);
  // The clock that tells whether the receiver ran (not owned, must outlive it), or null. A gap
  // of more than `missing_grace` between two sweeps by it means the receiver did not run (a
  // stopped or starved process, a paused VM): a page still in a lane's socket could not land
  // meanwhile (after a stall the first sweep may run before the lane threads deliver), so the
  // gap is added to the grace of every commit already in hand. Tests inject their own: the
  // injected `clock` cannot tell a stall from a test moving time.
  const Clock* run_clock = nullptr;
  uint64_t incarnation = 0;  // Distinct per process start (e.g. a random number).
  // Where the transfer metrics go (side "receive"; must outlive the receiver), or nowhere when
  // null; `metrics_path` is their path label, the transport's lanes() their lanes label.
  TransferMetrics* metrics = nullptr;
  std::string metrics_path = "host";
  // Called once per layer of a receiving ticket when every page of that layer has landed and
  // matched its header's checksum: the layer's bytes are in their destinations and stay as they
  // are (each page lands at most once), in whatever order the layers complete. The transfer is
  // NOT verified yet (the commit, the layer digests, a later page may still fail it): what the
  // caller does with the layer must stay unreadable until the verified outcome (the CUDA decode
  // worker's early import, runtime/early_import.h). Every layer is reported before the verified
  // outcome; none after any other outcome. Runs with the receiver's mutex held (on the thread
  // that landed the page) and must not call back into the receiver. Empty: not called.
  std::function<void(uint64_t ticket_id, uint64_t request_id, uint32_t layer)> on_layer;
  // The shm-pull ack table (kvtransfer/shm/pull.h; not owned, must outlive the receiver), or null:
  // tickets then carry no shm_pull offer. With it, each ticket takes one word per page (none
  // left: that ticket goes without an offer) and every page of it that lands, fails to land or is
  // refused after its header named the ticket gets its word written. A verified ticket's words
  // are freed at once (its sender read them all before it committed), others' at release.
  shm::AckTable* acks = nullptr;
};

// One request's destination pages: descriptor and memory per slot (sizes must agree).
struct ReceiveSpec {
  uint64_t request_id = 0;
  uint64_t epoch = 0;  // The pages' epoch in the caller's pool.
  std::vector<PageDescriptor> pages;
  std::vector<std::span<std::byte>> destinations;
  // Non-empty: the destinations are GPU memory on the GPU of this PCI bus id (a CUDA decode
  // worker's device pages; docs/protocol.md, "Same-host device-to-device pages (CUDA IPC)").
  // Only pages in the sender's GPU arena land there (the transport's shm::DevicePageLander
  // copies and checksums them on the GPU), each in its descriptor's element type; the ticket's
  // shm-pull offer names the GPU. Needs the receiver's ack table (ReceiverOptions::acks).
  std::string device_pci_bus_id;
};

struct TransferOutcome {
  TransferState state = TransferState::kReceiving;
  // The isolation error when kFailed; Cancelled when kAborted; Aborted (canonical code, not an
  // isolation error) "the prefill worker abandoned the transfer ..." when kAbandoned.
  absl::Status status;
  std::optional<ControlMessage> commit;  // Set once verified.
};

struct ReceiverStats {
  uint64_t pages_landed = 0;
  uint64_t bytes_landed = 0;    // Payload bytes as sent (before any element conversion).
  uint64_t stray_messages = 0;  // Messages for no known ticket or request (dropped).
  std::map<IsolationError, uint64_t> isolation_errors;
  size_t tickets_held = 0;  // Failed, aborted or abandoned tickets whose pages are not released.
  uint64_t abandoned = 0;   // Tickets the sender fenced before committing.
};

class TransferReceiver final : private PageSink {
 public:
  // Called when a ticket's pages may be reused (see the file comment). `outcome` is the ticket's
  // final status: the isolation error (kFailed), Cancelled (kAborted) or the abandonment error
  // (kAbandoned).
  using ReleaseFn =
      std::function<void(uint64_t ticket_id, uint64_t request_id, const absl::Status& outcome)>;

  // Called once per ticket when its outcome is decided (it leaves kReceiving): verified (with the
  // commit), failed, aborted or abandoned. A verified outcome reported here counts as read.
  using OutcomeFn =
      std::function<void(uint64_t ticket_id, uint64_t request_id, const TransferOutcome& outcome)>;

  // A receiver over `transport` (sink set here). `clock` must outlive the receiver;
  // `on_outcome` may be empty. kvtransfer/ucx/ucx_receive_transport.h: CreateUcxReceiver.
  TransferReceiver(std::unique_ptr<ReceiveTransport> transport, ReceiverOptions options,
                   const Clock& clock, ReleaseFn on_release, OutcomeFn on_outcome = nullptr);
  // Waits (at most 2 s) for receives in flight, then stops the transport's lane threads. Not
  // analysed: it drops the mutex between rounds and must not hold it while the threads stop.
  ~TransferReceiver() override ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // Registers a request's pages and returns its ticket (new ticket id, lease from now).
  // Errors: InvalidArgument when descriptors and destinations disagree in count or size, or the
  // PCI bus id is too long; AlreadyExists when the request already has a ticket in progress;
  // FailedPrecondition for device destinations without an ack table or a free run of its words
  // (the caller then lands in host pages).
  absl::StatusOr<Ticket> Expect(ReceiveSpec spec) ABSL_LOCKS_EXCLUDED(mu_);

  // Lets GPU destination pages (ReceiveSpec::device_pci_bus_id) land: the transport's
  // ReceiveTransport::SetDeviceLanders, which must be thread-safe against its own lane threads
  // (the UCX one sets each lane's lander under the lane's mutex; mu_ is not held). Call before
  // the first Expect with GPU destinations.
  // Errors: the transport's (Unimplemented for a transport without GPU landing) or the factory's.
  absl::Status SetDeviceLanders(const DeviceLanderFactory& make)
      ABSL_LOCKS_EXCLUDED(mu_) ABSL_NO_THREAD_SAFETY_ANALYSIS;

  // Registers memory that destinations will point into (normally the whole page pool, once), so
  // rendezvous receives land without per-message registration. The memory must outlive the
  // receiver. Errors: the transport's (ucp_mem_map's) error.
  absl::Status RegisterMemory(std::span<std::byte> memory) ABSL_LOCKS_EXCLUDED(mu_);

  // Lands what arrived and sweeps deadlines. Non-blocking.
  void Progress() ABSL_LOCKS_EXCLUDED(mu_);
  // Progresses until `duration` passes on the real clock, sleeping on the transport's wake-up
  // (the UCX event fd) between messages (at most `poll_interval` at a time, so deadlines are swept
  // while idle). The mutex is not held while it sleeps, so other calls (Prepare for a Reserve) do
  // not wait for it.
  void RunFor(absl::Duration duration, absl::Duration poll_interval = absl::Milliseconds(5))
      ABSL_LOCKS_EXCLUDED(mu_);

  // Errors: NotFound once the ticket was released (or never existed). A verified outcome stays
  // readable until the lease ends and it was read once (or one more lease passed unread).
  absl::StatusOr<TransferOutcome> Outcome(uint64_t ticket_id) const ABSL_LOCKS_EXCLUDED(mu_);

  // Stops accepting pages for the ticket; its pages are released behind the fence: the sender's
  // fence message, its commit for the ticket's epoch (before or after the abort), ConfirmFence,
  // or the lease end. Errors: NotFound; FailedPrecondition if it was already verified (the
  // caller owns the pages).
  absl::Status Abort(uint64_t ticket_id) ABSL_LOCKS_EXCLUDED(mu_);
  // The control plane's word that the sender has no write in flight and never will (same effect
  // as a fence message): an aborted ticket's pages are released once no receive is in flight; a
  // ticket still receiving without a commit becomes kAbandoned. Unknown tickets are ignored.
  void ConfirmFence(uint64_t ticket_id) ABSL_LOCKS_EXCLUDED(mu_);

  const std::vector<std::byte>& worker_address() const { return address_; }
  uint64_t incarnation() const { return options_.incarnation; }
  ReceiverStats stats() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry;

  // PageSink: run inside transport_->Progress(), with mu_ held.
  std::optional<LandingTarget> OnPageHeader(std::span<const std::byte> header,
                                            size_t length) override;
  void OnPageLanded(uint64_t ticket_id, uint32_t slot, absl::Status status,
                    uint64_t finished) override;
  void OnControl(std::span<const std::byte> bytes) override;

  // The header checks of docs/protocol.md "Verification" for a page of a receiving entry; the
  // isolation error of the first that fails, else OK.
  absl::Status CheckPage(const Entry& entry, const PageHeader& header, size_t length) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleCommitOrHeartbeat(Entry& entry, ControlMessage message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Leaves kReceiving for `state` with `status` and reports the outcome.
  void Decide(Entry& entry, TransferState state, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailEntry(Entry& entry, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The transfer metrics of a decided entry (options_.metrics).
  void RecordMetrics(const Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the sender's fence: see ConfirmFence.
  void OnFence(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TryVerify(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds a gap in the receiver's sweeps longer than the grace to the grace of the commits that
  // came before it (ReceiverOptions::run_clock).
  void PauseGraceOverStall(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lease and missing-page deadlines of a receiving entry.
  void CheckDeadlines(Entry& entry, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Entry* FindForHeader(const PageHeader& header) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes slot `slot`'s ack word of an entry with an shm-pull offer (options_.acks).
  void Ack(const Entry& entry, uint32_t slot, shm::AckState state)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReceiverOptions options_;
  const Clock& clock_;
  const ReleaseFn on_release_;
  const OutcomeFn on_outcome_;
  mutable absl::Mutex mu_;
  const std::unique_ptr<ReceiveTransport> transport_ ABSL_PT_GUARDED_BY(mu_);
  const std::vector<std::byte> address_;
  std::map<uint64_t, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_id_ ABSL_GUARDED_BY(mu_) = 1;
  ReceiverStats stats_ ABSL_GUARDED_BY(mu_);
  // The last sweep, by the run clock and by the injected clock (PauseGraceOverStall).
  absl::Time last_sweep_run_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  absl::Time last_sweep_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace pdserve::kv
