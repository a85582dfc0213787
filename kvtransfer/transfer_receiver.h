// The decode side of transfers: issues tickets, lands pages, verifies, fences and sweeps leases.
//
// Expect() registers a request's destination pages and returns the ticket for the sender. Pages
// arrive as UCX active messages; each header is checked against the ticket before a byte lands
// (docs/protocol.md, "Verification"), each landed payload is checksummed, and the commit closes
// the transfer. A request's outcome is exactly one of: verified (its pages now belong to the
// caller), failed with an isolation error (pages quarantined until the lease ends), aborted
// (pages held behind the abort fence), abandoned (the sender fenced before committing: it stopped
// and has nothing in flight, e.g. the prefill failed or was aborted on its side) or
// lease-expired. Pages of a request that did not verify go back to the caller only through
// `on_release`, and only when no receive into them is in flight and (for aborts) the sender's
// fence or its commit for the ticket's epoch arrived (a sender commits only once every page send
// completed), or the lease expired (abandoned: at once, once no receive is in flight).
//
// Time: leases, heartbeats and the missing-page grace use the injected clock; Progress() sweeps
// them on every call, and RunFor() waits on the UCX event fd with a timeout so the sweep runs
// even when no message arrives.
//
// Thread-safety: every public method may be called from any thread; one mutex serializes them
// with the UCX worker (whose callbacks run inside Progress()). `on_release` runs with that mutex
// held and must not call back into the receiver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "kvtransfer/isolation_error.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/ucx.h"

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
  // not order a rendezvous page before a later eager commit).
  absl::Duration missing_grace = absl::Milliseconds(200);
  uint64_t incarnation = 0;  // Distinct per process start (e.g. a random number).
};

// One request's destination pages: descriptor and memory per slot (sizes must agree).
struct ReceiveSpec {
  uint64_t request_id = 0;
  uint64_t epoch = 0;  // The pages' epoch in the caller's pool.
  std::vector<PageDescriptor> pages;
  std::vector<std::span<std::byte>> destinations;
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
  uint64_t bytes_landed = 0;
  uint64_t stray_messages = 0;  // Messages for no known ticket or request (dropped).
  std::map<IsolationError, uint64_t> isolation_errors;
  size_t tickets_held = 0;  // Failed, aborted or abandoned tickets whose pages are not released.
  uint64_t abandoned = 0;   // Tickets the sender fenced before committing.
};

class TransferReceiver {
 public:
  // Called when a ticket's pages may be reused (see the file comment). `outcome` is the ticket's
  // final status: the isolation error (kFailed), Cancelled (kAborted) or the abandonment error
  // (kAbandoned).
  using ReleaseFn =
      std::function<void(uint64_t ticket_id, uint64_t request_id, const absl::Status& outcome)>;

  // Creates the UCX context and worker and registers the message handlers. `clock` must outlive
  // the receiver. Errors: the UCX setup error.
  static absl::StatusOr<std::unique_ptr<TransferReceiver>> Create(ReceiverOptions options,
                                                                  const Clock& clock,
                                                                  ReleaseFn on_release);
  ~TransferReceiver();

  // Registers a request's pages and returns its ticket (new ticket id, lease from now).
  // Errors: InvalidArgument when descriptors and destinations disagree in count or size;
  // AlreadyExists when the request already has a ticket in progress.
  absl::StatusOr<Ticket> Expect(ReceiveSpec spec) ABSL_LOCKS_EXCLUDED(mu_);

  // Registers memory that destinations will point into (normally the whole page pool, once), so
  // rendezvous receives land without per-message registration. The memory must outlive the
  // receiver. Errors: the ucp_mem_map error.
  absl::Status RegisterMemory(std::span<std::byte> memory) ABSL_LOCKS_EXCLUDED(mu_);

  // Lands what arrived and sweeps deadlines. Non-blocking.
  void Progress() ABSL_LOCKS_EXCLUDED(mu_);
  // Progresses until `duration` passes on the real clock, sleeping on the UCX event fd between
  // messages (at most `poll_interval` at a time, so deadlines are swept while idle). The mutex
  // is not held while it sleeps, so other calls (Prepare for a Reserve) do not wait for it.
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
  struct Landing;
  TransferReceiver(ReceiverOptions options, const Clock& clock, ReleaseFn on_release,
                   UcxContext context, UcxWorker worker);
  absl::Status RegisterHandlers();

  static ucs_status_t OnPage(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnControl(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnLanded(void* request, ucs_status_t status, size_t length, void* user_data);

  ucs_status_t HandlePage(std::span<const std::byte> header, void* data, size_t length,
                          bool rendezvous) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void HandleControl(std::span<const std::byte> bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLanding(uint64_t ticket_id, uint32_t slot, ucs_status_t status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailEntry(Entry& entry, absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the sender's fence: see ConfirmFence.
  void OnFence(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TryVerify(Entry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  Entry* FindForHeader(const PageHeader& header) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReceiverOptions options_;
  const Clock& clock_;
  const ReleaseFn on_release_;
  mutable absl::Mutex mu_;
  UcxContext context_;
  std::vector<UcxMemory> registered_ ABSL_GUARDED_BY(mu_);  // Outlives the worker's receives.
  UcxWorker worker_ ABSL_GUARDED_BY(mu_);
  const std::vector<std::byte> address_;
  std::map<uint64_t, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ticket_id_ ABSL_GUARDED_BY(mu_) = 1;
  ReceiverStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::kv
