// The prefill side of a transfer: writes one ticket's pages to the decode worker and commits.
//
// Lifecycle (house style, after nixl): Prepare -> Post (per layer, while the engine computes the
// next one, or all at once) -> Commit -> Poll until done -> Release. A Transfer destroyed before it
// is released cancels its sends, waits until none is in flight and then tells the receiver so
// with a fence message (docs/protocol.md, "Abort fence").
//
// Posted pages are queued; at most SenderOptions::max_in_flight_bytes of them are handed to the
// transport at a time, each checksummed just before it is handed over. Poll() then only looks at
// the sends in flight, and the checksum pass runs shortly before UCX copies the same page
// (docs/perf.md, "State transfer over UCX").
//
// Thread-safety: a TransferSender and its Transfers are used by one thread (the one that drives
// the transport).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/task_pool.h"
#include "kvtransfer/page_header.h"
#include "kvtransfer/page_transport.h"
#include "kvtransfer/shm/pull.h"
#include "kvtransfer/ticket.h"
#include "kvtransfer/transfer_metrics.h"

namespace pdserve::kv {

// One page the sender sends: its bytes and the element type of its values (the sender's storage).
// A page whose type differs from the ticket descriptor's goes out as is, the header naming its
// type; the receiver converts (docs/protocol.md, "Element types").
struct SourcePage {
  std::span<const std::byte> bytes;
  serving::ElementType element = serving::ElementType::kFloat32;
};

// Pages in this process's GPU page arena (CUDA IPC; docs/protocol.md, "Same-host
// device-to-device pages (CUDA IPC)"), for a ticket whose pages are GPU memory of the decode
// worker (ShmPullOffer::device_pci_bus_id): per slot the page's offset and length in the arena,
// the element type of its values and the XXH3-64 of its bytes, which the caller took on the GPU
// (kernels/cuda/xxh3.cuh): the sender never reads device memory. The bytes must stay unchanged
// until the transfer ends.
struct DeviceSourcePage {
  uint64_t offset = 0;
  uint64_t length = 0;
  serving::ElementType element = serving::ElementType::kBfloat16;
  uint64_t xxh3 = 0;
};
struct DevicePages {
  shm::IpcRegionName arena;
  std::vector<DeviceSourcePage> pages;  // Index = slot.
  // The pages' xxh3 are not known yet (the prompt is still to run): PrepareDevice ignores them,
  // and Transfer::SetDeviceChecksums must give them before any page is posted. So a prefill
  // prepares the transfer (connects, and its Poll heartbeats renew the decode worker's lease)
  // before it computes the pages, as the host path does.
  bool checksums_pending = false;
};

struct SenderOptions {
  // Bytes of page payload handed to the transport and not yet completed, at most (at least one
  // page is always allowed). With one lane UCX moves data only while the sender polls, so more
  // in flight buys nothing, and a page checksummed long before UCX copies it has left the cache
  // by then; with several lanes their threads move it between polls, and a sender that polls only
  // between layers (the CUDA prefill waiting for the next layer's copy) needs the whole layer in
  // flight: InFlightBytesForLanes.
  size_t max_in_flight_bytes = size_t{8} << 20;
  // Where the transfer metrics go (kvtransfer/transfer_metrics.h; must outlive the sender and
  // its transfers), or nowhere when null; `path` is their path label ("host", "host-staged",
  // "cuda", "loopback"), the transport's lanes() their lanes label.
  TransferMetrics* metrics = nullptr;
  std::string path = "host";
  // Where a posted layer's page checksums are taken (not owned; must outlive the transfers), or
  // null: each page's just before it is handed to the transport, on the caller's thread. With a
  // pool, PostLayer / PostAll checksum all the pages they post at once on its threads, so a
  // prefill's xxh3 pass runs at several cores' speed instead of one's (docs/protocol.md, "Host
  // threads of a transfer"); the headers and the commit carry the same values either way.
  TaskPool* checksum_pool = nullptr;
  // Pull (kvtransfer/shm/pull.h; not owned, must outlive the transfers), or null: a ticket with
  // an shm_pull offer whose pages all lie in this sender's shared region, on this host, with an
  // ack table this process can map, has its pages pulled by the decode worker (kPageRef
  // messages; the metrics' path label "shm-pull"); any other goes by active messages.
  shm::PullSender* shm_pull = nullptr;
  // The page references of PrepareDevice transfers: 3, compact batches (the arena named once a
  // message, up to shm::kMaxDeviceRefsPerBatch pages: docs/protocol.md, "Compact
  // device-reference batches"); 2, one version-2 reference per page, up to 16 a message (what a
  // decode worker built before version 3 understands). The A/B switch of issue 27.
  int device_ref_version = 3;
};

// max_in_flight_bytes for a transport of `lanes` lanes: 8 MiB for one (the default above), 256 MiB
// from two on (lane threads progress the sends; a V4-Flash CSA layer at 128K tokens is ~41 MB).
inline size_t InFlightBytesForLanes(int lanes) {
  return lanes > 1 ? size_t{256} << 20 : size_t{8} << 20;
}

class Transfer {
 public:
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  // Cancels unless Release() succeeded (see the file comment).
  ~Transfer();

  // Posts every page of `layer`. Its state must be final from now on: the checksum is taken when
  // the page is handed to the transport, now or in a later Poll(), as the window allows (with
  // SenderOptions::checksum_pool: here, for all of the layer's pages at once).
  // Errors: FailedPrecondition after Commit or a failure; the transfer's error if it failed.
  absl::Status PostLayer(uint32_t layer);
  // Posts every page not yet posted (same contract as PostLayer).
  absl::Status PostAll();
  // A PrepareDevice transfer prepared with DevicePages::checksums_pending: each slot's XXH3-64
  // of its page bytes (index = slot), taken on the GPU. Errors: FailedPrecondition for another
  // transfer, after the first post or after a failure; InvalidArgument for another count.
  absl::Status SetDeviceChecksums(std::span<const uint64_t> xxh3_by_slot);
  // Asks for the commit, sent once every page send has completed. Requires all pages posted.
  // `more_first_tokens`: a shared prefill's other choices' first tokens (ControlMessage).
  absl::Status Commit(int32_t prompt_tokens, int32_t first_token,
                      std::vector<int32_t> more_first_tokens = {});
  // Drives the transport, hands queued pages to it as earlier ones complete, sends heartbeats,
  // and reports: true once the commit was delivered, false while in flight. Errors (the transfer
  // stops and cancels its sends): Unavailable when the decode worker is lost, DeadlineExceeded
  // when the lease passed, the send's error otherwise.
  absl::StatusOr<bool> Poll();
  // Ends a delivered transfer (no fence needed). Errors: FailedPrecondition if not delivered.
  absl::Status Release();

  const Ticket& ticket() const { return ticket_; }
  // Whether the decode worker pulls this transfer's pages from shared memory.
  // False once the decode worker could not read a page (the rest went as messages).
  bool pulled() const { return pull_.has_value() && !pull_unreadable_; }
  // Why this sender, which has a PullSender, sends the ticket by active messages (no offer in the
  // ticket, or the offer cannot be used); OK when it is pulled or the sender has no PullSender.
  const absl::Status& pull_refusal() const { return pull_refusal_; }
  // Pages posted by the caller (queued or handed to the transport).
  size_t pages_posted() const { return pages_posted_; }
  size_t pages_completed() const { return pages_completed_; }

 private:
  friend class TransferSender;
  Transfer(PageTransport& transport, const Clock& clock, SenderOptions options, Ticket ticket,
           PeerId peer, std::vector<SourcePage> pages, std::optional<shm::PullSender::Acks> pull,
           absl::Status pull_refusal);
  // Queues `slot` (once); Pump hands queued pages to the transport while the window allows.
  // Returns whether the slot was newly queued.
  bool Queue(uint32_t slot);
  // With a checksum pool: takes the checksums of `slots` on it.
  void ChecksumOnPool(const std::vector<uint32_t>& slots);
  absl::Status Pump();
  // The page header of `slot` (its checksum taken).
  PageHeader HeaderOf(uint32_t slot) const;
  // Sends `slot` as a kPage message.
  absl::Status SendSlot(uint32_t slot);
  // Sends the references of `slots` (pulled pages) in one kPageRef message, each slot's send
  // completing on its ack word (PullOp).
  absl::Status SendRefs(const std::vector<uint32_t>& slots);
  // The kPageRef message of `slots` (pages of the GPU arena) in version 3 or 2.
  void EncodeDeviceRefs(const std::vector<uint32_t>& slots, std::vector<std::byte>& out) const;
  // References per kPageRef message when `queued` pages are ready to go.
  size_t RefsPerMessage(size_t queued) const;
  // Sends `slot` (sent before as a reference the decode worker could not read) as a kPage
  // message in its op's place.
  absl::Status ResendAsMessage(uint32_t slot);
  // Collects finished page sends; the first failed one fails the transfer, except a pulled page
  // the decode worker could not read, which goes again as a message (ResendAsMessage).
  absl::Status CollectPages();
  // Encodes the commit with the per-layer digests (every page sent by then) and sends it.
  absl::Status SendCommit();
  absl::Status Fail(absl::Status status);
  void SendHeartbeatIfDue();
  // FailedPrecondition when a GPU-arena transfer has a slot without its checksum.
  absl::Status CheckDeviceChecksums() const;

  PageTransport& transport_;
  const Clock& clock_;
  SenderOptions options_;
  Ticket ticket_;
  PeerId peer_;
  std::vector<std::span<const std::byte>> pages_;
  std::vector<serving::ElementType> elements_;  // Index = slot: the pages' element types.
  std::vector<uint64_t> checksums_;
  std::vector<bool> checksummed_;  // Index = slot: checksums_[slot] taken (on the pool).
  std::vector<std::unique_ptr<SendOp>> page_ops_;  // Index = slot; null unless in flight.
  std::vector<bool> page_queued_;                  // Posted by the caller (index = slot).
  std::vector<bool> page_done_;
  std::deque<uint32_t> queued_;      // Posted, not yet handed to the transport, in post order.
  std::vector<uint32_t> in_flight_;  // Handed to the transport, not yet completed.
  size_t in_flight_bytes_ = 0;
  size_t pages_posted_ = 0;
  size_t pages_completed_ = 0;
  std::unique_ptr<SendOp> commit_op_;
  ControlMessage commit_;  // Set by Commit(); the digests are filled in by SendCommit().
  std::vector<std::byte> commit_bytes_;
  bool commit_requested_ = false;
  std::unique_ptr<SendOp> heartbeat_op_;
  std::vector<std::byte> heartbeat_bytes_;
  absl::Time next_heartbeat_;
  // The lease as the sender can vouch for it: the ticket's deadline, pushed out by the lease's
  // initial length from each heartbeat sent (the receiver renews from arrival, which is later).
  absl::Duration lease_length_;
  absl::Time lease_deadline_;
  absl::Time first_post_at_ = absl::InfinitePast();  // Set by the first Queue().
  absl::Status error_;
  bool delivered_ = false;
  bool released_ = false;
  // Pulled: the decode worker's ack words (the kPageRef messages live in their PullOps).
  std::optional<shm::PullSender::Acks> pull_;
  absl::Status pull_refusal_;
  // Set by the first "failed" ack: every page not yet read goes as a message, under the metrics'
  // path label of messages (message_path_).
  bool pull_unreadable_ = false;
  std::string message_path_;
  // Set for PrepareDevice: the GPU arena the pages lie in, and each slot's offset there.
  std::optional<shm::IpcRegionName> device_;
  std::vector<uint64_t> device_offsets_;
};

class TransferSender {
 public:
  // `transport` and `clock` must outlive the sender and its transfers.
  TransferSender(PageTransport& transport, const Clock& clock, SenderOptions options = {})
      : transport_(transport), clock_(clock), options_(options) {}

  // Connects to the ticket's decode worker and checks the sources against the ticket: one page per
  // slot, each exactly WireBytes(descriptor, its element type). The spans must stay valid until
  // the Transfer ends. Errors: InvalidArgument (count or size mismatch, an unknown element type),
  // DeadlineExceeded (lease already over), the transport's connect error.
  absl::StatusOr<std::unique_ptr<Transfer>> PrepareWithElements(const Ticket& ticket,
                                                                std::vector<SourcePage> pages);
  // PrepareWithElements with every page in its descriptor's element type (the descriptor's
  // bytes exactly).
  absl::StatusOr<std::unique_ptr<Transfer>> Prepare(const Ticket& ticket,
                                                    std::vector<std::span<const std::byte>> pages);
  // A transfer of pages in this process's GPU arena to a decode worker that lands them in its
  // GPU pages: each page goes as a kPageRef message naming the arena (the decode worker copies
  // it device to device and checksums it on its GPU), and completes on its ack word as a pulled
  // page does. Needs SenderOptions::shm_pull (for the ack words) and a ticket whose offer names
  // a device. A page the decode worker could not read fails the transfer (there is no host copy
  // to send instead); the decode worker, not this sender, decides whether its next tickets ask
  // for GPU pages (no PullSender::Disable).
  // With pages.checksums_pending the checksums come later (Transfer::SetDeviceChecksums); a
  // post before them fails (FailedPrecondition).
  // Errors: as PrepareWithElements; FailedPrecondition when the ticket's pages are not GPU
  // memory, there is no PullSender, the arena is on another host than the offer or the ack
  // words cannot be mapped; InvalidArgument when a page lies outside the arena.
  absl::StatusOr<std::unique_ptr<Transfer>> PrepareDevice(const Ticket& ticket, DevicePages pages);

 private:
  // Checks `ticket`'s page sizes against `sizes` (per slot: bytes and element type) and its
  // lease, and connects to its decode worker.
  absl::StatusOr<PeerId> Connect(
      const Ticket& ticket, const std::vector<std::pair<uint64_t, serving::ElementType>>& sizes);

  PageTransport& transport_;
  const Clock& clock_;
  SenderOptions options_;
};

}  // namespace pdserve::kv
